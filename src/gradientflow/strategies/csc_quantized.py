"""CSC's selected chunks on the quantised exchange (``compression="topk-3bit"``): sparse *and* few bits.

CSC sends the top ``density`` of the chunks at 16 bits; the quantised recipe sends every coordinate at a few
bits.  Here the selected chunks of a slice (the rows of the residual ``v``, undivided, fp32) go through the
:class:`~gradientflow.comm.quantized_ring.QuantizedRing` instead of a 16-bit allreduce: 3-bit blocks, about a
fifth of fp16's bytes, so a density of 0.3 costs fewer bytes than fp16's 0.1 and delays fewer coordinates
(SGD momentum's quality under CSC is a matter of how much it delays: docs/results/quality.md).

Error feedback goes where CSC already keeps what it did not send: the quantisation error of a sent row
becomes that row of ``v`` (instead of 0), so nothing is lost, only delayed.  Summed over ranks, per sent row:
``sum_r v_r(after) + N * pool == sum_r v_r(before)`` up to fp32 rounding (the ring's own conservation,
:mod:`gradientflow.comm.quantized_ring`, divided by the world size ``N`` into the pool).

The rings run over the data group in the order the slices are sent (the same on every rank), started as their
slice is packed, advanced at every gradient hook (:meth:`QuantizedChunks.progress`), so the chunks travel
while backward goes on, as CSC's 16-bit allreduce does.  On nodes of several ranks the packed rows go
two-level as the quantised recipe's buckets do (:class:`~.quantized_nodes.NodeQuantizer`: an fp32
reduce-scatter inside the node, the ring between nodes on this rank's shard, an all-gather inside the node);
the error is then the node sum's, on this rank's shard of the rows (the rest of its sent rows leave v at 0):
the conservation above holds over all ranks as before.

Two ranks on CPU (the codec's kernel, fp32 rows of whole quantiser blocks), the common case, skip the packed
copies: the selected rows are encoded straight from v, each row's error written over it
(``codec_native.quantize_rows``), the bytes swapped (:class:`~gradientflow.comm.quantized_ring.PairExchange`),
and after backward (once the pool is cleared) both messages decoded and averaged straight into the pool's rows
(``dequantize_rows``, times 1/2: the same floats as decoding the packed rows and dividing by 2).  A step found
non-finite gives those rows their sent value back (:meth:`QuantizedChunks.settle`), as CSC keeps what it did
not deliver.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..comm import codec_native
from ..comm.levels import kernel_levels, kernel_table
from ..comm.quantize import code_bytes, wire_bytes
from ..comm.topology import two_level_plan
from ..comm.two_level import NodeGroups
from ..config import GradientFlowConfig
from ..diagnostics.stats import StepStats
from ..diagnostics.watchdog import Watchdog
from ..exchange import error_feedback
from ..exchange.quantized import QuantizedExchange
from ..exchange.ring import Pair, Ring, guarded, start_pair
from ..options_base import Quantizer
from .dense import DenseSync
from .quantized_nodes import TWO_LEVEL, NodeQuantizer, start_two_level
from .slices import Slice, pack

RINGS = "CSC chunks (quantised exchange)"
"""What a failure of ``"topk-3bit"``'s flat exchanges names."""


class _Straight(NamedTuple):
    """One slice sent straight from v's rows: its exchange, our bytes and the peer's, v's rows and the pool's."""

    sl: Slice
    exchange: Pair
    send: torch.Tensor
    recv: torch.Tensor
    rows: torch.Tensor
    pool_rows: torch.Tensor


@dataclass
class _Packed:
    """One slice's packed rows on the quantised ring: the ring once started (from 3 ranks one at a time)."""

    sl: Slice
    ring: Ring | None = None


