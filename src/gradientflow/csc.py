"""Coarse-grained sparse communication (CSC): send only the top chunks of the accumulated gradient.

The gradient pool is cut into chunks of ``C = chunk_size`` elements (each pool buffer separately,
its last chunk may be short; chunks get one global index across buffers).  Per synchronised step:

  1. Accumulate (in :meth:`SparseSync.launch`, bucket by bucket, while backward still runs):
     with momentum correction ``u = m*u + g; v = v + u``, without it ``v = v + g``.  ``g`` is
     divided by the GradScaler's current scale on the way in, so u and v are always
     *unscaled*: a change of the loss scale never touches them.
  2. Score: the L1 norm of v per chunk, computed in the same launch for every chunk that the
     ready prefix of the pool now covers.  Once backward has ended (:meth:`finish`) the score
     vector (one fp32 per chunk) is SUM-allreduced, so every rank holds the same global scores.
  3. Select the top ``ceil(density * n_chunks)`` chunks by global score; ties go to the lower
     chunk index (stable sort), so every rank picks the same chunks by construction.
  4. Send: pack the selected chunks of v contiguously (times the loss scale, so an fp16 wire
     carries the same magnitudes as a dense scaled gradient), allreduce them through the dense
     path (any algorithm, any comm dtype, pre-divided by world size), write the result into the
     pool at the selected chunks and zero the rest.  Zero v and u at the selected chunks
     (momentum factor masking).
  5. Warm-up: the first ``warmup_steps`` synchronised steps are plain dense steps
     (:class:`DenseSync` on the pool as-is; u and v are untouched).  We chose a hard switch,
     not a density ramp: it keeps "warm-up = exactly dense" testable and costs nothing.

Design choice — scoring once after backward, global top-k (as the paper): accumulation and
per-chunk scoring are done per bucket during backward (they are the expensive passes), but the
selection is global, so the score allreduce and the single packed allreduce are issued after the
last bucket.  Per fused slice top-k would overlap the (tiny) packed allreduces with backward,
but would fix the split of the budget across slices and cost one score + one data collective per
slice; with ~10% of the bytes left, the exposed network time of one packed allreduce is small.

Momentum correction (``momentum > 0``): momentum is applied here, on the residual, so the
user's optimizer must NOT apply momentum again (use ``SGD(momentum=0)``).  With factor masking
a chunk loses its momentum whenever it is sent, so often-sent chunks train like plain SGD: on
the digits test at the dense run's lr it ended 1-2 points below optimizer momentum with
``momentum=0`` here (error feedback alone), which matched dense accuracy.
:meth:`SparseSync.check_optimizer` (``model.check_optimizer(opt)``) warns when it does.

Loss scaling: ``model.register_grad_scaler(scaler)`` lets CSC read the scale of each step
(without it the scale is taken as 1).  Overflow handling, identical on every rank:
  - a non-finite gradient on any rank makes the allreduced score vector non-finite everywhere;
    every rank then undoes this step's accumulation (``v -= u_new``, ``u = (u_new - g)/m``, or
    ``v -= g``: exact up to one fp32 rounding; entries whose own gradient was inf/nan cannot be
    recovered and are reset to 0) and fills the pool with NaN, so ``GradScaler.step`` skips the
    step on every rank and lowers the scale;
  - a packed allreduce that overflows the fp16 wire leaves inf in the (identical) result on
    every rank: the result is written to the pool (the scaler skips), and v/u are not cleared,
    so those chunks are sent again at the lower scale.

Per-step passes over the pool (the cost that matters on a CPU rank; see DESIGN.md):
accumulate (1: ``v += g``; with momentum 2: ``u = g + m*u`` fused, ``v += u``; +1 ``u /= S``
when a loss scale S != 1 is registered), score (1), zero the pool (1, a memset: the pool holds
this step's g, which must not reach the optimizer).  Packing, the fp16 cast, the overflow check
(one sum), write-back and the masking of u/v touch only the selected chunks.  Measured on
ResNet-50's 25.6M-float pool, one thread: about 30 ms per step without momentum, 36 ms with.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import PendingAllreduce, start_allreduce
from .config import GradientFlowConfig
from .dense import DenseSync
from .pool import Bucket, GradPool, Layout, transfer
from .stats import StepStats
from .strategy import SyncStrategy
from .trace import phase_end, phase_start


def n_selected(density: float, n_chunks: int) -> int:
    """``ceil(density * n_chunks)``, at least 1; the product is rounded first so 0.1*30 gives 3."""
    if n_chunks == 0:
        return 0
    return min(n_chunks, max(1, math.ceil(round(density * n_chunks, 9))))


def chunk_scores(v: torch.Tensor, chunk_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """L1 norm of each ``chunk_size`` chunk of the flat ``v`` (numel must be a multiple of it).

    ``vector_norm(ord=1)`` over the [n, C] view is ~2.5x faster than ``abs().sum(1)`` on CPU.
    """
    rows = v.view(-1, chunk_size)
    if out is None:
        return torch.linalg.vector_norm(rows, ord=1, dim=1)
    return torch.linalg.vector_norm(rows, ord=1, dim=1, out=out)


def select_chunks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the ``k`` highest scores; equal scores go to the lower index.

    A stable descending sort keeps equal scores in index order, so the result is a pure
    function of the score values: identical on ranks holding identical scores.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


@dataclass
class _Slice:
    """Chunks [lo, hi) of pool ``pool`` scored by one launch (scope="slice")."""

    pool: int
    lo: int
    hi: int
    handle: PendingAllreduce
    idx: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    send: torch.Tensor | None = None


class SparseSync(SyncStrategy):
    """CSC synchronisation strategy plugged into :class:`gradientflow.DistributedDataParallel`."""

    def __init__(
        self,
        pool: GradPool,
        dense: DenseSync,
        *,
        group: dist.ProcessGroup,
        world_size: int,
        config: GradientFlowConfig,
    ) -> None:
        assert config.density is not None
        self.dense = dense
        self.group = group
        self.world_size = world_size
        self.density = float(config.density)
        self.chunk_size = config.chunk_size
        self.warmup_steps = config.warmup_steps
        self.momentum = float(config.momentum)
        self.per_slice = config.csc_scope == "slice"
        self._slices: list[_Slice] = []
        self.last_slice_sizes: list[int] = []
        # fp16 is the only wire dtype whose range a (scaled) fp32 residual can exceed.
        self._check_wire = config.wire_dtype == torch.float16
        self.step = 0
        self.last_selected = torch.zeros(0, dtype=torch.int64)
        self._last_dense = True  # the last step sent everything (warm-up) or nothing yet
        self._scaler: Any = None
        self._set_pool(pool)
        # Residuals are allocated at the first sparse step: warm-up steps (and the one-time
        # re-layout that usually happens during them) then cost no residual memory at all.
        self.v: list[torch.Tensor] | None = None
        self.u: list[torch.Tensor] | None = None

    def _allocate_residuals(self) -> None:
        if self.v is None:
            self.v = self._zeros()
            self.u = self._zeros() if self.momentum > 0 else None

    # ---- layout ---------------------------------------------------------------------------
    def _set_pool(self, pool: GradPool) -> None:
        self.pool = pool
        C = self.chunk_size
        self.sizes = [b.numel() for b in pool.buffers]
        self.n_chunks = [math.ceil(s / C) for s in self.sizes]
        self.offsets = [sum(self.n_chunks[:k]) for k in range(len(self.sizes))]
        self.total_chunks = sum(self.n_chunks)
        device = pool.buffers[0].device if pool.buffers else torch.device("cpu")
        self.scores = torch.zeros(self.total_chunks, dtype=torch.float32, device=device)
        self._ready = [0] * len(self.sizes)   # elements of each buffer accumulated this step
        self._scored = [0] * len(self.sizes)  # chunks of each buffer scored this step
        self._in_step = False
        self._scale = 1.0

    def _zeros(self) -> list[torch.Tensor]:
        # Padded to whole chunks so every buffer is an exact [n, C] view; the pad stays 0.
        return [torch.zeros(n * self.chunk_size, dtype=torch.float32, device=b.device)
                for n, b in zip(self.n_chunks, self.pool.buffers)]

    def _padded(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = self._zeros()
        for dst, src in zip(out, flat):
            dst[: src.numel()].copy_(src)
        return out

    def relayout(self, old_layout: Layout, new_pool: GradPool) -> None:
        """Follow the engine's one-time re-layout: move u and v into the new pool's layout."""
        old_v, old_u = self.v, self.u
        self._set_pool(new_pool)
        if old_v is None:
            return
        # Straight into new padded buffers, one residual at a time: the transient is one buffer.
        self.v = transfer(old_layout, new_pool.layout, old_v, out=self._zeros())
        del old_v
        if old_u is not None:
            self.u = transfer(old_layout, new_pool.layout, old_u, out=self._zeros())

    def has_state(self) -> bool:
        return self.v is not None

    def untouched(self, params: Sequence[int]) -> list[int]:
        """Unused parameters none of whose chunks was sent this step (a sent chunk may carry residual)."""
        if self._last_dense:
            return list(params)
        sent = set(self.last_selected.tolist())  # a host read, only when some parameter is unused everywhere
        C, out = self.chunk_size, []
        for i in params:
            s = self.pool.layout.slots[i]
            base = self.offsets[s.pool]
            chunks = range(base + s.offset // C, base + (s.offset + s.numel - 1) // C + 1) if s.numel else ()
            if not any(c in sent for c in chunks):
                out.append(i)
        return out

    # ---- user hooks -----------------------------------------------------------------------
    def register_grad_scaler(self, scaler: Any) -> None:
        """Read ``scaler.get_scale()`` once per step so residuals are kept unscaled."""
        self._scaler = scaler

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn if momentum correction is on and ``optimizer`` applies momentum as well."""
        if self.momentum <= 0:
            return
        for group in optimizer.param_groups:
            betas = group.get("betas")
            if group.get("momentum", 0) or (betas is not None and betas[0] > 0):
                warnings.warn(
                    f"gradientflow: CSC applies momentum correction (momentum={self.momentum}); the "
                    "optimizer applies momentum again. Use SGD(momentum=0), or momentum=0 in "
                    "gradientflow.DistributedDataParallel to keep the optimizer's momentum.",
                    stacklevel=3,
                )
                return

    # ---- per step -------------------------------------------------------------------------
    def _warmup(self) -> bool:
        return self.step < self.warmup_steps

    def _begin_step(self) -> None:
        self._allocate_residuals()
        self._in_step = True
        self._ready = [0] * len(self.sizes)
        self._scored = [0] * len(self.sizes)
        self._scale = float(self._scaler.get_scale()) if self._scaler is not None else 1.0

    def launch(self, bucket: Bucket, flat: torch.Tensor, stats: StepStats) -> None:
        """Steps 1-2 for one bucket: fold its gradient into u/v, score the chunks now complete."""
        if self._warmup():
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
        inv = 1.0 / self._scale
        v = self.v[k][bucket.start : bucket.end]
        if self.u is not None:
            u = self.u[k][bucket.start : bucket.end]
            # u = g + m*u in one pass; with a loss scale S, u = (g + (m*S)*u) / S: for a
            # power-of-two S this rounds exactly like the unscaled run (the scale changes nothing).
            torch.add(flat, u, alpha=self.momentum * self._scale, out=u)
            if inv != 1.0:
                u.mul_(inv)
            v.add_(u)
        else:
            v.add_(flat) if inv == 1.0 else v.add_(flat, alpha=inv)  # alpha=1 is a slower kernel
        self._ready[k] = bucket.end
        scored = self._score_ready(k)
        if self.per_slice:
            if scored is not None:
                self._start_slice(k, *scored, stats)
            # Lag of one slice: the previous slice's scores had a whole bucket of backward to
            # arrive, so waiting for them here rarely stalls; its chunks then travel while
            # backward goes on.  The launch points depend on the layout only: same on all ranks.
            for sl in self._slices[:-1]:
                if sl.send is None:
                    self._send_slice(sl, stats)

    def _score_ready(self, k: int) -> tuple[int, int] | None:
        """Score the chunks of pool ``k`` that became complete; return their range, if any."""
        C = self.chunk_size
        upto = self.n_chunks[k] if self._ready[k] == self.sizes[k] else self._ready[k] // C
        lo = self._scored[k]
        if upto <= lo:
            return None
        off = self.offsets[k]
        chunk_scores(self.v[k][lo * C : upto * C], C, out=self.scores[off + lo : off + upto])
        self._scored[k] = upto
        return lo, upto

    def finish(self, stats: StepStats) -> None:
        """Steps 2-4 after backward: global scores, selection, one packed allreduce, write-back."""
        self._last_dense = self._warmup()
        if self.per_slice and not self._warmup():
            self._finish_slices(stats)
            return
        if self._warmup():
            self.dense.finish(stats)
            stats.extra["selected_chunks"] = self.total_chunks
            stats.extra["n_chunks"] = self.total_chunks
            stats.extra["warmup"] = 1
            self.step += 1
            return
        self._end_of_backward()  # global scope: the score vector is complete; sent in one piece below
        n = self.total_chunks
        stats.extra["n_chunks"] = n
        stats.extra["warmup"] = 0
        stats.extra["overflow"] = 0

        # 2. Global scores: fp32 SUM, one float per chunk.  "native" whatever the algorithm: a
        # few KB are latency-bound, and a ring would pay 2(N-1) hops for them.
        stats.record_collective(self.scores.numel() * self.scores.element_size())
        handle = start_allreduce(self.scores, group=self.group, algorithm="native", watchdog=self.dense.watchdog,
                                 what="scores")
        handle.wait()
        stats.record_done(handle.completed_at)
        if not bool(torch.isfinite(self.scores).all()):
            self._skip_overflow(stats)
            return

        # 3. Select.
        t_phase = phase_start(self.dense.watchdog)
        kk = n_selected(self.density, n)
        idx = select_chunks(self.scores, kk)
        self.last_selected = idx
        stats.extra["selected_chunks"] = kk

        # 4. Pack the selected chunks of v (rows of the [n, C] views), in global index order.
        C = self.chunk_size
        packed = torch.empty(kk, C, dtype=torch.float32, device=self.scores.device)
        per_pool: list[tuple[int, torch.Tensor, int]] = []
        row = 0
        for k in range(len(self.sizes)):
            lo, hi = self.offsets[k], self.offsets[k] + self.n_chunks[k]
            idx_k = idx[(idx >= lo) & (idx < hi)] - lo if len(self.sizes) > 1 else idx
            m = idx_k.numel()
            if m:
                torch.index_select(self.v[k].view(-1, C), 0, idx_k, out=packed[row : row + m])
                per_pool.append((k, idx_k, row))
            row += m
        if self._scale != 1.0:
            packed.mul_(self._scale)  # the pool receives a scaled gradient, as the scaler expects
        # The pad of the last buffer's short last chunk is the tail of `packed`: not sent.
        n_send = kk * C
        if kk and int(idx[-1]) == n - 1:
            n_send -= self.n_chunks[-1] * C - self.sizes[-1]
        send = packed.view(-1)[:n_send]
        phase_end(self.dense.watchdog, "csc.select+pack", t_phase)
        self.dense.launch(None, send, stats)
        self.dense.finish(stats)
        # One sum instead of isfinite() (which is 3 passes): any inf/nan makes the sum non-finite,
        # and finite fp16-range values cannot overflow an fp32 sum.
        ok = not self._check_wire or math.isfinite(float(send.sum()))

        self._write_back([(k, idx_k, packed[r : r + idx_k.numel()]) for k, idx_k, r in per_pool], ok, stats)

    def _end_of_backward(self) -> list[tuple[int, tuple[int, int]]]:
        """Check every pool was launched; score its last chunks; return (pool, newly scored range)."""
        if not self._in_step:  # no bucket launched (no parameters): nothing to send
            self._begin_step()
        self._in_step = False
        scored = []
        for k in range(len(self.sizes)):
            if self._ready[k] != self.sizes[k]:
                raise RuntimeError(f"gradientflow CSC: pool {k} only partly launched at the end of backward")
            rng = self._score_ready(k)
            if rng is not None:
                scored.append((k, rng))
        return scored

    def _write_back(self, parts: list[tuple[int, torch.Tensor, torch.Tensor]], ok: bool, stats: StepStats) -> None:
        """Step 4's end: the pool gets the reduced chunks and zeros; sent chunks leave u and v.

        ``parts`` holds (pool, chunk indices in that pool, reduced rows).  The pool is zeroed
        first because it still holds this step's local gradient, which must not reach the optimizer.
        """
        C = self.chunk_size
        t_phase = phase_start(self.dense.watchdog)
        for buf in self.pool.buffers:
            buf.zero_()
        for k, idx_k, rows in parts:
            self._write_chunks(k, idx_k, rows)
            if ok:  # momentum factor masking: what was sent leaves the residual
                self.v[k].view(-1, C).index_fill_(0, idx_k, 0.0)
                if self.u is not None:
                    self.u[k].view(-1, C).index_fill_(0, idx_k, 0.0)
        if not ok:
            stats.extra["overflow"] = 1
        self.step += 1
        phase_end(self.dense.watchdog, "csc.write-back", t_phase)

    # ---- per-slice selection (scope="slice") ----------------------------------------------
    def _start_slice(self, k: int, lo: int, hi: int, stats: StepStats) -> None:
        """Start the (async, fp32 SUM) allreduce of the scores of chunks [lo, hi) of pool k."""
        off = self.offsets[k]
        scores = self.scores[off + lo : off + hi]
        stats.record_collective(scores.numel() * scores.element_size())
        handle = start_allreduce(scores, group=self.group, algorithm="native", watchdog=self.dense.watchdog,
                                 what=f"scores of pool {k} chunks {lo}-{hi}")
        self._slices.append(_Slice(k, lo, hi, handle))

    def _send_slice(self, sl: _Slice, stats: StepStats) -> None:
        """Wait for the slice's global scores, select its top chunks, pack them, start their allreduce."""
        sl.handle.wait()
        stats.record_done(sl.handle.completed_at)
        t_phase = phase_start(self.dense.watchdog)
        k, C = sl.pool, self.chunk_size
        off = self.offsets[k]
        m = n_selected(self.density, sl.hi - sl.lo)
        sl.idx = select_chunks(self.scores[off + sl.lo : off + sl.hi], m) + sl.lo  # pool-local
        sl.packed = torch.index_select(self.v[k].view(-1, C), 0, sl.idx)
        if self._scale != 1.0:
            sl.packed.mul_(self._scale)
        n_send = m * C
        if int(sl.idx[-1]) == self.n_chunks[k] - 1:  # the pool's short last chunk: pad not sent
            n_send -= self.n_chunks[k] * C - self.sizes[k]
        sl.send = sl.packed.view(-1)[:n_send]
        phase_end(self.dense.watchdog, "csc.select+pack", t_phase)
        self.dense.launch(None, sl.send, stats)

    def _finish_slices(self, stats: StepStats) -> None:
        """End of backward with per-slice selection: send the last slices, wait, write back."""
        for k, (lo, hi) in self._end_of_backward():
            self._start_slice(k, lo, hi, stats)
        slices, self._slices = self._slices, []
        for sl in slices:
            if sl.send is None:
                self._send_slice(sl, stats)
        self.dense.finish(stats)
        stats.extra["n_chunks"] = self.total_chunks
        stats.extra["warmup"] = 0
        stats.extra["overflow"] = 0
        stats.extra["slices"] = len(slices)
        if not bool(torch.isfinite(self.scores).all()):
            self._skip_overflow(stats)
            return
        self.last_selected = torch.cat([sl.idx + self.offsets[sl.pool] for sl in slices]) if slices \
            else torch.zeros(0, dtype=torch.int64)
        self.last_slice_sizes = [sl.hi - sl.lo for sl in slices]
        stats.extra["selected_chunks"] = int(self.last_selected.numel())
        ok = not self._check_wire or all(math.isfinite(float(sl.send.sum())) for sl in slices)
        self._write_back([(sl.pool, sl.idx, sl.packed) for sl in slices], ok, stats)

    def _write_chunks(self, k: int, idx_k: torch.Tensor, rows: torch.Tensor) -> None:
        buf, C = self.pool.buffers[k], self.chunk_size
        full = buf.numel() // C
        if full < self.n_chunks[k] and int(idx_k[-1]) == full:  # the short last chunk
            buf[full * C :].copy_(rows[-1, : buf.numel() - full * C])
            idx_k, rows = idx_k[:-1], rows[:-1]
        if idx_k.numel():
            buf[: full * C].view(full, C).index_copy_(0, idx_k, rows.to(buf.dtype))

    def _skip_overflow(self, stats: StepStats) -> None:
        """Some rank's gradient is non-finite: undo this step's accumulation, poison the pool."""
        inv = 1.0 / self._scale
        for k, g in enumerate(self.pool.buffers):
            v = self.v[k][: self.sizes[k]]
            if self.u is not None:
                u = self.u[k][: self.sizes[k]]
                v.sub_(u)
                u.sub_(g, alpha=inv).div_(self.momentum)
                torch.nan_to_num_(u, nan=0.0, posinf=0.0, neginf=0.0)
            else:
                v.sub_(g, alpha=inv)
            torch.nan_to_num_(v, nan=0.0, posinf=0.0, neginf=0.0)
            # NaN on every rank: GradScaler.step skips everywhere (a plain optimizer would apply
            # NaN, exactly as it would after a dense allreduce of a non-finite gradient).
            g.fill_(float("nan"))
        stats.extra["overflow"] = 1
        stats.extra["selected_chunks"] = 0
        self.last_selected = torch.zeros(0, dtype=torch.int64)
        self.step += 1

    # ---- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals (unpadded, in the current pool layout) and the step counter."""
        return {
            "step": self.step,
            "chunk_size": self.chunk_size,
            "sizes": list(self.sizes),
            "v": [v[:s].clone() for v, s in zip(self.v, self.sizes)] if self.v is not None else None,
            "u": [u[:s].clone() for u, s in zip(self.u, self.sizes)] if self.u is not None else None,
        }

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        """Everything :meth:`load_state_dict` needs, checked before anything changes."""
        missing = {"step", "chunk_size", "sizes", "v", "u"} - set(state)
        if missing:
            raise ValueError(f"gradientflow CSC: the communication state lacks {sorted(missing)} (truncated?)")
        if state["chunk_size"] != self.chunk_size or list(state["sizes"]) != self.sizes:
            raise ValueError(
                f"gradientflow CSC: checkpoint has chunk_size={state['chunk_size']} and pool sizes "
                f"{state['sizes']}, this model has chunk_size={self.chunk_size} and {self.sizes}. "
                "Load it into the same model with the same chunk_size."
            )
        if state["v"] is not None and (state["u"] is None) != (self.momentum == 0):
            raise ValueError("gradientflow CSC: checkpoint and model disagree on momentum correction (u)")
        for name in ("v", "u"):
            tensors = state[name]
            if tensors is None:
                continue
            if len(tensors) != len(self.sizes) or any(
                not isinstance(t, torch.Tensor) or t.numel() != n for t, n in zip(tensors, self.sizes)
            ):
                raise ValueError(
                    f"gradientflow CSC: residual {name} in the checkpoint does not have the pool's sizes "
                    f"{self.sizes} (truncated or from another model)."
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the engine has already adopted the saved pool layout)."""
        self.validate_state_dict(state)
        self.v = self._padded(state["v"]) if state.get("v") is not None else None
        self.u = self._padded(state["u"]) if state.get("u") is not None else None
        self.step = int(state["step"])
