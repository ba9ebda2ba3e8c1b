"""CSC's slices: groups of chunks whose scores are exchanged, and whose top chunks are sent, together.

A slice is opened when its chunks are scored: the SUM-allreduce of their scores starts on the
*control* group (a process group of its own, so a few KB never queue behind megabytes of
chunks).  It is sent — select its top chunks, pack them, start their allreduce — once its global
scores have arrived.  Slices are sent strictly in the order they were opened, so on each group
every rank issues the same collectives in the same order even when ranks send a slice at
different moments (one rank a layer behind the other).

:class:`SliceQueue` keeps that order; what a send does (select and pack) is the strategy's
(:class:`gradientflow.strategies.csc.SparseSync`), handed in as a callable.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.collectives import PendingAllreduce, start_allreduce
from ..diagnostics.stats import StepStats
from ..diagnostics.watchdog import Watchdog
from . import csc_native


@dataclass
class Slice:
    """Chunks [lo, hi) of pool ``pool`` whose scores are exchanged and selected together."""

    pool: int
    lo: int
    hi: int
    handle: PendingAllreduce
    idx: torch.Tensor | None = None  # selected chunks, pool-local indices, ascending
    packed: torch.Tensor | None = None  # their rows of v, [len(idx), C]; the reduced rows after finish
    wire: torch.Tensor | None = None  # instead of packed (CPU, fp16 wire): the rows packed straight onto it
    err: torch.Tensor | None = None  # "cscq": the rows' quantisation error, v's rows after the step
    written: bool = False  # "cscq" from v's rows straight: their error is in v, the average goes into the pool

    @property
    def selected(self) -> torch.Tensor:
        """``idx``, once the slice's chunks were selected (every slice past its send has them)."""
        assert self.idx is not None, "a slice's chunks are selected when it is sent"
        return self.idx


Send = Callable[[Slice, StepStats], None]
"""What sending a slice does: select its top chunks, pack them, start their allreduce."""


class SliceQueue:
    """The slices of one step, in the order they were opened; the first ``sent`` are on the wire."""

    def __init__(self, control_group: dist.ProcessGroup) -> None:
        self._control = weakref.ref(control_group)  # torch's registry owns it (see the engine)
        self.slices: list[Slice] = []
        self.sent = 0

    def open(
        self, pool: int, lo: int, hi: int, scores: torch.Tensor, stats: StepStats, watchdog: Watchdog | None
    ) -> None:
        """Start the (async, fp32 SUM) allreduce of ``scores``, the local scores of chunks [lo, hi).

        "native" whatever the algorithm: a few KB are latency-bound, a ring would pay 2(N-1) hops.
        """
        stats.record_collective(scores.numel() * scores.element_size())
        handle = start_allreduce(
            scores,
            group=self._control(),
            algorithm="native",
            watchdog=watchdog,
            what=f"scores of pool {pool} chunks {lo}-{hi}",
        )
        self.slices.append(Slice(pool, lo, hi, handle))

    def send_arrived(self, send: Send, stats: StepStats) -> None:
        """``send`` every unsent slice whose global scores have arrived, in order; never wait."""
        while self.sent < len(self.slices) and self.slices[self.sent].handle.poll():
            send(self.slices[self.sent], stats)
            self.sent += 1

    def drain(self, send: Send, stats: StepStats) -> tuple[list[Slice], int]:
        """``send`` the rest (waiting for their scores); return every slice and how many went early."""
        slices, early = self.slices, self.sent
        for sl in slices[early:]:
            send(sl, stats)
        self.slices, self.sent = [], 0
        return slices, early


def pack(
    sl: Slice, rows: torch.Tensor, take: Callable[[int, torch.dtype], torch.Tensor], world_size: int, fast: bool
) -> None:
    """Gather ``sl``'s selected rows of v (``rows``), whole, the pad of a short last chunk included
    (zeros), so no host read of the indices.  ``fast`` (fp32 CPU rows onto an fp16 wire): gathered,
    divided by ``world_size`` and cast in one pass straight into ``sl.wire``
    (:func:`~.csc_native.pack_rows`); otherwise copied into ``sl.packed`` for
    :meth:`~.dense.DenseSync.launch` to divide and cast.  The length is ``idx``'s own (metadata, no
    host read): a selection rule may send other than the slice's quota.  ``take(numel, dtype)``: the step's
    buffer for it (:meth:`~.dense.DenseSync.wire_buffer`: two-level pads it to whole shards, so it travels
    without a copy)."""
    idx = sl.selected
    n = idx.numel()
    if fast:
        sl.wire = take(n * rows.shape[1], torch.float16)
        csc_native.pack_rows(rows, idx, 1.0 / world_size, sl.wire)
        return
    sl.packed = take(n * rows.shape[1], rows.dtype).view(n, -1)
    torch.index_select(rows, 0, idx, out=sl.packed)
