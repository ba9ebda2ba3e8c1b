"""``gradientflow.DistributedDataParallel``: torch DDP's interface over the gradient pool.

Per synchronised backward:
  1. When backward starts (a hook on the forward's outputs) every ``.grad`` is bound to its view
     of the pool, so autograd accumulates straight into the pool.  Before that a ``.grad`` is
     whatever the user left (``None`` after ``zero_grad()``), as in torch DDP.
  2. A post-accumulate-grad hook marks each gradient ready.  Buckets (pool slices of >= θ
     bytes, cut by :func:`pool.plan_layout`) are launched strictly in bucket order, each as
     soon as it and all earlier buckets are complete.  Launch points are therefore a function
     of the layout alone: every rank issues the same collectives in the same order, even when
     the set of used parameters differs between ranks.
  3. Autograd's final callback launches the remaining buckets and a one-byte-per-parameter
     "used" exchange (MAX), waits for all, and leaves the averaged gradient in the pool (= in
     every ``.grad``).  A parameter no rank used, whose ``.grad`` was ``None``, gets ``None``
     back, so optimizers skip it as they do under torch DDP.
  4. After the first synchronised backward the pool is re-laid once in the order gradients
     were actually produced on rank 0 (broadcast, so all ranks agree), as DDP rebuilds buckets.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .compat import check_no_sparse_gradients, iter_tensors, move_to_device, resolve_ddp_args
from .config import GradientFlowConfig
from .consistency import FiniteCheck, StepCheck, check_same_setup
from .dense import DenseSync
from .join import GradientFlowJoinHook, common_rank, max_over_ranks
from .pool import GradPool, Layout, plan_layout, small_last
from .stats import StepStats
from .strategy import SyncStrategy
from .trace import TraceRecorder
from .watchdog import Watchdog, resolve_timeout

logger = logging.getLogger(__name__)


def _broadcast_coalesced(
    tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup, watchdog: Watchdog, what: str
) -> None:
    """Broadcast ``tensors`` from global rank ``src`` with one collective per (dtype, device).

    Written through ``.data`` (its own version counter) and not at all on ``src``: a forward that
    re-broadcasts BatchNorm buffers must not invalidate an earlier forward's graph that saved
    them (two forwards before one backward), as torch DDP's C++ broadcast does not.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    receive = dist.get_rank() != src
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        work = dist.broadcast(flat, src=src, group=group, async_op=True)
        watchdog.wait(work, what, flat.numel() * flat.element_size())
        offset = 0
        for t in ts:
            if receive:
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class _Backward:
    """Bookkeeping of one synchronised backward."""

    def __init__(self, layout: Layout, n_params: int, dense_bytes: int) -> None:
        self.remaining = [len(b.params) for b in layout.buckets]
        self.next_bucket = 0
        self.seen = bytearray(n_params)
        self.order: list[int] = []
        self.stats = StepStats(dense_bytes=dense_bytes)
        self.t_start = 0.0  # perf_counter at its start, stamped only while tracing


