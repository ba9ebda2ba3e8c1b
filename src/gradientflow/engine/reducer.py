"""The reducer: what happens during and right after a synchronised backward.

:class:`gradientflow.DistributedDataParallel` is the ``nn.Module`` face (arguments, forward,
buffers, ``Join``, checkpoints); this is its engine, torch DDP's ``Reducer`` in spirit.  It
owns the gradient pool and the strategy and decides *when* buckets go on the wire; the strategy
(:mod:`gradientflow.engine.protocol`) decides *what*.  Per synchronised backward:

  1. When backward starts (a hook on the forward's outputs) every ``.grad`` is bound to its view
     of the pool (or CSC's residual), so autograd accumulates straight into it; from ``None``
     gradients (``zero_grad()``) nothing is bound and step 2 moves each fresh gradient in.  Before
     that a ``.grad`` is whatever the user left, as in torch DDP.
  2. A post-accumulate-grad hook marks each gradient ready.  Buckets (pool slices of >= θ
     bytes, cut by :func:`pool.plan_layout`) are launched strictly in bucket order, each as
     soon as it and all earlier buckets are complete.  Launch points are therefore a function
     of the layout alone: every rank issues the same collectives in the same order, even when
     the set of used parameters differs between ranks.
  3. Autograd's final callback launches the remaining buckets, waits for all, and leaves the
     averaged gradient in the pool (= in every ``.grad``).  Parameters without gradient are torch
     DDP's rules (:class:`.usage.UnusedSearch`): searched for only with ``find_unused_parameters``;
     without it the step stays open for a further backward, or ends in torch's error at the next forward.
  4. After the first synchronised backward the pool is re-laid once in the order gradients
     were actually produced on rank 0 (broadcast, so all ranks agree), as DDP rebuilds buckets.

Its parts, each owning its state: ``layout`` (:class:`.layout.PoolLayout`, step 4), ``binding``
(:class:`.binding.GradBinding`, step 1), ``unused`` (:class:`.usage.UnusedSearch`, step 3); a backward's record:
:class:`.backward.Backward`.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..config import GradientFlowConfig
from ..diagnostics.runtime_log import RuntimeLog, StepTimes
from ..diagnostics.stats import RunTotals, StepStats
from ..diagnostics.trace import TraceRecorder
from ..diagnostics.watchdog import Watchdog
from .backward import Backward as _Backward
from .binding import GradBinding
from .consistency import FiniteCheck, StepCheck
from .hooks import iter_tensors, remove_handles, weak_hook
from .layout import PoolLayout
from .pool import GradPool
from .protocol import MakeSync, SyncStrategy
from .usage import ParamUsage, UnusedSearch

logger = logging.getLogger(__name__)
_ENGINE = torch.autograd.Variable._execution_engine  # autograd's engine, for the final callback


class Reducer:
    """Pool, strategy and gradient hooks for one wrapper's parameters (rebuilt after ``.to()``).

    ``params`` / ``names``: the parameters that require a gradient and their names; ``order``: the pool's
    parameter order (a saved layout's, or ``None``: reverse registration, ~ backward); ``control``: CSC's second
    group over the same ranks (``None`` for dense); ``static_graph``: the used parameters never change;
    ``make_sync``: builds the strategy over the pool (:func:`gradientflow.strategies.build_strategy`);
    ``find_unused``: torch DDP's ``find_unused_parameters``; a rebuilt engine's ``layout_final`` and ``totals``;
    ``local_steps``: no backward is ever synchronised (``sync_every > 1`` on a flat layout, where every rank steps
    on its own gradient): no hook is put on the parameters or the outputs, and autograd's gradients stay its own
    tensors, as a plain module's (no pool zeroed and accumulated into every step: on digits_wide's 8.4M
    parameters that cost 15-20 ms of a 50 ms SGD step), and the pool holds no memory (meta tensors)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        config: GradientFlowConfig,
        group: dist.ProcessGroup,
        watchdog: Watchdog,
        control: dist.ProcessGroup | None,
        static_graph: bool,
        order: list[int] | None,
        make_sync: MakeSync,
        find_unused: bool = False,
        layout_final: bool = False,
        totals: RunTotals | None = None,
        local_steps: bool = False,
    ) -> None:
        n = len(params)
        self.local_steps = local_steps
        self.params, self.names, self.config, self.group = params, names, config, group
        self.watchdog = watchdog
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.src = dist.get_global_rank(group, 0)
        self.dense_bytes = 4 * sum(p.numel() for p in params)
        self.find_unused = find_unused
        order = order if order is not None else list(reversed(range(n)))
        self.layout = PoolLayout(params, config, order, layout_final, materialize=not local_steps)
        self.sync: SyncStrategy = make_sync(self.layout.pool, [p.shape for p in params])
        self.usage = ParamUsage(n, static_graph)
        self.binding = GradBinding(params, names, self.layout, self.sync, self.usage)
        self.unused = UnusedSearch(params, names, group, control, watchdog, self.sync, self.usage, find_unused)
        # local_steps: nothing to synchronise, ever: autograd's gradients are left where it puts them
        ready = [weak_hook(self, Reducer._param_ready, i) for i in range(n)] if not local_steps else []
        self.hooks = [p.register_post_accumulate_grad_hook(hook) for p, hook in zip(params, ready)]
        # Freed with its wrapper (the hooks hold it weakly), it takes its hooks off the parameters, so the
        # module is left as torch DDP leaves it (accelerate's free_memory(), a plain `del model`).
        weakref.finalize(self, remove_handles, self.hooks)
        self._output_hook = weak_hook(self, Reducer._output_grad_hook)  # a kept loss's graph holds it
        # What the last forward armed (per forward, before any Backward record exists):
        self.sync_this_backward = True
        self.armed_sync = False  # this forward's arm() asked for a synchronised backward
        self.bind_pending = False  # .grad is still to be bound by the first hook of the coming backward
        # The last unbound backward's fresh gradients, already in the pool (or CSC's residual), kept until the next
        # forward as torch DDP keeps `.grad`: freed mid-backward, glibc trimmed its heap top and the next step
        # faulted it back in (docs/results/benchmarks.md#figures-behind-the-codes-comments).
        self.held: list[torch.Tensor] = []
        self.backward: _Backward | None = None  # the open synchronised backward's record
        self.last_stats = StepStats(dense_bytes=self.dense_bytes)
        self.totals = totals if totals is not None else RunTotals()  # a rebuilt engine carries the run's totals
        self.after_step: Any = None  # called once after the next synchronised step (call_after_step), then dropped
        self.runtime = RuntimeLog()  # torch DDP's runtime logging fields (at synchronised forwards), last error
        self.step_times: StepTimes | None = None  # the last completed synchronised step's stamps
        self.t_forward: float | None = None
        device = params[0].device
        self.step_check = StepCheck(watchdog, device) if config.check_consistency else None
        self.finite_check = FiniteCheck(watchdog, names, device) if config.check_finite else None
        self.trace = (
            TraceRecorder(config.trace_path, config.trace_window, dist.get_rank(group), self.world_size)
            if config.trace_path is not None
            else None
        )
        watchdog.trace = self.trace

    @property
    def pool(self) -> GradPool:
        """The gradient pool (the layout's, re-laid once over the reducer's life)."""
        return self.layout.pool

    @property
    def layout_final(self) -> bool:
        """The pool follows an observed backward order (torch's ``has_rebuilt_buckets``)."""
        return self.layout.final

    def adopt_order(self, order: list[int]) -> bool:
        """Re-lay the pool out for ``order`` (``.grad`` and the strategy follow); False if nothing changed."""
        old = self.layout.adopt(order)
        if old is None:
            return False
        self.binding.rebind_to_pool()
        self.sync.relayout(old, self.layout.pool)
        return True

    def raise_pending(self) -> None:
        """At a forward with grad: the last synchronised backward's error, once (the step completed, as torch's)."""
        bw = self.backward
        if bw is not None and not bw.queued:  # a step left open for a further backward that never came
            bw.closing = True
            self.finish_backward()  # the same collectives as a rank whose backward had every gradient
        error = self.unused.take_pending()
        if error is not None:
            raise error

    def remove_hooks(self) -> None:
        """Detach from the parameters (before a rebuild replaces this reducer)."""
        for h in self.hooks:
            h.remove()

    def register_grad_scaler(self, scaler: Any) -> None:
        self.sync.register_grad_scaler(scaler)
        if self.finite_check is not None:  # overflow is now the scaler's to skip, not an error
            self.finite_check.scaler_registered = True

    def sync_next_backward(self) -> None:
        """The next backward synchronises (torch's ``reducer.prepare_for_backward``, after a ``no_sync`` forward)."""
        self.sync_this_backward = True

    def call_after_step(self, fn: Any) -> None:
        """``fn()`` once after the next synchronised step (join's rescale by the ranks still training)."""
        self.after_step = fn

    # ---- backward -----------------------------------------------------------------------
    def arm(self, out: Any, sync: bool) -> None:
        """After a forward with grad enabled: the hook on its outputs starts the backward.

        It binds ``.grad`` before any gradient is accumulated and, when synchronising, makes a
        rank whose loss uses no parameter still join the collectives.
        """
        if self.local_steps:
            return
        # Two wrappers arm one engine when a gradientflow model is nested in another (wrapper/nested.py): the
        # backward synchronises if either asks, as either of torch's two reducers would.
        self.sync_this_backward = self.armed_sync = sync or self.armed_sync
        self.bind_pending = True
        if self.step_check is not None:
            self.step_check.passes += 1
        for t in iter_tensors(out):
            if t.requires_grad:
                t.register_hook(self._output_hook)

    def forward_started(self, sync: bool) -> None:
        """At every forward: last step's fresh gradients are freed (where torch's zero_grad frees ``.grad``);
        a synchronised one samples torch's runtime logging fields and stamps the step's start."""
        self.held.clear()
        self.armed_sync = False
        if sync:
            self.runtime.at_forward(self.watchdog.step, self.step_times)
            self.t_forward = time.perf_counter()

    def _begin_backward(self) -> _Backward:
        bw = self.backward
        if bw is None:
            t_start = time.perf_counter()
            if self.step_check is not None:  # before any bucket: matched with the others' check
                self.step_check.start(self.pool.layout)
            unbound, fresh_add = self._bind(sync=True)
            bw = self.backward = _Backward(self.pool.layout, len(self.params), self.dense_bytes, unbound, fresh_add)
            bw.t_start = t_start  # before the binding: the step's time includes it
            _ENGINE.queue_callback(self.finish_backward)
        elif not bw.queued:  # a further backward of an open step: it ends at this backward's end, or stays open
            bw.queued = True
            self.unused.clear()
            _ENGINE.queue_callback(self.finish_backward)
        return bw

    def _output_grad_hook(self, grad: torch.Tensor) -> None:
        if self.sync_this_backward:
            self._begin_backward()
        elif self.bind_pending:
            self._bind(sync=False)

    def _bind(self, sync: bool) -> tuple[bool, bytearray | None]:
        self.bind_pending = False
        return self.binding.bind_grads(sync)

    def _param_ready(self, i: int, param: torch.Tensor) -> None:
        """A parameter's post-accumulate hook: step 2 for one gradient.

        The hot path of a step (once per parameter, in Python where torch DDP's reducer is C++): one frame
        with the unbound copy inlined (what the frames cost: docs/results/benchmarks.md, per-step fixed cost)."""
        g = param.grad
        if g is None:  # an undefined gradient (autograd produced none): the parameter counts as unused
            return
        usage = self.usage
        usage.fresh[i] = 0
        usage.used[i] = 1
        bw = self.backward
        if bw is None or not bw.queued:
            if bw is None and not self.sync_this_backward:
                self.binding.adopt_grad(i, param)  # no_sync: the gradient just accumulates in the pool
                return
            bw = self._begin_backward()
        if bw.seen[i]:
            raise RuntimeError(
                f"gradientflow: parameter '{self.names[i]}' produced a gradient twice in one backward "
                "(a second backward through the same graph inside one step, or a parameter reused across "
                "reentrant checkpoints). Synchronise once per backward, or use no_sync() for the extra passes."
            )
        bw.seen[i] = 1
        bw.order.append(i)
        b = self.layout.bucket_of[i]
        binding = self.binding
        if bw.unbound:
            # Autograd's fresh gradient enters the pool through the strategy, which may fold its division
            # into the copy (SyncStrategy.take_fresh).  A gradient already in its view (same memory) goes
            # through take_fresh in place: every gradient of an unbound backward takes this one path, so a
            # bucket is never half divided.
            view = binding.bound[i]
            if g.is_sparse:
                binding.adopt_grad(i, param)  # raises, naming the parameter
            src = view if g is view or g.data_ptr() == view.data_ptr() else g
            add = bw.fresh_add
            if add is not None and add[i]:  # a strategy's target (CSC's residual): what autograd's += would do
                divided = False
                if src is not view:
                    with torch.no_grad():  # create_graph=True: the sum stays out of the graph
                        self.sync.add_fresh(i, src, view)
            elif torch.is_grad_enabled():  # create_graph=True: the copy stays out of the graph
                with torch.no_grad():
                    divided = self.sync.take_fresh(src, view)
            else:
                divided = self.sync.take_fresh(src, view)
            param.grad = view
            if src is g:  # freed at the next forward, not here: see ``held``
                self.held.append(g)
            if not divided:
                bw.undivided[b] += 1
        else:  # bound: autograd added into .grad in place, or (create_graph=True) replaced it by a new tensor
            if g is not binding.bound[i]:
                binding.adopt_grad(i, param)
            bw.undivided[b] += 1
        remaining = bw.remaining
        remaining[b] -= 1
        # Only this bucket's count changed: buckets launch in order, so only the next one can become due.
        if b == bw.next_bucket and not remaining[b]:
            n = len(remaining)
            while bw.next_bucket < n and not remaining[bw.next_bucket]:
                self._launch(bw, bw.next_bucket)
        self.sync.progress(bw.stats)

    def _launch(self, bw: _Backward, index: int) -> None:
        pool = self.pool
        bucket = pool.layout.buckets[index]
        flat = pool.bucket_views[index]
        bound = self.binding.bound
        if bw.unbound and bw.remaining[index]:  # some gradients never came: zeros, as a bound pool holds
            add = bw.fresh_add
            with torch.no_grad():
                for i in bucket.params:
                    p = self.params[i]
                    if p.grad is None:
                        if add is None or not add[i]:  # a strategy's target keeps what it holds (+ 0)
                            bound[i].zero_()
                        p.grad = bound[i]
        if self.finite_check is not None:  # before the wire overwrites the local gradient
            self.finite_check.screen(bucket, self.sync.gradient_slice(bucket, flat), bound)
        divided = bw.unbound and bw.undivided[index] == 0  # the zeros filled in above divide to zeros
        tr = self.trace
        if tr is not None and tr.active:
            with tr.span(f"launch bucket {index}", "launch", bytes=flat.numel() * flat.element_size()):
                self.sync.launch(bucket, flat, bw.stats, divided)
        else:
            self.sync.launch(bucket, flat, bw.stats, divided)
        bw.next_bucket = index + 1

    def finish_backward(self) -> None:
        """Autograd's final callback (also a joined rank's shadow step): step 3, then step 4 once."""
        bw = self.backward
        if bw is None:
            return
        if self.unused.stays_open(bw):
            bw.queued = False
            return
        tr = self.trace
        t_end = time.perf_counter()
        t_final = t_end if tr is not None and tr.active else None
        if t_final is not None and tr is not None:
            tr.complete("backward", "backward", bw.t_start, t_final)
        try:
            t0 = time.perf_counter()
            while bw.next_bucket < len(bw.remaining):
                self._launch(bw, bw.next_bucket)
            used = self.unused.start_used_exchange(bw)
            mismatch = self.step_check.verify() if self.step_check is not None else None
            self.sync.finish(bw.stats)  # also on a mismatch: every rank has the same verdict
            self.binding.rebind_to_pool()
            if used is not None or self.usage.static_unused:  # else no parameter can get None back
                self.unused.release_unused(used)
            if not bw.shadow and not self.find_unused and not self.usage.static_graph and len(bw.order) < len(bw.seen):
                self.runtime.note_error(self.unused.unsearched_unused(bw))
            if mismatch is not None:
                raise mismatch
            bw.stats.exposed_seconds = time.perf_counter() - t0
            bw.stats.close()
            comm_start, comm_end = bw.stats.comm_span()
            self.step_times = StepTimes(self.t_forward, bw.t_start, t_end, comm_start, comm_end, bw.order)
        finally:
            self.binding.rebind_to_pool()  # no-op after a clean finish; after an error, .grad leaves the residual
            self.backward = None
            self.usage.reset()
        self.last_stats = bw.stats
        self.totals.add(bw.stats)
        usage = self.usage
        # also without static_graph, until a step first differs: torch's reducer._ddp_graph_static() reports it
        if bw.order and (usage.graph_static or usage.static_graph):
            error = self.usage.check_static_graph(bw.order, self.names, self.rank)
            if error is not None and usage.static_graph:
                self.runtime.note_error(error)
                raise error
        # torch DDP rebuilds its buckets in the observed order unless find_unused_parameters (the order may
        # change from step to step) without static_graph; so does the pool (has_rebuilt_buckets says which).
        if not self.layout.final and (not self.find_unused or self.usage.static_graph):
            order = self.layout.observed_order(bw.order, self.src, self.group, self.watchdog)
            if self.adopt_order(order):
                logger.debug("gradientflow: gradient pool re-laid in observed backward order")
        if self.config.sparse:
            self.binding.remember_result()
        if t_final is not None and tr is not None:
            tr.complete("final wait", "final", t_final, time.perf_counter())
        self._end_step()
        after, self.after_step = self.after_step, None
        if after is not None:
            after()

    def shadow_step(self) -> None:
        """One synchronised step with a zero local gradient (a joined rank's share of an iteration); ``.grad`` is
        left as the user left it, as under torch DDP (the first backward after ``join`` adds nothing of it)."""
        was_none = [p.grad is None for p in self.params]
        with torch.no_grad():
            for p in self.params:
                p.grad = None
            unbound, fresh_add = self._bind(sync=True)
            if self.step_check is not None:  # a joined rank's counts must not weigh in
                self.step_check.start_neutral()
            self.backward = _Backward(self.pool.layout, len(self.params), self.dense_bytes, unbound, fresh_add, True)
            self.finish_backward()
            for buf in self.pool.buffers:
                buf.zero_()
            for p, none in zip(self.params, was_none):
                if none:
                    p.grad = None

    def _end_step(self) -> None:
        """The check_finite verdict on this step, then count it (messages, trace window)."""
        try:
            if self.finite_check is not None:
                self.finite_check.decide()
        finally:
            self.watchdog.step += 1
            if self.trace is not None:
                self.trace.set_step(self.watchdog.step)  # writes the file after a traced step
