"""``gradientflow.DistributedDataParallel``: hooks, the lazy-allreduce scheduler, and finalize.

Per synchronised backward:
  1. At forward (and again when backward starts) every ``.grad`` is bound to its view of the
     pool, so autograd accumulates straight into the pool.
  2. A post-accumulate-grad hook marks each gradient ready.  Buckets (pool slices of >= θ
     bytes, cut by :func:`pool.plan_layout`) are launched strictly in bucket order, each as
     soon as it and all earlier buckets are complete.  Launch points are therefore a function
     of the layout alone: every rank issues the same collectives in the same order, even when
     the set of used parameters differs between ranks.
  3. Autograd's final callback launches the remaining buckets, waits for all, and leaves the
     averaged gradient in the pool (= in every ``.grad``).
  4. After the first synchronised backward the pool is re-laid once in the order gradients
     were actually produced on rank 0 (broadcast, so all ranks agree), as DDP rebuilds buckets.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import GradientFlowConfig
from .consistency import FiniteCheck, StepCheck, check_same_setup
from .dense import DenseSync
from .pool import GradPool, Layout, plan_layout
from .stats import StepStats
from .trace import TraceRecorder
from .watchdog import Watchdog, resolve_timeout

logger = logging.getLogger(__name__)


def _require_process_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "gradientflow.DistributedDataParallel needs an initialised process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (e.g. under torchrun)."
        )
    return process_group if process_group is not None else dist.group.WORLD


def _broadcast_coalesced(
    tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup, watchdog: Watchdog, what: str
) -> None:
    """Broadcast ``tensors`` from global rank ``src`` with one collective per (dtype, device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        work = dist.broadcast(flat, src=src, group=group, async_op=True)
        watchdog.wait(work, what, flat.numel() * flat.element_size())
        offset = 0
        for t in ts:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o)


class _Backward:
    """Bookkeeping of one synchronised backward."""

    def __init__(self, layout: Layout, n_params: int, dense_bytes: int) -> None:
        self.remaining = [len(b.params) for b in layout.buckets]
        self.next_bucket = 0
        self.seen = bytearray(n_params)
        self.order: list[int] = []
        self.stats = StepStats(dense_bytes=dense_bytes)
        self.t_start = 0.0  # perf_counter at its start, stamped only while tracing