class QuantizedChunks:
    """The quantised exchanges of one step's packed slices (``bits``/``block``/``levels``: the quantiser's)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        world_size: int,
        *,
        bits: int,
        block: int,
        levels: str,
        watchdog: Watchdog | None,
        groups: NodeGroups | None = None,
    ) -> None:
        self.group, self.world_size, self.watchdog = group, world_size, watchdog
        self.bits, self.block, self.levels = bits, block, levels
        # the quantised exchange of the packed rows (no warm-up, no carry: each row's error goes to its row of v)
        self.exchange = QuantizedExchange(Quantizer(bits, block, levels, False, 0, 0.0), group, watchdog)
        self._running: list[_Packed] = []  # in slice order
        self._pairs: list[_Straight] = []  # sent straight from v's rows, not yet decoded
        self._delivered: list[_Straight] = []  # decoded into the pool this step (settle() may undo their error)
        self.groups = groups
        self._nodes = NodeQuantizer(groups, block, watchdog) if groups is not None else None  # two-level

    @classmethod
    def for_config(cls, config: GradientFlowConfig, dense: DenseSync) -> QuantizedChunks | None:
        """``"topk-3bit"``'s exchange over the data group (the quantiser of ``config``), else ``None``."""
        if config.mechanism != "topk-quantized":
            return None
        q = config.quantizer()
        return cls(
            dense.group,
            dense.world_size,
            bits=q.bits,
            block=q.block,
            levels=q.levels,
            watchdog=dense.watchdog,
            groups=dense.groups,
        )

    def start(
        self,
        sl: Slice,
        rows: torch.Tensor,
        pool_rows: torch.Tensor,
        take: Callable[[int, torch.dtype], torch.Tensor],
        stats: StepStats,
    ) -> None:
        """Start the exchange of ``sl``'s selected rows of v (``rows``, undivided fp32): straight from them where it
        can (two ranks, the CPU kernel: :meth:`_start_rows`), else packed into ``sl.packed`` with their error going
        into ``sl.err``, buffers of their shape from ``take`` (the step's scratch): its rows become v's."""
        if self._straight(rows, pool_rows):
            self._start_rows(sl, rows, pool_rows, take, stats)
            return
        pack(sl, rows, take, self.world_size, False)
        assert sl.packed is not None and sl.packed.dtype == torch.float32, "cscq packs fp32 rows"
        err = sl.err = take(sl.packed.numel(), torch.float32).view_as(sl.packed)
        if self._nodes is not None:
            self._start_two_level(sl, err.view(-1), stats)
            return
        self._running.append(_Packed(sl))
        # started now if it may be (and earlier rings moved on): after backward, slices are packed one after another
        # with nothing else advancing the rings in between
        self.progress(stats)

    def _ring(self, entry: _Packed, stats: StepStats) -> Ring:
        """``entry``'s ring, started (its first round posted, its bytes counted) if it was not yet."""
        if entry.ring is None:
            sl = entry.sl
            assert sl.packed is not None and sl.err is not None
            entry.ring = self.exchange.start(sl.packed.view(-1), sl.err.view(-1), RINGS, carry=False)
            stats.record_collective(entry.ring.payload_bytes)
        return entry.ring

    def _straight(self, rows: torch.Tensor, pool_rows: torch.Tensor) -> bool:
        """Whether v's rows are encoded and the pool's decoded straight (no packed copies): two ranks, flat, fp32
        rows of whole blocks, the codec's CPU kernel for this quantiser."""
        if self.world_size != 2 or self._nodes is not None or rows.shape[1] % self.block or self.block > 1024:
            return False
        if rows.dtype != torch.float32 or pool_rows.dtype != torch.float32:
            return False
        return kernel_levels(self.bits, self.levels) and codec_native.applies(rows, pool_rows)

    def _start_rows(
        self,
        sl: Slice,
        rows: torch.Tensor,
        pool_rows: torch.Tensor,
        take: Callable[[int, torch.dtype], torch.Tensor],
        stats: StepStats,
    ) -> None:
        n = sl.selected.numel() * rows.shape[1]
        nbytes = wire_bytes(n, self.bits, self.block)
        send, recv = take(nbytes, torch.uint8), take(nbytes, torch.uint8)
        cb = code_bytes(n, self.bits, self.block)
        tab = kernel_table(self.bits, self.levels)
        codec_native.quantize_rows(
            rows, sl.selected, send[:cb], send[cb:], self.bits, self.block, tab.mids, tab.poly, tab.first
        )
        sl.written = True  # v's rows hold their error now; the pool's rows get the average at finish()
        pair = start_pair(send, recv, self.group, self.watchdog, RINGS)
        self._pairs.append(_Straight(sl, pair, send, recv, rows, pool_rows))
        stats.record_collective(nbytes)

    def _decode_rows(self, send: torch.Tensor, recv: torch.Tensor | None, sl: Slice, out: torch.Tensor) -> None:
        """``out``'s selected rows = (ours + the peer's) / 2, or += ours (``recv`` None)."""
        cb = code_bytes(sl.selected.numel() * out.shape[1], self.bits, self.block)
        tab = kernel_table(self.bits, self.levels)
        peer = None if recv is None else (recv[:cb], recv[cb:])
        mult = 1.0 if recv is None else 1.0 / self.world_size
        codec_native.dequantize_rows(
            (send[:cb], send[cb:]), peer, sl.selected, out, self.bits, self.block, tab.poly, tab.first, mult
        )

    def settle(self, finite: bool) -> None:
        """The step's verdict, once per step after :meth:`finish`: a non-finite step (skipped on every rank) gives
        the rows whose error was written over v their decoded value back (v = error + decoded, the value sent up to
        one rounding).  Then the step's rows are let go: they are views of this step's v and pool, which a re-layout
        after the step (the first step's, in backward order) replaces; held on, they would keep both old buffers
        alive for a step (2 model sizes of memory)."""
        if not finite:
            for p in self._delivered:
                self._decode_rows(p.send, None, p.sl, p.rows)
        self._delivered = []

    def _start_two_level(self, sl: Slice, err: torch.Tensor, stats: StepStats) -> None:
        """The packed rows into the two-level pipeline; their error (this rank's shard of the node sum's) into
        ``err`` at the shard's place, 0 elsewhere, once the rows' average is back."""
        assert self._nodes is not None and self.groups is not None and sl.packed is not None
        x = sl.packed.view(-1)
        n, topo = x.numel(), self.groups.topology
        plan = two_level_plan(n, topo.nodes, topo.per_node, self.block)
        a, b = plan.bounds[self.groups.local]
        m = max(0, min(b, n) - a)  # the shard's real elements (the rest pads the rows to whole shards)
        shard_err = error_feedback.zeros(plan.shard, x.device)  # nothing carried: v holds it

        def delivered(result: torch.Tensor) -> None:
            if result.data_ptr() != x.data_ptr():
                x.copy_(result)
            x.div_(self.world_size)
            err.zero_()
            err[a : a + m].copy_(shard_err[:m])

        args = {"bits": self.bits, "block": self.block, "clip": 0.0, "levels": self.levels}
        start_two_level(self._nodes, x, shard_err, None, args, stats, "CSC chunks (quantised shard)", delivered)
        self.progress(stats)

    def progress(self, stats: StepStats) -> None:
        """Advance every running exchange as far as its messages allow; never wait."""
        if self._nodes is not None:
            guarded(self.watchdog, f"CSC chunks ({TWO_LEVEL})", self._nodes.progress)
        # Two ranks: one round per ring, all in flight at once (posted in slice order on every rank).  From 3 ranks
        # a ring's second round is posted when its first has arrived, which is sooner on one rank than on another:
        # one ring at a time, in slice order, keeps every rank's posting order the same (else a peer's message
        # lands in another ring's receive), as the quantised recipe's buckets do.
        for entry in self._running:
            ring = self._ring(entry, stats)
            ring.poll()
            if not ring.one_round and not ring.done:
                break
        for p in self._pairs:
            p.exchange.poll()

    def finish(self, stats: StepStats) -> None:
        """Run every exchange to its end; each slice's ``packed`` then holds the average of the ranks' rows."""
        t0 = time.perf_counter()
        if self._nodes is not None:
            guarded(self.watchdog, f"CSC chunks ({TWO_LEVEL})", self._nodes.drain)
        pairs, self._pairs = self._pairs, []
        for p in pairs:  # the pool was cleared: its rows get the average
            p.exchange.wait()
            stats.record_done(time.perf_counter())
            t0 = stats.phase("wire_wait", t0)
            self._decode_rows(p.send, p.recv, p.sl, p.pool_rows)
            t0 = stats.phase("unpack", t0)  # the decode is CPU work, not a wait
        self._delivered = pairs
        running, self._running = self._running, []
        for entry in running:
            sl, ring = entry.sl, self._ring(entry, stats)
            ring.wait()
            stats.record_done(time.perf_counter())
            assert sl.packed is not None
            sl.packed.div_(self.world_size)
        stats.phase("wire_wait", t0)
