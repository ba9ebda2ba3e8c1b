"""Coarse-grained sparse communication (CSC): send only the top chunks of the accumulated gradient.

The gradient pool is cut into chunks of ``C = chunk_size`` elements (each pool buffer is padded
to whole chunks; chunks get one global index across buffers).  Per synchronised step:

  1. Accumulate.  Without momentum correction the gradient goes straight into the residual v
     (:meth:`SparseSync.begin_backward` names v's views as the targets), no pass of ours touches
     the pool: after ``zero_grad()`` (``.grad`` None) the engine adds each fresh gradient into v
     at its hook (:meth:`SparseSync.add_fresh`) and keeps autograd's tensor until the next forward, as
     torch DDP keeps ``.grad``; an accumulated ``.grad`` (``no_sync``) is added into v and ``.grad``
     bound to v, so ``v += g`` is autograd's own accumulation.  With momentum correction (or a 16-bit
     pool, whose v is fp32) the gradient lands in the pool and :meth:`SparseSync.launch` folds it in
     bucket by bucket: ``u = m*u + g; v += u`` (or ``v += g``).
  2. Score: the L1 norm of v per chunk (:func:`~gradientflow.exchange.selection.chunk_scores`).  On
     CPU fp32 pools filled from ``None`` gradients it is summed while step 1 writes v (no pass of its
     own, :class:`~gradientflow.strategies.scorer.ChunkScorer`); elsewhere a score pass runs in the
     launch of the bucket that completes the chunk, so scoring runs while backward goes on.
  3. Exchange scores and select: the scores of a *slice* of chunks are SUM-allreduced, and each
     slice sends its top ``ceil(density * its chunks)`` (stable sort: ties go to the lower index, so
     every rank picks the same chunks from the same global scores).
     ``csc_scope="slice"`` (default): a slice is the chunks one bucket launch completed; its
     scores travel while backward goes on, on a process group of their own (the *control*
     group: a few KB never queue behind megabytes of chunks), and its chunks are packed and
     sent at the first gradient hook that finds the scores arrived (:meth:`SparseSync.progress`,
     called by the engine after every parameter), so the wire hides under backward and backward never
     waits for a slower peer.  ``"global"`` (the paper): one slice per pool buffer, after backward.
  4. Send: the selected rows of v, packed per slice, allreduced by :class:`~.dense.DenseSync` (pre-divided, cast);
     ``"topk-3bit"``: quantised with error feedback instead (:mod:`.csc_quantized`: their error stays in v).
  5. Write back, after one host read (the step's only one: is everything finite?): the pool is zeroed, gets
     the reduced chunks, the sent chunks leave v and u (momentum factor masking); ``.grad`` view the pool.
  6. Warm-up: step t of the first ``warmup_steps`` sends ``density ** (t / warmup_steps)`` of the chunks
     (:func:`~.selection.density_at`); a step that would be no fewer bytes than a dense one (step 0 among them,
     :func:`~.selection.dense_from`) is a plain dense step on the pool, v and u untouched.

Loss scaling: v and u are in units of the loss scale of ``model.register_grad_scaler(scaler)`` (else 1).
A non-finite value anywhere (a local gradient on any rank shows in the summed scores; an fp16 wire that
overflowed, in the reduced chunks) makes every rank fill the pool with NaN, so ``GradScaler.step`` skips the
step everywhere; nothing is masked (the chunks are sent again later), non-finite entries of v and u are reset
to 0, and the finite part of the local gradient stays in the residual (delayed, not lost).

Momentum correction (``momentum > 0``) is applied here, on the residual: the user's optimizer must NOT apply
momentum again (``check_optimizer`` warns: :mod:`gradientflow.policy.pitfalls`).

Per-step passes over the pool (see ``comm_stats()``'s ``phase_*_s``): the accumulation into v (scores folded in
on CPU from ``None`` gradients, else a score pass after it); packing, the casts, the finite check, the write-back
and the masking touch only the selected chunks.  With momentum correction add two passes (``u = g + m*u``,
``v += u``) and the pool's memset at bind.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..comm.precision import loss_scale
from ..config import GradientFlowConfig
from ..diagnostics.stats import StepStats
from ..diagnostics.trace import phase_end, phase_start
from ..engine.pool import Bucket, GradPool, Layout
from ..engine.protocol import SyncStrategy
from ..exchange.error_feedback import Residuals, residual_dtype, residual_state, validate_residual_state
from ..exchange.selection import dense_from, density_at, n_selected, samples_chunks, select_chunks
from . import csc_native
from .csc_quantized import QuantizedChunks
from .dense import DenseSync
from .scorer import ChunkScorer
from .slices import Slice, SliceQueue, pack
from .writeback import PoolWriter, untouched_params


class SparseSync(SyncStrategy):
    """CSC synchronisation strategy plugged into :class:`gradientflow.DistributedDataParallel`."""

    def __init__(
        self,
        pool: GradPool,
        dense: DenseSync,
        *,
        config: GradientFlowConfig,
        shapes: Sequence[torch.Size],
        control_group: dist.ProcessGroup,
    ) -> None:
        assert config.density is not None
        self.dense = dense
        # Score exchanges: a group of their own (the same ranks), never queued behind chunks, and
        # what lets ranks send slices at different moments (see progress).
        self._queue = SliceQueue(control_group)
        self.density = float(config.density)
        if not isinstance(config.chunk_size, int):  # the wrapper resolves "auto" before building strategies
            raise TypeError(f"SparseSync needs a resolved config (chunk_size {config.chunk_size!r}): call resolved()")
        self.chunk_size: int = config.chunk_size
        self.warmup_steps, self.momentum, self.dense_1d = config.warmup_steps, float(config.momentum), config.dense_1d
        self.per_slice = config.csc_scope == "slice"
        self.sampled = samples_chunks(config.chunk_score, self.chunk_size)
        self._shapes = list(shapes)
        # fp16 is the only wire dtype whose range a (scaled) fp32 residual can exceed.
        self._check_wire = config.wire_dtype == torch.float16
        wire = config.wire_dtype or (pool.buffers[0].dtype if pool.buffers else torch.float32)
        self._dense_from = dense_from(self.chunk_size, wire.itemsize)  # scores travel as fp32
        self.step = 0
        self.last_slice_sizes: list[int] = []
        self._writer = PoolWriter()
        self._last_dense = True  # the last step sent everything (warm-up) or nothing yet
        self._scaler: Any = None
        # Residuals from the first sparse step on: warm-up steps (and the re-layout in them) cost no residual memory.
        self.res: Residuals | None = None
        self.scorer = ChunkScorer(self.chunk_size, self.sampled)
        self.chunks = QuantizedChunks.for_config(config, dense)  # "cscq": the chunks quantised, else None
        self._set_pool(pool)

    # ---- layout ---------------------------------------------------------------------------
    def _set_pool(self, pool: GradPool) -> None:
        self.pool = pool
        C = self.chunk_size
        self.sizes = [b.numel() for b in pool.buffers]
        self.n_chunks = [math.ceil(s / C) for s in self.sizes]
        self.offsets = [sum(self.n_chunks[:k]) for k in range(len(self.sizes))]
        self.total_chunks = sum(self.n_chunks)
        self._pool_rows = [b.view(-1, C) for b in pool.padded]
        # dense_1d: the 1-D parameters are laid out last; chunks from the first one on are sent every step
        self.forced_from = list(self.n_chunks)
        if self.dense_1d:
            for s in pool.layout.slots:
                if len(self._shapes[s.param]) <= 1 and s.numel:
                    self.forced_from[s.pool] = min(self.forced_from[s.pool], s.offset // C)
        # Autograd can accumulate into v only where v has the parameters' dtype and no momentum comes between
        self._direct = [self.momentum == 0 and residual_dtype(b.dtype) == b.dtype for b in pool.buffers]
        self.scorer.set_pool(pool, self.n_chunks, self.offsets, self._direct)
        # fp32 pools (and residual rows) on CPU onto an fp16 wire: csc_native's one-pass pack and unpack
        fast = self.dense.wire_dtype == torch.float16 and csc_native.available()
        self._fast_wire = [fast and b.device.type == "cpu" and b.dtype == torch.float32 for b in pool.buffers]
        self.scores = self.scorer.scores
        self._ready, self._scored = [0] * len(self.sizes), [0] * len(self.sizes)  # elements accumulated, chunks scored
        self._in_step = False
        self._writer.forget()

    def relayout(self, old_layout: Layout, new_pool: GradPool) -> None:
        """Follow the engine's one-time re-layout: move u and v into the new pool's layout."""
        self._set_pool(new_pool)
        if self.res is not None:
            self.res = self.res.moved_to(new_pool.layout)

    def has_state(self) -> bool:  # residuals exist from the first sparse step on
        return self.res is not None

    @property
    def _res(self) -> Residuals:  # during a sparse step
        assert self.res is not None, "CSC's residuals are allocated by the first sparse step's _begin_step"
        return self.res

    @property
    def last_selected(self) -> torch.Tensor:
        """Global indices (ascending per slice) of the chunks the last step sent."""
        return self._writer.selected(self.offsets)

    def untouched(self, params: Sequence[int]) -> list[int]:
        """Unused parameters none of whose chunks was sent this step (a sent chunk may carry residual)."""
        if self._last_dense:
            return list(params)  # below: a host read, only when some parameter is unused everywhere
        return untouched_params(
            params, set(self.last_selected.tolist()), self.pool.layout, self.offsets, self.chunk_size
        )

    # ---- user hooks -----------------------------------------------------------------------
    def register_grad_scaler(self, scaler: Any) -> None:
        """Follow ``scaler``'s loss scale so residuals keep their unscaled value across changes."""
        self._scaler = scaler

    # ---- per step -------------------------------------------------------------------------
    def density_now(self) -> float:
        """The density of the coming synchronised step (the warm-up ramp, then ``density``)."""
        return density_at(self.step, self.density, self.warmup_steps)

    def _sends_dense(self) -> bool:
        """A step sent dense: density 1, or so close that a sparse step would be no fewer bytes (the ramp only
        falls, so such steps all come before the first sparse one: v and u are still empty, nothing is lost)."""
        return self.density_now() >= self._dense_from

    def _begin_step(self) -> None:
        if self.res is None:
            self.res = Residuals(self.pool.layout, self.chunk_size, self.momentum > 0, self._shapes)
        self.res.rescale(loss_scale(self._scaler))
        self.scorer.begin_step()
        self._in_step = True
        self._ready = [0] * len(self.sizes)
        self._scored = [0] * len(self.sizes)

    def begin_backward(self) -> list[torch.Tensor] | None:
        """Step 1: during a sparse step, gradients of direct pools accumulate straight into v."""
        if self._sends_dense():
            return None
        self._begin_step()
        if not any(self._direct):
            return None
        pool_views = self.pool.views
        return [
            rv if self._direct[s.pool] else pv
            for s, rv, pv in zip(self.pool.layout.slots, self._res.param_views, pool_views)
        ]

    def gradient_slice(self, bucket: Bucket, flat: torch.Tensor) -> torch.Tensor:
        """v's slice for a direct pool during a sparse step (its gradient plus the finite residual)."""
        if self._in_step and self._direct[bucket.pool]:
            return self._res.v[bucket.pool][bucket.start : bucket.end]
        return flat

    def add_fresh(self, index: int, grad: torch.Tensor, target: torch.Tensor) -> None:
        """Step 1 for a fresh gradient of a direct pool: ``v += g``, with step 2 folded in where it can
        be (:class:`~.scorer.ChunkScorer`)."""
        self.scorer.add_fresh(index, grad, target)

    def launch(self, bucket: Bucket, flat: torch.Tensor, stats: StepStats, divided: bool = False) -> None:
        """Steps 1-3 for one bucket: fold its gradient into u/v, score the chunks now complete (``divided`` is
        always False: CSC's ``take_fresh`` is the plain copy)."""
        if self._sends_dense():
            self.dense.launch(bucket, flat, stats)
            return
        if not self._in_step:
            self._begin_step()
        k = bucket.pool
        if bucket.start != self._ready[k]:
            raise RuntimeError(
                f"gradientflow CSC: bucket {bucket.index} starts at {bucket.start} of pool {k} but "
                f"{self._ready[k]} elements are accumulated; buckets must arrive in pool order."
            )
        t0 = time.perf_counter()
        if not self._direct[k]:
            res = self._res
            v = res.v[k][bucket.start : bucket.end]
            if res.u is not None:
                u = res.u[k][bucket.start : bucket.end]
                torch.add(flat, u, alpha=self.momentum, out=u)  # u = g + m*u in one pass
                v.add_(u)
            else:
                v.add_(flat)
            t0 = stats.phase("accumulate", t0)
        self._ready[k] = bucket.end
        self.scorer.launched(bucket)
        scored = self._score_ready(k)
        stats.phase("score", t0)
        if self.per_slice and scored is not None:
            self._open_slice(k, *scored, stats)  # sent by progress(), which the engine calls next

    def progress(self, stats: StepStats) -> None:
        """Send, in slice order, every slice whose global scores have arrived; never wait.

        Called at each parameter's gradient hook, so a slice goes on the wire within one layer's backward of its
        scores arriving.  Ranks may send a slice at different moments: scores travel on their own group, so each
        group sees the same collectives in the same order on every rank.  The chunks' exchanges advance too."""
        self._queue.send_arrived(self._send_slice, stats)
        if self.chunks is not None:
            self.chunks.progress(stats)
        self.dense.progress(stats)

    def _score_ready(self, k: int) -> tuple[int, int] | None:
        """Score the chunks of pool ``k`` that became complete; return their range, if any."""
        C = self.chunk_size
        upto = self.n_chunks[k] if self._ready[k] == self.sizes[k] else self._ready[k] // C
        lo = self._scored[k]
        if upto <= lo:
            return None
        self.scorer.score(k, lo, upto, self._res.rows(k))
        self._scored[k] = upto
        return lo, upto

    def _open_slice(self, k: int, lo: int, hi: int, stats: StepStats) -> None:
        """Start the exchange of the scores of chunks [lo, hi) of pool k."""
        o = self.offsets[k]
        self._queue.open(k, lo, hi, self.scores[o + lo : o + hi], stats, self.dense.watchdog)

    def _send_slice(self, sl: Slice, stats: StepStats) -> None:
        """Wait for the slice's global scores, select its top chunks, pack them, start their allreduce."""
        t0 = time.perf_counter()
        sl.handle.wait()
        stats.record_done(sl.handle.completed_at)
        t0 = stats.phase("wire_wait", t0)
        t_trace = phase_start(self.dense.watchdog)
        off = self.offsets[sl.pool]
        scores = self.scores[off + sl.lo : off + sl.hi]
        forced = max(0, sl.hi - max(sl.lo, self.forced_from[sl.pool]))  # chunks of 1-D parameters
        m = forced + n_selected(self.density_now(), sl.hi - sl.lo - forced)
        sl.idx = select_chunks(scores, m, forced=forced) + sl.lo
        t0 = stats.phase("select", t0)
        rows = self._res.rows(sl.pool)  # a packed slice's buffer: the dense strategy's wire buffer (two-level: padded)
        take = functools.partial(self.dense.wire_buffer, device=rows.device)
        if self.chunks is not None:  # "cscq": quantised and started (straight from v's rows where it can)
            self.chunks.start(sl, rows, self._pool_rows[sl.pool], take, stats)
        else:
            pack(sl, rows, take, self.dense.world_size, self._fast_wire[sl.pool])
        stats.phase("pack", t0)
        phase_end(self.dense.watchdog, "csc.select+pack", t_trace)
        if self.chunks is not None:
            return  # quantised and started above
        if sl.wire is not None:  # already divided and cast: only the allreduce is left
            self.dense.start(sl.wire, None, "chunks", stats)
        else:
            assert sl.packed is not None  # pack() fills wire or packed
            self.dense.send_chunks(sl.packed.view(-1), stats)

    def finish(self, stats: StepStats) -> None:
        """Steps 3-5 after backward: the last slices, one finite check, write-back."""
        stats.extra["warmup_ramp"] = int(self.step < self.warmup_steps)  # density_now() is still ramping down
        self._last_dense = self._sends_dense()
        if self._last_dense:
            self.dense.finish(stats)
            stats.extra.update(selected_chunks=self.total_chunks, n_chunks=self.total_chunks, warmup=1, density=1.0)
            self._writer.forget()  # the pool holds a dense result
            self.step += 1
            return
        tail = self._end_of_backward(stats)
        if self.per_slice:
            for k, (lo, hi) in tail:
                self._open_slice(k, lo, hi, stats)
        else:
            for k in range(len(self.sizes)):
                self._open_slice(k, 0, self.n_chunks[k], stats)
        # The pool's clear needs nothing of this step's wire: done while the last slices travel.
        t0 = time.perf_counter()
        self._writer.clear(self.pool, self._pool_rows)
        stats.phase("zero", t0)
        slices, sent = self._queue.drain(self._send_slice, stats)
        if self.chunks is not None:
            self.chunks.finish(stats)
        self.dense.finish(stats)

        # 5. One host read: a non-finite local gradient shows in the summed scores, an fp16 wire that overflowed in
        # the reduced chunks: the same verdict on every rank.
        t0 = time.perf_counter()
        total = self.scores.sum()
        if self._check_wire:  # slices on the fast wire path are checked as they are unpacked
            for sl in slices:
                if sl.packed is not None:
                    total = total + sl.packed.sum()
        ok = math.isfinite(float(total))
        if self.chunks is not None:
            self.chunks.settle(ok)  # not ok: rows whose error was written over v get their sent value back
        stats.host_syncs += 1
        stats.phase("check", t0)
        ok = self._write_back(slices, ok, stats)
        stats.extra.update(
            n_chunks=self.total_chunks,
            warmup=0,
            overflow=int(not ok),
            density=self.density_now(),
            selected_chunks=sum(sl.selected.numel() for sl in slices) if ok else 0,
            slices=len(slices),
            slices_in_backward=sent,
        )
        self.last_slice_sizes = [sl.hi - sl.lo for sl in slices]
        self.step += 1

    def _end_of_backward(self, stats: StepStats) -> list[tuple[int, tuple[int, int]]]:
        """Check every pool was launched; score its last chunks; return (pool, newly scored range)."""
        if not self._in_step:  # no bucket launched (no parameters): nothing to send
            self._begin_step()
        self._in_step = False
        t0 = time.perf_counter()
        scored = []
        for k in range(len(self.sizes)):
            if self._ready[k] != self.sizes[k]:
                raise RuntimeError(f"gradientflow CSC: pool {k} only partly launched at the end of backward")
            rng = self._score_ready(k)
            if rng is not None:
                scored.append((k, rng))
        stats.phase("score", t0)
        return scored

    def _write_back(self, slices: list[Slice], ok: bool, stats: StepStats) -> bool:
        """Step 5: the reduced chunks into the pool (:class:`~.writeback.PoolWriter`); a seam for variants."""
        assert self.res is not None  # allocated by the first sparse step's _begin_step
        return self._writer.write_back(self.pool, self._pool_rows, self.res, slices, ok, stats, self.dense.watchdog)

    # ---- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals (unpadded, unscaled, in the current pool layout) and the step counter."""
        return {"step": self.step, **residual_state(self.res, self.chunk_size, self.sizes)}

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        """Everything :meth:`load_state_dict` needs, checked before anything changes."""
        if "step" not in state:
            raise ValueError("gradientflow CSC: the communication state lacks ['step'] (truncated?)")
        validate_residual_state(state, self.chunk_size, self.sizes, self.momentum > 0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the engine has already adopted the saved pool layout)."""
        self.validate_state_dict(state)
        self.res = None
        if state["v"] is not None:
            self.res = Residuals(self.pool.layout, self.chunk_size, self.momentum > 0, self._shapes)
            self.res.load(state)
        self.step = int(state["step"])