class DistributedDataParallel(nn.Module, Joinable):
    """Drop-in for ``torch.nn.parallel.DistributedDataParallel`` with GradientFlow's communication.

    torch DDP's arguments keep their positions, defaults and meaning:
        device_ids, output_device: ``[local_rank]`` for a module on one GPU (inputs are moved
            there at forward, as DDP does); ``None`` for CPU modules.  dim: accepted, unused by
            single-device modules in DDP too.
        broadcast_buffers (deprecated in torch 2.13) / forward_sync_buffers: broadcast buffers
            from rank 0 at every synchronised forward [True].
        init_sync: compare the models and broadcast rank 0's parameters and buffers [True].
        process_group / device_mesh (1-D): the group to average over [the default group].
        bucket_cap_mb: θ of lazy allreduce (the same setting as ``fusion_threshold_mb``) [25].
        find_unused_parameters: accepted, no effect: unused parameters are always handled (a
            one-byte-per-parameter exchange per step tells which ones no rank used).
        gradient_as_bucket_view: accepted, no effect: ``.grad`` is always a view of the pool.
        static_graph: the set of used parameters never changes, so the "used" exchange runs
            once instead of every step.
        check_reduction, skip_all_reduce_unused_params, batched_grad_copy: accepted, no effect on
            results here.
        mixed_precision, delay_all_reduce_named_params, param_to_hook_all_reduce,
            bucket_cap_mb_list, a multi-dimensional device_mesh: ``ValueError`` with the alternative.

    gradientflow's own options (keyword-only; see :class:`GradientFlowConfig` and the README):
        fusion_threshold_mb [25.0], comm_dtype ["fp32"], algorithm ["native"], density [None =
        dense], chunk_size ["auto"], warmup_steps [100], momentum [0.0], dense_1d [True],
        chunk_score ["l1"], csc_scope ["slice"];
        timeout, check_consistency, check_finite, trace_path, trace_steps: fail loudly, never
        hang, and a timeline [the process group's, False, False, None, (1, 4)].
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        fusion_threshold_mb: float | None = None,
        comm_dtype: str = "fp32",
        algorithm: str = "native",
        density: float | None = None,
        chunk_size: int | str = "auto",
        warmup_steps: int = 100,
        momentum: float = 0.0,
        dense_1d: bool = True,
        chunk_score: str = "l1",
        csc_scope: str = "slice",
        timeout: float | timedelta | None = None,
        check_consistency: bool = False,
        check_finite: bool = False,
        trace_path: str | None = None,
        trace_steps: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        settings = resolve_ddp_args(
            module, device_ids=device_ids, output_device=output_device, broadcast_buffers=broadcast_buffers,
            forward_sync_buffers=forward_sync_buffers, init_sync=init_sync, process_group=process_group,
            device_mesh=device_mesh, bucket_cap_mb=bucket_cap_mb, fusion_threshold_mb=fusion_threshold_mb,
            bucket_cap_mb_list=bucket_cap_mb_list, static_graph=static_graph,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
        )
        self.config = GradientFlowConfig(
            fusion_threshold_mb=settings.fusion_threshold_mb,
            broadcast_buffers=settings.forward_sync_buffers,
            comm_dtype=comm_dtype,
            algorithm=algorithm,
            density=density,
            chunk_size=chunk_size,
            warmup_steps=warmup_steps,
            momentum=momentum,
            dense_1d=dense_1d,
            chunk_score=chunk_score,
            csc_scope=csc_scope,
            timeout=timeout,
            check_consistency=check_consistency,
            check_finite=check_finite,
            trace_path=trace_path,
            trace_steps=trace_steps,
        )
        # torch DDP's public attributes, same names and meaning.
        self.module = module
        self.device_ids = list(device_ids) if device_ids else None
        self.output_device = output_device if output_device is not None or not device_ids else device_ids[0]
        self.dim = dim
        self.forward_sync_buffers = settings.forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = settings.static_graph
        self.require_backward_grad_sync = True  # False inside no_sync(), as in DDP
        self._gf_device = settings.device
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        check_no_sparse_gradients(module, ignored)
        self._gf_ignored = ignored
        self._gf_attach_group(settings.process_group)
        group = self.process_group
        self._gf_collect_tensors()
        if not self._gf_params:
            raise ValueError(
                "gradientflow.DistributedDataParallel: the module has no parameter that requires a gradient, so "
                "there is nothing to synchronise (torch DDP refuses it too). Wrap the trainable model."
            )
        self.config = self.config.resolved(sum(p.numel() for p in self._gf_params), self._gf_params[0].device)
        # One exchange compares the options that must agree and the models (even with init_sync=False:
        # a mismatch there is a hang or a silently wrong model later).
        named = [(n, p) for n, p in module.named_parameters() if n not in ignored]
        signature = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        signature += [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers() if n not in ignored]
        check_same_setup(self.config, signature, group, self._gf_watchdog, self._gf_params[0].device)
        if settings.init_sync:
            states = [p for _, p in named] + (self._gf_module_buffers if settings.init_sync_buffers else [])
            with torch.no_grad():
                _broadcast_coalesced(states, self._gf_src, group, self._gf_watchdog, "parameter broadcast")
        self._gf_build_engine(order=None)

    # ---- construction (also after unpickling or a change of device/dtype) -----------------
    def _gf_attach_group(self, group: dist.ProcessGroup) -> None:
        self.process_group = group
        self._gf_watchdog = Watchdog(group, resolve_timeout(self.config.timeout, group))
        self._gf_world_size = dist.get_world_size(group)
        self._gf_src = dist.get_global_rank(group, 0)

    def _gf_control_group(self) -> dist.ProcessGroup:
        """A second group over the same ranks for CSC's score exchanges (created once per wrapper).

        On one group, a backend runs collectives one after another: a few-KB score allreduce
        would queue behind the previous slice's megabytes of chunks, and backward would stall
        waiting for it.  Only the group's members take part in creating it.  Held by weak
        reference: torch's registry owns it, so ``destroy_process_group()`` really frees it (a
        group kept alive past that by a stray reference is torn down at interpreter exit, where
        Gloo can abort the process).
        """
        ref = self.__dict__.get("_gf_control")
        control = ref() if ref is not None else None
        if control is None:
            ranks = dist.get_process_group_ranks(self.process_group)
            control = dist.new_group(ranks, timeout=self._gf_watchdog.timeout, use_local_synchronization=True)
            self._gf_control = weakref.ref(control)
        return control

    def _gf_collect_tensors(self) -> None:
        named = [(n, p) for n, p in self.module.named_parameters() if n not in self._gf_ignored]
        self._gf_names = [n for n, p in named if p.requires_grad]
        self._gf_params = [p for _, p in named if p.requires_grad]
        self._gf_frozen = [(n, p) for n, p in named if not p.requires_grad and p.is_floating_point()]
        self._gf_module_buffers = [b for n, b in self.module.named_buffers() if n not in self._gf_ignored]

    def _gf_build_engine(self, order: list[int] | None) -> None:
        """Pool, strategy and hooks for the current parameters (``order``: a saved layout order)."""
        n = len(self._gf_params)
        self._gf_dense_bytes = 4 * sum(p.numel() for p in self._gf_params)
        order = order if order is not None else list(reversed(range(n)))  # backward ~ reverse registration
        self._gf_install(self._gf_plan(order))
        self._gf_layout_final = False
        wire = self.config.wire_dtype
        group, world = self.process_group, self._gf_world_size
        dense = DenseSync(group=group, world_size=world, wire_dtype=wire, algorithm=self.config.algorithm,
                          watchdog=self._gf_watchdog)
        self._gf_sync: SyncStrategy = dense
        if self.config.sparse:
            from .csc import SparseSync  # noqa: PLC0415 — only sparse runs need it

            self._gf_sync = SparseSync(self._gf_pool, dense, config=self.config,
                                       shapes=[p.shape for p in self._gf_params],
                                       control_group=self._gf_control_group())
        self._gf_hooks = [p.register_post_accumulate_grad_hook(self._gf_make_hook(i))
                          for i, p in enumerate(self._gf_params)]
        self._gf_sync_this_backward = True
        self._gf_bind_pending = False
        self._gf_unbound = False  # this backward left .grad None: each gradient is copied in at its hook
        self._gf_backward: _Backward | None = None
        self._gf_last_stats = StepStats(dense_bytes=self._gf_dense_bytes)
        self._gf_fresh = bytearray(n)  # 1: .grad was None when bound, and no backward has produced it since
        self._gf_used = bytearray(n)   # 1: a backward on this rank produced the gradient since the last sync
        self._gf_static_unused: list[int] | None = None
        self._gf_result_versions: tuple[int, ...] | None = None
        cfg, device = self.config, self._gf_params[0].device
        self._gf_step_check = StepCheck(self._gf_watchdog, device) if cfg.check_consistency else None
        self._gf_finite_check = FiniteCheck(self._gf_watchdog, self._gf_names, device) if cfg.check_finite else None
        self._gf_trace = (TraceRecorder(cfg.trace_path, cfg.trace_window, dist.get_rank(group), world)
                          if cfg.trace_path is not None else None)
        self._gf_watchdog.trace = self._gf_trace
        if getattr(self, "_gf_scaler", None) is not None:  # a rebuild (after .to()) keeps the registration
            self.register_grad_scaler(self._gf_scaler)
        self._gf_watch_optimizers()

    def _gf_watch_optimizers(self) -> None:
        """CSC: run :meth:`check_optimizer` on every optimizer that steps this model's parameters, at its
        first ``step()``, so the measured pitfalls are reported without the user knowing the method.

        One global optimizer step pre-hook (torch's), holding the wrapper weakly and removed with it;
        after an optimizer's first step it costs one WeakSet lookup per step.
        """
        old = self.__dict__.get("_gf_optimizer_hook")
        if old is not None:
            old.remove()
        self._gf_optimizer_hook = None
        self._gf_checked_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        if not self.config.sparse:
            return  # check_optimizer has nothing to say about dense synchronisation
        me = weakref.ref(self)

        def first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            model = me()
            if model is None or optimizer in model._gf_checked_optimizers:
                return
            model._gf_checked_optimizers.add(optimizer)
            own = {id(p) for p in model._gf_params}
            if any(id(p) in own for group in optimizer.param_groups for p in group["params"]):
                model._gf_sync.check_optimizer(optimizer, stacklevel=4)  # the user's optimizer.step() line

        handle = register_optimizer_step_pre_hook(first_step)
        weakref.finalize(self, handle.remove)
        self._gf_optimizer_hook = handle

    # ---- layout -------------------------------------------------------------------------
    def _gf_numels(self) -> list[int]:
        return [p.numel() for p in self._gf_params]

    def _gf_keys(self) -> list[tuple[torch.dtype, torch.device]]:
        return [(p.dtype, p.device) for p in self._gf_params]

    def _gf_install(self, layout: Layout) -> None:
        """Allocate the pool for ``layout``; gradients that exist move into it, ``None`` stays ``None``."""
        pool = GradPool(layout, self._gf_params, pad_to=self.config.chunk_size if self.config.sparse else 1)
        with torch.no_grad():
            for p, view in zip(self._gf_params, pool.views):
                if p.grad is not None:
                    view.copy_(p.grad)
                    p.grad = view
        self._gf_pool = pool
        self._gf_bound = pool.views  # where .grad points (the pool, or a strategy's targets mid-backward)
        self._gf_bucket_of = [0] * len(self._gf_params)
        for b in layout.buckets:
            for i in b.params:
                self._gf_bucket_of[i] = b.index

    def _gf_relayout_from_observed(self, observed: list[int]) -> None:
        """Adopt rank 0's observed backward order (unseen parameters keep their relative order)."""
        seen = set(observed)
        order = observed + [i for i in self._gf_pool.layout.order if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=self._gf_params[0].device)
        work = dist.broadcast(order_t, src=self._gf_src, group=self.process_group, async_op=True)
        self._gf_watchdog.wait(work, "layout broadcast", order_t.numel() * 8)
        order = order_t.tolist()
        self._gf_layout_final = True
        if self._gf_adopt_order(order):
            logger.debug("gradientflow: gradient pool re-laid in observed backward order")

    def _gf_plan(self, order: list[int]) -> Layout:
        """The layout for a backward ``order`` (CSC with ``dense_1d``: 1-D parameters last)."""
        if self.config.sparse and self.config.dense_1d:
            order = small_last(order, [p.dim() <= 1 for p in self._gf_params])
        # CSC slices: what the last bucket holds is scored, exchanged and sent only after backward
        tail = self.config.threshold_bytes / 8 if self.config.sparse and self.config.csc_scope == "slice" else None
        return plan_layout(self._gf_numels(), self._gf_keys(), order, self.config.threshold_bytes, tail)

    def _gf_adopt_order(self, order: list[int]) -> bool:
        """Re-lay the pool out for ``order``; False (nothing done) if the layout would not change."""
        old, layout = self._gf_pool, self._gf_plan(order)
        if layout.order == old.layout.order:
            return False
        self._gf_install(layout)
        self._gf_sync.relayout(old.layout, self._gf_pool)
        return True

    def _gf_bind_grads(self, sync: bool) -> None:
        """Point every ``.grad`` where this backward accumulates; a ``None`` grad starts from zero (fresh).

        No sync: the pool's views.  A synchronised backward: wherever the strategy asks
        (:meth:`SyncStrategy.begin_backward`; CSC: its residual, which needs no zeroing), else the pool.
        A synchronised dense backward from ``None`` gradients (``zero_grad()``'s default) binds
        nothing: autograd keeps each fresh gradient and the parameter's hook copies it into the pool
        (:meth:`_gf_adopt_grad`), one pass where zeroing the pool and letting autograd add into it
        takes two (AlexNet, one thread, measured once: backward 176 ms against 201).  A parameter that got no
        gradient is zeroed when its bucket is launched (:meth:`_gf_launch`).
        """
        pool_views, fresh = self._gf_pool.views, self._gf_fresh
        targets = self._gf_sync.begin_backward() if sync else None
        views = self._gf_bound = targets if targets is not None else pool_views
        params = self._gf_params
        self._gf_bind_pending = False
        with torch.no_grad():
            if all(p.grad is None for p in params):
                fresh[:] = b"\x01" * len(params)
                if targets is None and sync:
                    self._gf_unbound = True
                    return
                if targets is None:
                    for buf in self._gf_pool.buffers:
                        buf.zero_()
                else:
                    for view, pv in zip(views, pool_views):
                        if view is pv:
                            view.zero_()
                for p, view in zip(params, views):
                    p.grad = view
                return
            self._gf_check_result_consumed()
            for i, (p, view) in enumerate(zip(params, views)):
                if p.grad is None:
                    if view is pool_views[i]:
                        view.zero_()
                    fresh[i] = 1
                    p.grad = view
                elif view is not pool_views[i]:  # an accumulated gradient (no_sync) joins the target
                    view.add_(p.grad)
                    p.grad = view
                else:
                    self._gf_adopt_grad(i, p)

    def _gf_rebind_to_pool(self) -> None:
        """After a step that accumulated outside the pool: ``.grad`` shows the pool (the result) again."""
        pool_views = self._gf_pool.views
        if self._gf_bound is pool_views:
            return
        self._gf_bound = pool_views
        for p, view in zip(self._gf_params, pool_views):
            if p.grad is not None:
                p.grad = view

    def _gf_check_result_consumed(self) -> None:
        """CSC: refuse to fold last step's synchronised result into this step's residual.

        After a CSC step ``.grad`` holds what was sent; a second synchronised backward before
        ``zero_grad()`` would add it to the residual again (sent twice).  The pool's version
        counter (bumped by any in-place write, e.g. ``zero_grad(set_to_none=False)``) tells
        whether the user touched ``.grad`` since — no pass over the pool needed.
        """
        versions = self._gf_result_versions
        if versions is not None and versions == self._gf_pool_versions():
            self._gf_result_versions = None
            raise RuntimeError(
                "gradientflow: a second synchronised backward started while .grad still holds the previous "
                "step's sparse (density) result. Call optimizer.zero_grad() between steps, or accumulate "
                "micro-batches inside model.no_sync() and synchronise once."
            )

    def _gf_pool_versions(self) -> tuple[int, ...]:
        return tuple(b._version for b in self._gf_pool.buffers)

    # ---- forward ------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        tr = self._gf_trace
        t_fwd = time.perf_counter() if tr is not None and tr.active else None
        if sync:
            self._gf_before_sync_forward()
        if self._gf_device is not None:
            inputs, kwargs = move_to_device(inputs, self._gf_device), move_to_device(kwargs, self._gf_device)
        out = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():
            self._gf_after_forward(out, sync)
        if t_fwd is not None:
            tr.complete("forward", "forward", t_fwd, time.perf_counter())
        return out

    @torch.compiler.disable
    def _gf_before_sync_forward(self) -> None:
        for name, p in self._gf_frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"gradientflow: parameter '{name}' had requires_grad=False when the model was wrapped and "
                    "requires grad now; its gradient would never be synchronised. Set requires_grad before "
                    "wrapping (toggling it off and on again later is fine), or wrap the model anew."
                )
        if self._join_config.enable:
            Join.notify_join_context(self)
        if self._gf_syncs_buffers():
            self._gf_broadcast_buffers(active=True)

    def _gf_syncs_buffers(self) -> bool:
        return self.forward_sync_buffers and bool(self._gf_module_buffers) and self._gf_world_size > 1

    @torch.compiler.disable
    def _gf_after_forward(self, out: Any, sync: bool) -> None:
        # The hook on the outputs starts the backward: it binds .grad to the pool before any
        # gradient is accumulated and, when synchronising, makes a rank whose loss uses no
        # parameter still join the collectives.
        self._gf_sync_this_backward = sync
        self._gf_bind_pending = True
        if self._gf_step_check is not None:
            self._gf_step_check.passes += 1
        for t in iter_tensors(out):
            if t.requires_grad:
                t.register_hook(self._gf_output_grad_hook)

    def _gf_broadcast_buffers(self, active: bool) -> None:
        """Buffers from rank 0 (under ``Join``: from the highest rank still training)."""
        src = self._gf_src
        if self._join_config.enable:
            src = common_rank(self.process_group, self.join_device, self._gf_watchdog, candidate=active)
        with torch.no_grad():
            _broadcast_coalesced(self._gf_module_buffers, src, self.process_group, self._gf_watchdog,
                                 "buffer broadcast")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside the context synchronises them."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ---- backward -----------------------------------------------------------------------
    def _gf_begin_backward(self) -> _Backward:
        bw = self._gf_backward
        if bw is None:
            tr = self._gf_trace
            t_start = time.perf_counter() if tr is not None and tr.active else 0.0
            if self._gf_step_check is not None:  # before any bucket: matched with the others' check
                self._gf_step_check.start(self._gf_pool.layout)
            self._gf_bind_grads(sync=True)
            bw = self._gf_backward = _Backward(self._gf_pool.layout, len(self._gf_params), self._gf_dense_bytes)
            bw.t_start = t_start
            torch.autograd.Variable._execution_engine.queue_callback(self._gf_finish_backward)
        return bw

    def _gf_output_grad_hook(self, grad: torch.Tensor) -> None:
        if self._gf_sync_this_backward:
            self._gf_begin_backward()
        elif self._gf_bind_pending:
            self._gf_bind_grads(sync=False)

    def _gf_make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            self._gf_fresh[i] = 0
            self._gf_used[i] = 1
            if self._gf_backward is None and not self._gf_sync_this_backward:
                self._gf_adopt_grad(i, param)  # no_sync: the gradient just accumulates in the pool
                return
            self._gf_grad_ready(i, param)

        return hook

    def _gf_adopt_grad(self, i: int, param: torch.Tensor) -> None:
        """A gradient autograd created outside the bound tensor (no bind happened first) moves into it."""
        view = self._gf_bound[i]
        g = param.grad
        if g is view:
            return
        if g.is_sparse:
            raise RuntimeError(
                f"gradientflow: parameter '{self._gf_names[i]}' received a sparse gradient, which gradientflow "
                "does not synchronise; use a dense gradient (e.g. sparse=False in F.embedding)."
            )
        with torch.no_grad():
            if g.data_ptr() != view.data_ptr():
                view.copy_(g)
        param.grad = view

    def _gf_grad_ready(self, i: int, param: torch.Tensor) -> None:
        bw = self._gf_begin_backward()
        if bw.seen[i]:
            raise RuntimeError(
                f"gradientflow: parameter '{self._gf_names[i]}' produced a gradient twice in one backward "
                "(a second backward through the same graph inside one step, or a parameter reused across "
                "reentrant checkpoints). Synchronise once per backward, or use no_sync() for the extra passes."
            )
        bw.seen[i] = 1
        bw.order.append(i)
        self._gf_adopt_grad(i, param)
        b = self._gf_bucket_of[i]
        bw.remaining[b] -= 1
        buckets = self._gf_pool.layout.buckets
        while bw.next_bucket < len(buckets) and bw.remaining[bw.next_bucket] == 0:
            self._gf_launch(bw, bw.next_bucket)
        self._gf_sync.progress(bw.stats)

    def _gf_launch(self, bw: _Backward, index: int) -> None:
        bucket = self._gf_pool.layout.buckets[index]
        flat = self._gf_pool.bucket_view(bucket)
        if self._gf_unbound and bw.remaining[index]:  # some gradients never came: zeros, as a bound pool holds
            with torch.no_grad():
                for i in bucket.params:
                    p = self._gf_params[i]
                    if p.grad is None:
                        self._gf_bound[i].zero_()
                        p.grad = self._gf_bound[i]
        if self._gf_finite_check is not None:  # before the wire overwrites the local gradient
            self._gf_finite_check.screen(bucket, self._gf_sync.gradient_slice(bucket, flat), self._gf_bound)
        tr = self._gf_trace
        if tr is not None and tr.active:
            with tr.span(f"launch bucket {index}", "launch", bytes=flat.numel() * flat.element_size()):
                self._gf_sync.launch(bucket, flat, bw.stats)
        else:
            self._gf_sync.launch(bucket, flat, bw.stats)
        bw.next_bucket = index + 1

    def _gf_finish_backward(self) -> None:
        bw = self._gf_backward
        if bw is None:
            return
        tr = self._gf_trace
        t_final = time.perf_counter() if tr is not None and tr.active else None
        if t_final is not None:
            tr.complete("backward", "backward", bw.t_start, t_final)
        try:
            t0 = time.perf_counter()
            while bw.next_bucket < len(self._gf_pool.layout.buckets):
                self._gf_launch(bw, bw.next_bucket)
            used = self._gf_start_used_exchange(bw.stats)
            mismatch = self._gf_step_check.verify() if self._gf_step_check is not None else None
            self._gf_sync.finish(bw.stats)  # also on a mismatch: every rank has the same verdict
            self._gf_rebind_to_pool()
            self._gf_release_unused(used)
            if mismatch is not None:
                raise mismatch
            bw.stats.exposed_seconds = time.perf_counter() - t0
            bw.stats.close()
        finally:
            self._gf_rebind_to_pool()  # no-op after a clean finish; after an error, .grad leaves the residual
            self._gf_backward = None
            self._gf_unbound = False
            self._gf_used = bytearray(len(self._gf_params))
            self._gf_fresh = bytearray(len(self._gf_params))
        self._gf_last_stats = bw.stats
        if not self._gf_layout_final:
            self._gf_relayout_from_observed(bw.order)
        if self.config.sparse:
            self._gf_result_versions = self._gf_pool_versions()
        if t_final is not None:
            tr.complete("final wait", "final", t_final, time.perf_counter())
        self._gf_end_step()

    def _gf_end_step(self) -> None:
        """The check_finite verdict on this step, then count it (messages, trace window)."""
        try:
            if self._gf_finite_check is not None:
                self._gf_finite_check.decide()
        finally:
            self._gf_watchdog.step += 1
            if self._gf_trace is not None:
                self._gf_trace.set_step(self._gf_watchdog.step)  # writes the file after a traced step

    def _gf_start_used_exchange(self, stats: StepStats) -> tuple[dist.Work, torch.Tensor] | None:
        """Start the MAX allreduce of "this rank produced parameter i's gradient" (1 byte each).

        Skipped under ``static_graph=True`` once the first step has told which parameters are unused.
        """
        if self._gf_static_unused is not None:
            return None
        flags = torch.frombuffer(bytearray(self._gf_used), dtype=torch.uint8)
        flags = flags.to(self._gf_params[0].device)
        stats.control_bytes += flags.numel()
        # CSC sends chunks at launches that may differ between ranks (see csc.py): only the
        # control group has a fixed order of collectives at this point.
        group = self._gf_control_group() if self.config.sparse else self.process_group
        return dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True), flags

    def _gf_release_unused(self, used: tuple[dist.Work, torch.Tensor] | None) -> None:
        """Give ``.grad = None`` back to parameters no rank used whose ``.grad`` was ``None``."""
        if used is not None:
            work, flags = used
            self._gf_watchdog.wait(work, "used-parameter flags", flags.numel())
            fresh = self._gf_fresh
            if not any(fresh) and not self.static_graph:
                return  # every gradient was produced (or already existed) here: nothing to read
            global_used = flags.tolist()
            unused = [i for i, u in enumerate(global_used) if not u]
            if self.static_graph:
                self._gf_static_unused = unused
        else:
            unused = self._gf_static_unused or []
        candidates = [i for i in unused if self._gf_fresh[i]]
        if candidates:
            for i in self._gf_sync.untouched(candidates):
                self._gf_params[i].grad = None

    # ---- uneven inputs (torch Join) ---------------------------------------------------------
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """``with model.join(): ...`` — ranks with fewer batches shadow the others until all are done.

        Gradients are averaged over the initial world size (joined ranks contribute zero), DDP's
        default; ``divide_by_initial_world_size=False`` is not supported.
        """
        if not divide_by_initial_world_size:
            raise ValueError(
                "join(divide_by_initial_world_size=False) is not supported: gradientflow divides by the initial "
                "world size (joined ranks contribute zero). Scale the learning rate if you need the other mean."
            )
        return Join([self], enable, throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return GradientFlowJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._gf_params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _gf_shadow_step(self) -> None:
        """One synchronised step with a zero local gradient (a joined rank's share of an iteration)."""
        with torch.no_grad():
            for p in self._gf_params:
                p.grad = None
            self._gf_bind_grads(sync=True)
            if self._gf_step_check is not None:  # a joined rank's counts must not weigh in
                self._gf_step_check.start_neutral()
            self._gf_backward = _Backward(self._gf_pool.layout, len(self._gf_params), self._gf_dense_bytes)
            self._gf_finish_backward()

    def _gf_sync_final_model(self, is_last_joiner: bool) -> None:
        src = common_rank(self.process_group, self.join_device, self._gf_watchdog, candidate=is_last_joiner)
        states = [p for n, p in self.module.named_parameters() if n not in self._gf_ignored]
        with torch.no_grad():
            _broadcast_coalesced(states + self._gf_module_buffers, src, self.process_group, self._gf_watchdog,
                                 "final model broadcast")
        check = self._gf_step_check
        if check is not None:  # joined ranks ran fewer forward passes: agree on the count again
            check.passes = max_over_ranks(check.passes, self.process_group, self.join_device, self._gf_watchdog,
                                          "join: pass count")

    # ---- torch DDP methods we do not implement -------------------------------------------
    def register_comm_hook(self, state: object, hook: Any) -> None:
        """Not supported: gradientflow's options replace the common hooks."""
        raise NotImplementedError(
            "gradientflow does not run DDP communication hooks; its options cover the common ones: "
            "fp16_compress_hook -> comm_dtype='fp16', bf16_compress_hook -> comm_dtype='bf16', PowerSGD -> "
            "density=0.1 (coarse-grained sparse communication), allreduce_hook -> the default."
        )

    # ---- torch DDP properties -------------------------------------------------------------
    @property
    def broadcast_buffers(self) -> bool:
        """Deprecated alias of ``forward_sync_buffers`` (as in torch 2.13 DDP)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # ---- nn.Module plumbing: device/dtype changes, copies, pickling ------------------------
    def _apply(self, fn: Any, recurse: bool = True) -> DistributedDataParallel:
        super()._apply(fn, recurse)
        if "_gf_pool" not in self.__dict__:
            return self  # during __init__
        layout = self._gf_pool.layout
        self._gf_collect_tensors()
        if self._gf_keys() != [layout.keys[s.pool] for s in layout.slots]:
            if self._gf_sync.has_state():
                raise ValueError(
                    "gradientflow: the model's device or dtype changed after sparse (density) residuals were "
                    "created. Move the model before the first step, or save comm_state_dict(), rebuild the "
                    "wrapper on the new device and load it."
                )
            for h in self._gf_hooks:
                h.remove()
            order = list(self._gf_pool.layout.order)
            final = self._gf_layout_final
            self._gf_build_engine(order)
            self._gf_layout_final = final
        return self

    def __getstate__(self) -> dict[str, Any]:
        """As torch DDP: the process group and the engine are not pickled (rebuilt on load)."""
        default = dist.distributed_c10d._get_default_group()
        if self.process_group is not dist.group.WORLD and self.process_group != default:
            raise ValueError(
                "gradientflow: pickling/deepcopy is only supported with the default process group (as torch DDP)"
            )
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_gf_") or k in _PICKLED}
        state.pop("process_group", None)
        state["_gf_comm_state"] = self.comm_state_dict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        comm = state.pop("_gf_comm_state")
        self.__dict__.update(state)
        self._gf_attach_group(dist.group.WORLD)
        self._gf_collect_tensors()
        self._gf_build_engine(order=comm.get("layout_order"))
        self.load_comm_state_dict(comm)

    # ---- state of the communication (CSC residuals) ---------------------------------------
    def comm_state_dict(self) -> dict[str, Any]:
        """Communication state (CSC residuals u, v and step counter) to checkpoint with the model.

        Per rank: residuals differ between ranks, so every rank saves its own.  Plain Python
        values and tensors only, so ``torch.load(..., weights_only=True)`` reads it.
        """
        state = dict(self._gf_sync.state_dict())
        # Residuals and CSC chunks live in the pool layout: a resumed run must use the same one.
        state["layout_order"] = list(self._gf_pool.layout.order)
        state["layout_final"] = self._gf_layout_final
        state["world_size"] = self._gf_world_size
        return state

    def load_comm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`comm_state_dict` returned (same model, options and world size).

        Everything is checked first: a state from another model, world size or chunk size, or a
        truncated one, raises ``ValueError`` and leaves this model as it was.
        """
        state = dict(state)
        order = state.pop("layout_order", None)
        final = bool(state.pop("layout_final", False))
        world = state.pop("world_size", self._gf_world_size)
        if world != self._gf_world_size:
            raise ValueError(
                f"gradientflow: the communication state was saved with world size {world}, this job has "
                f"{self._gf_world_size}; residuals are per rank and cannot be re-split. Resume with the same "
                "world size, or start the communication state afresh (skip load_comm_state_dict)."
            )
        if order is not None and sorted(order) != list(range(len(self._gf_params))):
            raise ValueError(
                f"gradientflow: the communication state's layout covers {len(order)} parameters, this model "
                f"has {len(self._gf_params)}: load it into the model it was saved from."
            )
        self._gf_sync.validate_state_dict(state)
        if order is not None and tuple(order) != self._gf_pool.layout.order:
            self._gf_adopt_order(list(order))
        self._gf_sync.load_state_dict(state)
        if final:
            self._gf_layout_final = True

    def register_grad_scaler(self, scaler: Any) -> None:
        """Tell CSC about the ``torch.amp.GradScaler`` in use (residuals are kept unscaled).

        Without it CSC assumes a loss scale of 1.  Dense communication does not need it.
        """
        self._gf_scaler = scaler
        self._gf_sync.register_grad_scaler(scaler)
        if self._gf_finite_check is not None:  # overflow is now the scaler's to skip, not an error
            self._gf_finite_check.scaler_registered = True

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn if CSC momentum correction is on and ``optimizer`` applies momentum too, or if an
        Adam-type optimizer meets a CSC density below ``csc.ADAPTIVE_MIN_DENSITY`` (measured to lose quality).

        Runs by itself at the first ``step()`` of every optimizer holding this model's parameters;
        calling it first (to see the warnings before training) keeps that from repeating them."""
        self._gf_checked_optimizers.add(optimizer)
        self._gf_sync.check_optimizer(optimizer)

    # ---- introspection ------------------------------------------------------------------
    def comm_stats(self) -> dict[str, float | int]:
        """Counters of the last completed synchronised step (see :class:`StepStats`)."""
        return self._gf_last_stats.as_dict()

    @property
    def pool(self) -> GradPool:
        """The gradient pool (its ``layout`` and flat ``buffers``); read-only."""
        return self._gf_pool


# Engine attributes that are plain settings and survive pickling; the rest is rebuilt.
_PICKLED = {"_gf_device", "_gf_ignored"}
