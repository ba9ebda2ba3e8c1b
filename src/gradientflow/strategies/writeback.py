"""CSC's end of a step: the pool gets the reduced chunks and zeros elsewhere; sent chunks leave u and v.

Kept apart from :mod:`.csc` because it is the one part of CSC that writes where the optimizer reads
(the pool): what it may leave there, and when a whole-pool memset can be skipped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..diagnostics.stats import StepStats
from ..diagnostics.trace import phase_end, phase_start
from ..diagnostics.watchdog import Watchdog
from ..engine.pool import GradPool, Layout
from ..exchange.error_feedback import Residuals
from . import csc_native
from .slices import Slice


class PoolWriter:
    """Writes a CSC step's result into the pool and remembers what it wrote (to clear it cheaply)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, torch.Tensor]] = []  # (pool, chunk indices) of the last step
        self.clean_versions: list[int] | None = None  # the pool's versions right after the last write

    def forget(self) -> None:
        """The pool now holds something else (a dense result): the next clear is a full memset."""
        self.clean_versions = None

    def write_back(
        self,
        pool: GradPool,
        rows: list[torch.Tensor],
        res: Residuals,
        slices: list[Slice],
        ok: bool,
        stats: StepStats,
        watchdog: Watchdog | None,
    ) -> bool:
        """After :meth:`clear` (1. zero the pool: it may hold this step's local gradient or the last
        step's result, neither of which may reach the optimizer; done before the last slices arrive):
        2. the reduced chunks into their rows; 3. the sent chunks leave the residual (momentum factor
        masking; ``"cscq"``: their quantisation error stays in v).  ``ok=False`` (a non-finite sum, the same
        verdict on every rank), or a reduced chunk unpacked from an fp16 wire that overflowed (the same bytes on
        every rank): NaN everywhere, so GradScaler.step skips on every rank.  Returns whether the step was finite."""
        t0 = time.perf_counter()
        t_trace = phase_start(watchdog)
        if ok:
            for sl in slices:
                r, idx = rows[sl.pool], sl.selected
                if sl.written:  # "cscq": decoded into the pool's rows already
                    continue
                if sl.wire is not None:
                    ok &= csc_native.unpack_rows(r, idx, sl.wire)
                else:
                    assert sl.packed is not None  # pack() fills wire or packed
                    r.index_copy_(0, idx, sl.packed.to(r.dtype))
            t0 = stats.phase("unpack", t0)
        if not ok:
            for buf in pool.buffers:
                buf.fill_(float("nan"))
            res.clean()
            self.sent = []
            stats.phase("zero", t0)
            phase_end(watchdog, "csc.write-back", t_trace)
            return False
        for sl in slices:
            if sl.err is not None:  # "cscq": the quantisation error stays in v (delayed, not lost)
                res.rows(sl.pool).index_copy_(0, sl.selected, sl.err)
            elif not sl.written:  # (written: the encoder wrote the error over v's rows)
                zero_rows(res.rows(sl.pool), sl.selected)
            if res.u is not None:
                zero_rows(res.rows(sl.pool, "u"), sl.selected)
        self.sent = [(sl.pool, sl.selected) for sl in slices]
        self.clean_versions = [b._version for b in pool.padded]
        stats.phase("zero", t0)
        phase_end(watchdog, "csc.write-back", t_trace)
        return True

    def selected(self, offsets: list[int]) -> torch.Tensor:
        """Global indices (ascending per slice) of the chunks the last write-back sent (``offsets``: each
        buffer's first chunk's global index)."""
        if not self.sent:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([idx + offsets[k] for k, idx in self.sent])

    def clear(self, pool: GradPool, rows: list[torch.Tensor]) -> None:
        """Zero the pool: only last step's chunks if nothing else has written to it since.

        Direct pools never see this step's gradient (it went into v), so after a write-back the
        pool holds the sent chunks and zeros.  The buffers' version counters (bumped by any
        in-place write: a pool-path accumulation, ``GradScaler.unscale_``, a clipping, an
        optimizer that edits ``.grad``) tell whether that is still so; if not, one memset.
        """
        versions = self.clean_versions
        self.clean_versions = None
        if versions is not None and versions == [b._version for b in pool.padded]:
            for k, idx in self.sent:
                zero_rows(rows[k], idx)
            return
        for buf in pool.padded:
            buf.zero_()


def zero_rows(rows: torch.Tensor, idx: torch.Tensor) -> None:
    """``rows[idx] = 0``: a memset per row for CPU fp32 rows (:func:`~.csc_native.zero_rows`), else ``index_fill_``."""
    if csc_native.rows_fit(rows) and csc_native.available():
        csc_native.zero_rows(rows, idx)
    else:
        rows.index_fill_(0, idx, 0.0)


def untouched_params(
    params: Sequence[int], sent: set[int], layout: Layout, offsets: list[int], chunk: int
) -> list[int]:
    """Those of ``params`` none of whose chunks (global indices, ``offsets``: each buffer's first) is in ``sent``."""
    out = []
    for i in params:
        s = layout.slots[i]
        base = offsets[s.pool]
        chunks = range(base + s.offset // chunk, base + (s.offset + s.numel - 1) // chunk + 1) if s.numel else ()
        if not any(c in sent for c in chunks):
            out.append(i)
    return out
