"""A quantised allreduce with error feedback, advanced without blocking (:class:`QuantizedRing`).

Every rank holds ``x`` (fp32, its contribution: gradient plus last step's error) and ends with
the same ``x`` = the decoded sum, with point-to-point ops (``batch_isend_irecv``: Gloo and NCCL).
``x`` is cut into N segments of whole blocks (:mod:`gradientflow.comm.quantize`); rank s owns
segment s.  Two rounds:

1. Reduce-scatter, direct: every rank quantises each segment it does not own and sends it to the
   segment's owner; the owner decodes the N-1 contributions and adds them to its own, exact
   (in rank order, so the sum is deterministic).
2. Allgather: the owner quantises the whole sum once and sends those bytes to every other rank;
   every rank (the owner too) decodes the same bytes, so all ranks end with identical sums.

Why not a chain round the ring (dequantise-add-requantise at every hop): each hop requantises a
growing partial sum, so a segment collects the noise of N quantisations at 1/N, 2/N, .., N/N of its
magnitude (1.9x one quantisation of the sum at 4 ranks); the direct reduce-scatter quantises only
the contributions (N-1 of them at 1/N) and the sum once (1.2x).  Measured on the quality bench's
AdamW transformer at 4 ranks, see docs/results/adamw.md.  The bytes are the same: each rank sends
``(N-1)/N`` of one quantised copy in each round, ``2 (N-1)/N`` in all, as a dense ring, so they do
not grow with the world size; two rounds instead of the ring's 2 (N-1) hops.

Two ranks: one exchange of each rank's whole quantised contribution, the same bytes (one quantised
copy each way), and each rank adds the two decoded contributions.  The sum is then never
requantised: its noise is that of the two contributions alone (measured: 1.030 -> 1.018 of DDP's
loss against requantising the sum, docs/results/adamw.md).

Error feedback: each rank quantises every element exactly once per allreduce (the segments it
sends, and the sum of the one it owns), and ``err`` receives ``value before quantisation - decoded
value`` there.  Summed over ranks the errors telescope: ``sum_r err_r + result == sum_r x_r``
elementwise up to fp32 rounding of the adds: nothing is lost, it is only delayed to the next step.

Non-blocking: :meth:`QuantizedRing.poll` does the work of every round whose messages have arrived
and posts the next, never waiting; :meth:`QuantizedRing.wait` drives it to the end.  Gloo's
point-to-point works never report completion before ``wait()`` (``is_completed()`` stays False,
torch 2.13), so one daemon thread (:class:`_Waiter`) only *waits* on each round's works, GIL
released, and flags them done; it never issues a collective.  The engine
polls at every gradient hook, so the allreduce of a bucket runs while backward goes on, on the
training thread (collectives are only ever issued from it, in the same order on every rank).
Several in flight over the same group are matched by posting order: every pair of ranks posts
its sends and receives in the same (allreduce, round) order.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from . import codec_native
from .quantize import dequantize, encode, quantize, wire_bytes
from .ring import _split
from .waiter import Arrival as _Arrival
from .waiter import waiter_for


def encode_share(
    x: torch.Tensor,
    err: torch.Tensor,
    wire: torch.Tensor,
    bits: int,
    block: int,
    *,
    clip: float = 0.0,
    levels: str = "fitted",
    carry: bool = False,
    fused: codec_native.Fused | None = None,
) -> bool:
    """A two-rank exchange's first half: ``x``'s codes (``carry``: of ``x + err``; ``fused``: divided by the
    preconditioner's ``r``) into ``wire``, the error into ``err``.  True where ``x`` then holds its decoded values
    (the torch ops), False where the kernel leaves them to :func:`sum_shares` (one write and read of ``x`` fewer)."""
    return not encode(x, wire, bits, block, err, clip=clip, levels=levels, carry=carry, fused=fused)


def sum_shares(
    x: torch.Tensor,
    err: torch.Tensor,
    own: torch.Tensor,
    peer: torch.Tensor,
    bits: int,
    block: int,
    *,
    levels: str = "fitted",
    own_in_x: bool,
    fused: codec_native.Fused | None = None,
) -> None:
    """The second half: ``x`` = our decoded values + the peer's (a + b == b + a: both ranks hold the same bits),
    our own decoded again from ``own`` beside the peer's in one pass unless ``own_in_x``; ``fused``: then ``x``
    and ``err`` multiplied back by ``r`` in the same pass."""
    e = err if fused is not None else None
    if own_in_x:
        dequantize(peer, x.numel(), bits, block, levels, x, True, fused, e)
    else:
        dequantize(own, x.numel(), bits, block, levels, x, False, fused, e, peer)


def post_p2p(group: dist.ProcessGroup, ops: list[tuple[bool, torch.Tensor, int]]) -> list[dist.Work]:
    """Post ``(send?, tensor, peer)`` point-to-point ops over ``group``, peers by the group's own ranks, in order.

    A group c10d registered (``init_process_group``, ``new_group``): ``batch_isend_irecv``, which NCCL needs (one
    NCCL group call, or a send and a receive between the same two ranks can deadlock).  A group it did not register
    (torchft's quorum group, :mod:`gradientflow.outer.membership`, rebuilt at every quorum): torch's
    ``batch_isend_irecv`` refuses it ("not registered"), so the group's own ``send`` and ``recv``, what torch's
    ``isend`` / ``irecv`` call on Gloo, posted in the same order on every rank."""
    if group in dist.distributed_c10d._world.pg_group_ranks:
        p2p = [dist.P2POp(dist.isend if send else dist.irecv, t, group=group, group_peer=q) for send, t, q in ops]
        return dist.batch_isend_irecv(p2p)
    return [group.send([t], q, 0) if send else group.recv([t], q, 0) for send, t, q in ops]


class PairExchange:
    """A two-rank exchange's wire alone: ``send`` to the other rank of ``group``, ``recv`` from it (host bytes; the
    messages :class:`QuantizedRing` posts on two ranks, in the same order, so either may run on the other rank).
    For a caller that encodes and decodes the bytes itself (:mod:`gradientflow.strategies.csc_quantized`)."""

    def __init__(self, send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, timeout: timedelta | None):
        peer = 1 - group.rank()
        self._works = post_p2p(group, [(False, recv, peer), (True, send, peer)])
        self._arrived = waiter_for(group).watch(self._works, timeout)
        self.done = False

    def poll(self) -> bool:
        """True once ``recv`` holds the peer's bytes (and ours left); never blocks."""
        if not self.done and self._arrived.event.is_set():
            self._arrived.check()
            self.done = True
        return self.done

    def wait(self) -> None:
        """Block until both messages completed (bounded by ``timeout``)."""
        if not self.done:
            self._arrived.event.wait()
            self._arrived.check()
            self.done = True


class QuantizedRing:
    """One in-place quantised SUM allreduce of ``x`` over ``group``, error into ``err``.

    ``x`` and ``err``: fp32, contiguous, 1-D, the same numel on every rank.  ``bits`` / ``block``:
    the block quantiser's (``block`` a multiple of 16).  ``carry``: ``x`` holds the new contribution
    alone and ``err`` the last error, which is added to it first (error feedback; two ranks fold the add
    into the quantisation).  ``fused`` (two ranks, with ``carry``): the preconditioner's divide and multiply-back
    (``codec_native.Fused``) done in the quantisation's and the decoding's passes; ``x`` and ``err`` end in the
    gradient's units.  The constructor posts round 0 at once.
    """

    def __init__(
        self,
        x: torch.Tensor,
        err: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        bits: int,
        block: int,
        timeout: timedelta | None = None,
        clip: float = 0.0,
        levels: str = "fitted",
        carry: bool = False,
        fused: codec_native.Fused | None = None,
    ) -> None:
        self.x, self.err, self.group, self.clip, self.levels = x, err, group, clip, levels
        self.fused = fused
        self.bits, self.block, self.timeout = bits, block, timeout
        # the group's own numbering (a group c10d does not register, torchft's quorum group, has no global ranks)
        self.world, self.rank = group.size(), group.rank()
        self.others = [q for q in range(self.world) if q != self.rank]  # the peers, in rank order
        n = x.numel()
        nb = -(-n // block)
        # Two ranks: one exchange of whole quantised contributions (see the module docstring).
        self.exchange = self.world == 2
        if fused is not None and not (self.exchange and carry):
            raise ValueError(
                "QuantizedRing(fused=...) folds the preconditioner into a two-rank exchange with carry=True"
            )
        parts = 1 if self.exchange else self.world
        self.segments = [(min(a * block, n), min(b * block, n)) for a, b in _split(nb, parts)]
        self.seg_bytes = [wire_bytes(b - a, bits, block) if b > a else 0 for a, b in self.segments]
        self.total = 1 if self.exchange else 2
        self.t = 0
        self.payload_bytes = wire_bytes(n, bits, block) if n else 0  # one quantised copy of x
        self._works: list[dist.Work] = []
        self._arrived: _Arrival | None = None
        self.done = self.world == 1 or n == 0
        if carry and not self.exchange:
            x.add_(err)  # the contribution; two ranks fold this add into the one quantisation of x
        if self.done:
            err.zero_()
            return
        # Per-segment slices of one send buffer (every segment, own included: round 1 sends the own
        # one) and one receive buffer per round: round 0 receives N-1 contributions to the own segment,
        # round 1 every other owner's sum (at that segment's offset).
        offs = [0]
        for nbytes in self.seg_bytes:
            offs.append(offs[-1] + nbytes)
        self._off = offs
        self._sbuf = torch.empty(offs[-1], dtype=torch.uint8, device=x.device)
        # Gloo's point-to-point sends and receives host memory only ("writev: Bad address" on a CUDA
        # tensor): there the bytes are staged through the host (NCCL sends device memory as it is).
        self._staged = x.device.type != "cpu" and "nccl" not in group.name().lower()
        wire_device = torch.device("cpu") if self._staged else x.device
        self._sent: list[torch.Tensor] = []  # host copies in flight (staged): alive until the round completes
        if self.exchange:
            self._rbuf = torch.empty(offs[-1], dtype=torch.uint8, device=wire_device)
            # our share: its codes and error; its decoded values only where the torch ops write them anyway (the
            # kernel decodes our codes again beside the peer's, one write and read of x fewer)
            self._own_in_x = encode_share(
                x, err, self._send(0), bits, block, clip=clip, levels=levels, carry=carry, fused=fused
            )
            self._post([(1 - self.rank, self._send(0), self._rbuf)])
            return
        own = self.seg_bytes[self.rank]
        self._rbuf = torch.empty(max(offs[-1], (self.world - 1) * own), dtype=torch.uint8, device=wire_device)
        pairs = []
        for q in self.others:
            self._quantize_into(q, inplace=True)  # err[q] = our contribution's error; x[q] is rewritten in round 1
            pairs.append((q, self._send(q), self._rbuf[self._slot(q) * own : (self._slot(q) + 1) * own]))
        self._post(pairs)

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends: its whole contribution (two ranks), else every other owner's segment and
        its own sum to every other rank."""
        if self.done and self.world == 1:
            return 0
        if self.exchange:
            return self.seg_bytes[0]
        own = self.seg_bytes[self.rank]
        return sum(self.seg_bytes) - own + own * (self.world - 1)

    # ---- geometry --------------------------------------------------------------------------
    def _slot(self, q: int) -> int:
        """Where rank q's contribution to our segment lands in the round-0 receive buffer."""
        return q if q < self.rank else q - 1

    def _send(self, s: int) -> torch.Tensor:
        return self._sbuf[self._off[s] : self._off[s + 1]]

    # ---- work ----------------------------------------------------------------------------
    def _quantize_into(self, s: int, inplace: bool = False) -> None:
        """Quantise segment ``s`` of x into its send slice and its error into err (from 3 ranks: x already holds
        the contribution with the last error); ``inplace``: x's segment becomes the decoded values (what every
        receiver of these bytes decodes)."""
        a, b = self.segments[s]
        if a < b:
            quantize(
                self.x[a:b],
                self._send(s),
                self.bits,
                self.block,
                err=self.err[a:b],
                clip=self.clip,
                levels=self.levels,
                inplace=inplace,
            )

    def _decode(self, wire: torch.Tensor, s: int, add: bool = False) -> None:
        """Decode segment ``s``'s bytes into x's segment (added to it if ``add``: x + decoded)."""
        a, b = self.segments[s]
        wire = wire.to(self.x.device)  # staged: the received host bytes to the device (else: itself)
        dequantize(wire, b - a, self.bits, self.block, self.levels, out=self.x[a:b], add=add)

    def _post(self, pairs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Post (peer, send bytes, receive bytes) for every peer of this round; empty ones are skipped on
        both sides alike (segment sizes are the same on every rank)."""
        ops: list[tuple[bool, torch.Tensor, int]] = []
        self._sent = []
        for q, send, recv in pairs:
            if recv.numel():
                ops.append((False, recv, q))
            if send.numel():
                if self._staged:
                    send = send.cpu()
                    self._sent.append(send)
                ops.append((True, send, q))
        self._works = post_p2p(self.group, ops) if ops else []
        self._arrived = waiter_for(self.group).watch(self._works, self.timeout)

    def _advance(self) -> None:
        """Round t's messages have arrived: fold them in, post round t+1."""
        r = self.rank
        if self.exchange:  # decoded own + decoded peer: a + b == b + a, so both ranks hold the same bits
            peer = self._rbuf.to(self.x.device)  # staged: the received host bytes to the device (else: itself)
            sum_shares(
                self.x,
                self.err,
                self._send(0),
                peer,
                self.bits,
                self.block,
                levels=self.levels,
                own_in_x=self._own_in_x,
                fused=self.fused,
            )
        elif self.t == 0:  # the owner: add the N-1 decoded contributions (rank order), quantise the sum once
            a, b = self.segments[r]
            own = self.seg_bytes[r]
            if a < b:
                for q in self.others:
                    self._decode(self._rbuf[self._slot(q) * own : (self._slot(q) + 1) * own], r, add=True)
                self._quantize_into(r, inplace=True)  # exactly what every other rank will decode
            self.t = 1
            self._post([(q, self._send(r), self._rbuf[self._off[q] : self._off[q + 1]]) for q in self.others])
            return
        else:  # allgather: decode every owner's bytes
            for q in self.others:
                a, b = self.segments[q]
                if a < b:
                    self._decode(self._rbuf[self._off[q] : self._off[q + 1]], q)
        self.t = self.total
        self.done = True
        self._works = []

    def poll(self) -> bool:
        """Do every round whose messages have arrived; never block.  True once the sum is in ``x``."""
        while not self.done and self._watch().event.is_set():
            self._watch().check()
            self._advance()
        return self.done

    def wait(self) -> torch.Tensor:
        """Block until the sum is in ``x`` (each round bounded by ``timeout``)."""
        while not self.done:
            self._watch().event.wait()
            self._watch().check()
            self._advance()
        return self.x

    def _watch(self) -> _Arrival:
        """The waiter's handle on the messages in flight (posted by every round until ``done``)."""
        assert self._arrived is not None, "a round is always posted before it is waited on"
        return self._arrived