class DistributedDataParallel(nn.Module):
    """Drop-in for ``torch.nn.parallel.DistributedDataParallel`` with GradientFlow's communication.

    Args (keyword-only, defaults in brackets; see :class:`GradientFlowConfig`):
        process_group: group to synchronise over [the default group].
        fusion_threshold_mb: θ of lazy allreduce, MB per fused collective [25.0].
        broadcast_buffers: broadcast buffers from rank 0 at each forward, as DDP [True].
        comm_dtype: "fp32" | "fp16" | "bf16" on the wire ["fp32"].
        algorithm: "native" | "ring" ["native"].
        density, chunk_size, warmup_steps, momentum, csc_scope: coarse-grained sparse
            communication [None (dense), 32768, 0, 0.0, "global"].
        timeout, check_consistency, check_finite, trace_path, trace_steps: fail loudly, never
            hang, and a timeline [the process group's, False, False, None, (1, 4)].
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        fusion_threshold_mb: float = 25.0,
        broadcast_buffers: bool = True,
        comm_dtype: str = "fp32",
        algorithm: str = "native",
        density: float | None = None,
        chunk_size: int = 32768,
        warmup_steps: int = 0,
        momentum: float = 0.0,
        csc_scope: str = "global",
        timeout: float | timedelta | None = None,
        check_consistency: bool = False,
        check_finite: bool = False,
        trace_path: str | None = None,
        trace_steps: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.config = GradientFlowConfig(
            fusion_threshold_mb=fusion_threshold_mb,
            broadcast_buffers=broadcast_buffers,
            comm_dtype=comm_dtype,
            algorithm=algorithm,
            density=density,
            chunk_size=chunk_size,
            warmup_steps=warmup_steps,
            momentum=momentum,
            csc_scope=csc_scope,
            timeout=timeout,
            check_consistency=check_consistency,
            check_finite=check_finite,
            trace_path=trace_path,
            trace_steps=trace_steps,
        )
        group = _require_process_group(process_group)
        self._gf_watchdog = Watchdog(group, resolve_timeout(self.config.timeout, group))
        self.module = module
        self.process_group = group
        self.world_size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffers = [b for b in module.buffers()]
        signature = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
        signature += [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
        device = next(module.parameters(), torch.empty(0)).device
        check_same_setup(self.config, signature, group, self._gf_watchdog, device)
        with torch.no_grad():
            _broadcast_coalesced([p for _, p in module.named_parameters()] + self._buffers, self._src, group,
                                 self._gf_watchdog, "parameter broadcast")

        self._dense_bytes = 4 * sum(p.numel() for p in self._params)
        order = list(reversed(range(len(self._params))))  # backward roughly reverses registration
        self._install(plan_layout(self._numels(), self._keys(), order, self.config.threshold_bytes))
        self._layout_final = False
        wire = self.config.wire_dtype
        dense = DenseSync(group=group, world_size=self.world_size, wire_dtype=wire, algorithm=algorithm,
                          watchdog=self._gf_watchdog)
        if self.config.sparse:
            from .csc import SparseSync  # noqa: PLC0415 — only sparse runs need it

            self._sync = SparseSync(self.pool, dense, group=group, world_size=self.world_size, config=self.config)
        else:
            self._sync = dense
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)]
        self._require_sync = True
        self._sync_this_backward = True
        self._backward: _Backward | None = None
        self._last_stats = StepStats(dense_bytes=self._dense_bytes)
        cfg = self.config
        self._gf_step_check = StepCheck(self._gf_watchdog, device) if cfg.check_consistency else None
        self._gf_finite_check = FiniteCheck(self._gf_watchdog, self._names, device) if cfg.check_finite else None
        self._gf_trace = (TraceRecorder(cfg.trace_path, cfg.trace_window, dist.get_rank(group), self.world_size)
                       if cfg.trace_path is not None else None)
        self._gf_watchdog.trace = self._gf_trace

    # ---- layout -------------------------------------------------------------------------
    def _numels(self) -> list[int]:
        return [p.numel() for p in self._params]

    def _keys(self) -> list[tuple[torch.dtype, torch.device]]:
        return [(p.dtype, p.device) for p in self._params]

    def _install(self, layout: Layout) -> None:
        """Allocate the pool for ``layout``, carry current gradients over, bind ``.grad`` views."""
        pool = GradPool(layout, self._params)
        with torch.no_grad():
            for p, view in zip(self._params, pool.views):
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
        self.pool = pool
        self._bucket_of = [0] * len(self._params)
        for b in layout.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index

    def _relayout_from_observed(self, observed: list[int]) -> None:
        """Adopt rank 0's observed backward order (unseen parameters keep their relative order)."""
        seen = set(observed)
        order = observed + [i for i in self.pool.layout.order if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64)
        if self._params:
            order_t = order_t.to(self._params[0].device)
        work = dist.broadcast(order_t, src=self._src, group=self.process_group, async_op=True)
        self._gf_watchdog.wait(work, "layout broadcast", order_t.numel() * 8)
        order = order_t.tolist()
        self._layout_final = True
        if tuple(order) != self.pool.layout.order:
            old = self.pool
            self._install(plan_layout(self._numels(), self._keys(), order, self.config.threshold_bytes))
            if hasattr(self._sync, "relayout"):
                self._sync.relayout(old.layout, self.pool)
            logger.debug("gradientflow: gradient pool re-laid in observed backward order")

    def _bind_grads(self) -> None:
        """Point every ``.grad`` at its pool view; a ``None`` grad (zero_grad(set_to_none)) is zero."""
        views = self.pool.views
        with torch.no_grad():
            if all(p.grad is None for p in self._params):
                for buf in self.pool.buffers:
                    buf.zero_()
                for p, view in zip(self._params, views):
                    p.grad = view
                return
            for p, view in zip(self._params, views):
                g = p.grad
                if g is view:
                    continue
                if g is None:
                    view.zero_()
                elif g.data_ptr() != view.data_ptr():
                    view.copy_(g)
                p.grad = view

    # ---- forward ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        grad_on = torch.is_grad_enabled()
        tr = self._gf_trace
        t_fwd = time.perf_counter() if tr is not None and tr.active else None
        if grad_on:
            if self._gf_step_check is not None:
                self._gf_step_check.passes += 1
            self._bind_grads()
            self._sync_this_backward = self._require_sync
        if (
            grad_on
            and self._require_sync
            and self.config.broadcast_buffers
            and self._buffers
            and self.world_size > 1
        ):
            with torch.no_grad():
                _broadcast_coalesced(self._buffers, self._src, self.process_group, self._gf_watchdog,
                                     "buffer broadcast")
        out = self.module(*args, **kwargs)
        if grad_on and self._sync_this_backward:
            # A rank whose loss uses no parameter still has to join the collectives: the hook on
            # the output starts the synchronised backward even if no parameter hook ever fires.
            for t in _iter_tensors(out):
                if t.requires_grad:
                    t.register_hook(self._output_grad_hook)
        if t_fwd is not None:
            tr.complete("forward", "forward", t_fwd, time.perf_counter())
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside the context synchronises them."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # ---- backward -----------------------------------------------------------------------
    def _begin_backward(self) -> _Backward:
        bw = self._backward
        if bw is None:
            tr = self._gf_trace
            t_start = time.perf_counter() if tr is not None and tr.active else 0.0
            if self._gf_step_check is not None:  # before any bucket: matched with the others' check
                self._gf_step_check.start(self.pool.layout)
            self._bind_grads()
            bw = self._backward = _Backward(self.pool.layout, len(self._params), self._dense_bytes)
            bw.t_start = t_start
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        return bw

    def _output_grad_hook(self, grad: torch.Tensor) -> None:
        if self._sync_this_backward:
            self._begin_backward()

    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if self._backward is None and not self._sync_this_backward:
                return  # no_sync: the gradient just accumulates in the pool
            self._grad_ready(i, param)

        return hook

    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        bw = self._begin_backward()
        if bw.seen[i]:
            raise RuntimeError(
                f"gradientflow: parameter '{self._names[i]}' produced a gradient twice in one backward "
                "(reentrant backward or a second backward through the same graph inside one step). "
                "Synchronise once per backward, or use no_sync() for the extra passes."
            )
        bw.seen[i] = 1
        bw.order.append(i)
        view = self.pool.views[i]
        if param.grad is not view:  # grad was created outside the pool (e.g. set_to_none, no forward)
            with torch.no_grad():
                if param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
            param.grad = view
        b = self._bucket_of[i]
        bw.remaining[b] -= 1
        buckets = self.pool.layout.buckets
        while bw.next_bucket < len(buckets) and bw.remaining[bw.next_bucket] == 0:
            self._launch(bw, bw.next_bucket)

    def _launch(self, bw: _Backward, index: int) -> None:
        bucket = self.pool.layout.buckets[index]
        flat = self.pool.bucket_view(bucket)
        if self._gf_finite_check is not None:  # before the wire overwrites the local gradient
            self._gf_finite_check.screen(bucket, flat, self.pool.views)
        tr = self._gf_trace
        if tr is not None and tr.active:
            with tr.span(f"launch bucket {index}", "launch", bytes=flat.numel() * flat.element_size()):
                self._sync.launch(bucket, flat, bw.stats)
        else:
            self._sync.launch(bucket, flat, bw.stats)
        bw.next_bucket = index + 1

    def _finish_backward(self) -> None:
        bw = self._backward
        if bw is None:
            return
        tr = self._gf_trace
        t_final = time.perf_counter() if tr is not None and tr.active else None
        if t_final is not None:
            tr.complete("backward", "backward", bw.t_start, t_final)
        try:
            t0 = time.perf_counter()
            while bw.next_bucket < len(self.pool.layout.buckets):
                self._launch(bw, bw.next_bucket)
            mismatch = self._gf_step_check.verify() if self._gf_step_check is not None else None
            self._sync.finish(bw.stats)  # also on a mismatch: every rank has the same verdict
            if mismatch is not None:
                raise mismatch
            bw.stats.exposed_seconds = time.perf_counter() - t0
            bw.stats.close()
        finally:
            self._backward = None
        self._last_stats = bw.stats
        if not self._layout_final:
            self._relayout_from_observed(bw.order)
        if t_final is not None:
            tr.complete("final wait", "final", t_final, time.perf_counter())
        self._end_step()

    def _end_step(self) -> None:
        """The check_finite verdict on this step, then count it (messages, trace window)."""
        try:
            if self._gf_finite_check is not None:
                self._gf_finite_check.decide()
        finally:
            self._gf_watchdog.step += 1
            if self._gf_trace is not None:
                self._gf_trace.set_step(self._gf_watchdog.step)  # writes the file after a traced step

    # ---- state of the communication (CSC residuals) ---------------------------------------
    def comm_state_dict(self) -> dict[str, Any]:
        """Communication state (CSC residuals u, v and step counter) to checkpoint with the model."""
        if not hasattr(self._sync, "state_dict"):
            return {}
        state = dict(self._sync.state_dict())
        # Residuals and CSC chunks live in the pool layout: a resumed run must use the same one.
        state["layout_order"] = list(self.pool.layout.order)
        state["layout_final"] = self._layout_final
        return state

    def load_comm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`comm_state_dict` returned (same model, density and world size)."""
        if hasattr(self._sync, "load_state_dict"):
            order = state.get("layout_order")
            if order is not None and tuple(order) != self.pool.layout.order:
                old = self.pool
                self._install(plan_layout(self._numels(), self._keys(), list(order), self.config.threshold_bytes))
                self._sync.relayout(old.layout, self.pool)
            if state.get("layout_final"):
                self._layout_final = True
            self._sync.load_state_dict(state)
        elif state:
            raise ValueError("this model communicates densely and has no communication state to load")

    def register_grad_scaler(self, scaler: Any) -> None:
        """Tell CSC about the ``torch.amp.GradScaler`` in use (residuals are kept unscaled).

        Without it CSC assumes a loss scale of 1.  Dense communication does not need it.
        """
        if hasattr(self._sync, "register_grad_scaler"):
            self._sync.register_grad_scaler(scaler)
        if self._gf_finite_check is not None:  # overflow is now the scaler's to skip, not an error
            self._gf_finite_check.scaler_registered = True

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn if CSC momentum correction is on and ``optimizer`` applies momentum too."""
        if hasattr(self._sync, "check_optimizer"):
            self._sync.check_optimizer(optimizer)

    # ---- introspection ------------------------------------------------------------------
    def comm_stats(self) -> dict[str, float | int]:
        """Counters of the last completed synchronised step (see :class:`StepStats`)."""
        return self._last_stats.as_dict()
