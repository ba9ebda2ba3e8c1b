"""A quantised ring allreduce with error feedback, advanced without blocking (:class:`QuantizedRing`).

Every rank holds ``x`` (fp32, its contribution: gradient plus last step's error) and ends with
the same ``x`` = the decoded sum.  Group rank ``r`` sends only to ``r+1`` and receives only from
``r-1`` (mod N), with point-to-point ops (``batch_isend_irecv``: Gloo and NCCL):

1. Cut ``x`` into N segments of whole blocks (:mod:`gradientflow.comm.quantize`).
2. Reduce-scatter, steps t = 0..N-2: at t = 0 quantise our own segment ``r``; at every step send
   the quantised segment ``r-t``, receive segment ``r-t-1``, decode it and add our contribution
   (dequantise-add), then requantise the partial sum for the next step.  After N-1 steps rank r
   holds the whole (decoded + own) sum of segment ``r+1`` and quantises it one last time.
3. Allgather, steps t = N-1..2N-3: the owner's quantised bytes go round the ring unchanged;
   every rank (the owner too) decodes those same bytes, so all ranks end with identical sums.

Two ranks: the ring's two steps (rank r sends its quantised half, the owner requantises the
decoded-plus-own sum and sends it back) become one exchange of each rank's whole quantised
contribution, the same bytes (one quantised copy each way), and each rank adds the two decoded
contributions.  The sum is then never requantised: its quantisation noise is that of the two
contributions alone, where the ring's adds the sum's own (twice the magnitude when the ranks'
gradients agree): measured on the quality bench's AdamW transformer, see docs/adamw.md.

Error feedback: each rank quantises every element exactly once per allreduce (its own segment at
t = 0, the N-2 partial sums it forwards, the one it owns), and ``err`` receives
``value before quantisation - decoded value`` there.  Summed over ranks the errors telescope:
``sum_r err_r + result == sum_r x_r`` elementwise up to fp32 rounding of the adds: nothing
is lost, it is only delayed to the next step.

Bytes per rank: ``2 (N-1)/N`` of one quantised copy of ``x``, as a dense ring, so they do not
grow with the world size.  One message per segment and step; a segment is small (3 bits per
element), so it is not pipelined further.

Non-blocking: :meth:`QuantizedRing.poll` does the work of every step whose messages have arrived
and posts the next, never waiting; :meth:`QuantizedRing.wait` drives it to the end.  Gloo's
point-to-point works never report completion before ``wait()`` (``is_completed()`` stays False,
torch 2.13), so one daemon thread (:class:`_Waiter`) only *waits* on each step's works, GIL
released, and flags them done; it never issues a collective.  The engine
polls at every gradient hook, so the ring of a bucket runs while backward goes on, on the
training thread (collectives are only ever issued from it, in the same order on every rank).
Several rings in flight over the same group are matched by posting order: rank r posts its
sends to r+1 and r+1 its receives from r in the same (ring, step) order.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from .quantize import dequantize, quantize, wire_bytes
from .ring import _split


class QuantizedRing:
    """One in-place quantised SUM allreduce of ``x`` over ``group``, error into ``err``.

    ``x`` and ``err``: fp32, contiguous, 1-D, the same numel on every rank.  ``bits`` / ``block``:
    the block quantiser's (``block`` a multiple of 16).  ``start`` posts step 0 at once.
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
        uniform: bool = False,
    ) -> None:
        self.x, self.err, self.group, self.clip, self.uniform = x, err, group, clip, uniform
        self.bits, self.block, self.timeout = bits, block, timeout
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        n = x.numel()
        nb = -(-n // block)
        # Two ranks: one exchange of whole quantised contributions (see the module docstring).
        self.exchange = self.world == 2
        parts = 1 if self.exchange else self.world
        self.segments = [(min(a * block, n), min(b * block, n)) for a, b in _split(nb, parts)]
        self.seg_bytes = [wire_bytes(b - a, bits, block) if b > a else 0 for a, b in self.segments]
        self.total = 1 if self.exchange else 2 * (self.world - 1)
        self.t = 0
        self.payload_bytes = wire_bytes(n, bits, block) if n else 0  # one quantised copy of x
        self._works: list[dist.Work] = []
        self._arrived: _Arrival | None = None
        self.done = self.world == 1 or n == 0
        if self.done:
            err.zero_()
            return
        top = max(self.seg_bytes)
        self._bufs = [torch.empty(top, dtype=torch.uint8, device=x.device) for _ in range(3)]
        self._send = self._bufs[2]
        decoded = self._quantize_into(self._send_seg(0), self._send)
        if self.exchange:
            x.copy_(decoded)  # our own share of the sum, as the peer will decode it
        self._post()

    # ---- ring geometry -------------------------------------------------------------------
    def _send_seg(self, t: int) -> int:
        if self.exchange:
            return 0
        N, r = self.world, self.rank
        return (r - t) % N if t <= N - 2 else (r + 1 - (t - N + 1)) % N

    def _recv_seg(self, t: int) -> int:
        return self._send_seg(t + 1)  # what arrives at step t is forwarded at step t+1

    def _peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    # ---- work ----------------------------------------------------------------------------
    def _quantize_into(self, s: int, buf: torch.Tensor) -> torch.Tensor:
        """Quantise segment ``s`` of x into ``buf``; its error into err; return the decoded values."""
        a, b = self.segments[s]
        if a == b:
            return self.x[a:b]
        return quantize(
            self.x[a:b],
            buf[: self.seg_bytes[s]],
            self.bits,
            self.block,
            err=self.err[a:b],
            clip=self.clip,
            uniform=self.uniform,
        )

    def _post(self) -> None:
        t, N = self.t, self.world
        ops = []
        rs, ss = self._recv_seg(t), self._send_seg(t)
        self._recv = self._bufs[t % 2]
        if self.seg_bytes[rs]:
            ops.append(
                dist.P2POp(dist.irecv, self._recv[: self.seg_bytes[rs]], self._peer((self.rank - 1) % N), self.group)
            )
        if self.seg_bytes[ss]:
            ops.append(
                dist.P2POp(dist.isend, self._send[: self.seg_bytes[ss]], self._peer((self.rank + 1) % N), self.group)
            )
        self._works = dist.batch_isend_irecv(ops) if ops else []
        self._arrived = _WAITER.watch(self._works, self.timeout)

    def _advance(self) -> None:
        """Step t's messages have arrived: fold them in, post step t+1.

        Buffers: receives alternate between ``bufs[0]`` and ``bufs[1]``; the reduce-scatter sends
        (and the owner's final segment) are quantised into ``bufs[2]``, free once step t is
        complete; an allgather step forwards the buffer it received into.
        """
        t, N = self.t, self.world
        s = self._recv_seg(t)
        a, b = self.segments[s]
        recv = self._recv[: self.seg_bytes[s]]
        if self.exchange:  # decoded own + decoded peer: a + b == b + a, so both ranks hold the same bits
            self.x.add_(dequantize(recv, b - a, self.bits, self.block, self.uniform))
        elif t <= N - 2:  # reduce-scatter: dequantise-add, requantise
            if a < b:
                self.x[a:b].add_(dequantize(recv, b - a, self.bits, self.block, self.uniform))
            decoded = self._quantize_into(s, self._bufs[2])
            if t == N - 2:  # the owner: x gets exactly what every other rank will decode
                self.x[a:b].copy_(decoded)
            self._send = self._bufs[2]
        else:  # allgather: decode the owner's bytes, forward them unchanged
            if a < b:
                self.x[a:b].copy_(dequantize(recv, b - a, self.bits, self.block, self.uniform))
            self._send = self._recv
        self.t += 1
        if self.t == self.total:
            self.done = True
            self._works = []
            return
        self._post()

    def poll(self) -> bool:
        """Do every step whose messages have arrived; never block.  True once the sum is in ``x``."""
        while not self.done and self._watch().event.is_set():
            self._watch().check()
            self._advance()
        return self.done

    def wait(self) -> torch.Tensor:
        """Block until the sum is in ``x`` (each step bounded by ``timeout``)."""
        while not self.done:
            self._watch().event.wait()
            self._watch().check()
            self._advance()
        return self.x

    def _watch(self) -> _Arrival:
        """The waiter's handle on the messages in flight (posted by every step until ``done``)."""
        assert self._arrived is not None, "a ring step is always posted before it is waited on"
        return self._arrived


class _Arrival:
    """One step's works: ``event`` is set once they completed (or failed: ``error``)."""

    def __init__(self, works: list[dist.Work], timeout: timedelta | None) -> None:
        self.works, self.timeout = works, timeout
        self.event = threading.Event()
        self.error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"gradientflow: quantised ring step failed: {self.error}. A peer may have died or ranks issued "
                "different collectives."
            ) from self.error


class _Waiter:
    """A daemon thread that waits on posted works, in posting order, and sets their event."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Arrival] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, works: list[dist.Work], timeout: timedelta | None) -> _Arrival:
        arrival = _Arrival(works, timeout)
        if not works:
            arrival.event.set()
            return arrival
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gradientflow-ring-waiter", daemon=True)
                self._thread.start()
        self._queue.put(arrival)
        return arrival

    def _run(self) -> None:
        while True:
            arrival = self._queue.get()
            try:
                for w in arrival.works:
                    w.wait() if arrival.timeout is None else w.wait(arrival.timeout)
            except BaseException as exc:  # noqa: BLE001 — handed to the training thread by check()
                arrival.error = exc
            arrival.works = []
            arrival.event.set()


_WAITER = _Waiter()
