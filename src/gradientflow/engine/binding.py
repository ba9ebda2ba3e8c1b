"""Where ``.grad`` points during a reducer's steps: the pool's views, or a strategy's targets.

A part the :class:`gradientflow.engine.reducer.Reducer` holds (``reducer.binding``): step 1 of the
reducer's algorithm.  When a synchronised backward starts every ``.grad`` is bound to where this backward
accumulates (the pool, or CSC's residual), unless the backward starts from ``None`` gradients
(then each fresh gradient is copied, or for CSC added, in at its hook); after the step ``.grad`` shows
the pool again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from .pool import GradPool

if TYPE_CHECKING:
    from .layout import PoolLayout
    from .protocol import SyncStrategy
    from .usage import ParamUsage


class GradBinding:
    """Where each ``.grad`` of the reducer's parameters points (``bound``), and CSC's check that a step's result
    was consumed before the next synchronised backward.  ``layout``: the reducer's pool (re-laid over its life);
    ``usage``: the per-parameter marks it shares with the reducer's hooks (``fresh``)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        layout: PoolLayout,
        sync: SyncStrategy,
        usage: ParamUsage,
    ) -> None:
        self.params, self.names, self.layout, self.sync, self.usage = params, names, layout, sync, usage
        self.bound: list[torch.Tensor] = layout.pool.views  # the pool's views, or a strategy's targets mid-backward
        self.result_versions: tuple[int, ...] | None = None  # CSC: the pool's versions when a step's result was left

    @property
    def pool(self) -> GradPool:
        return self.layout.pool

    def bind_grads(self, sync: bool) -> tuple[bool, bytearray | None]:
        """Point every ``.grad`` where this backward accumulates; a ``None`` grad starts from zero (fresh).

        No sync: the pool's views.  A synchronised backward: wherever the strategy asks
        (:meth:`SyncStrategy.begin_backward`; CSC: its residual, which needs no zeroing), else the pool.
        A synchronised backward from ``None`` gradients (``zero_grad()``'s default) binds
        nothing: autograd keeps each fresh gradient and the parameter's hook copies it into the pool
        (:meth:`Reducer._param_ready`), one pass over memory where zeroing the pool and letting autograd add
        into it takes two; the copy also
        divides by the world size, which the launch would otherwise spend a pass on.  A gradient
        whose target is the strategy's (CSC's residual) is added into it there instead
        (``fresh_add``), the same pass autograd's accumulation into a bound ``.grad`` costs, but
        autograd's tensor lives on until the next forward instead of being freed mid-backward.  A
        pool view that got no gradient is zeroed when its bucket is launched (:meth:`Reducer._launch`); a
        strategy's target is left as it is (nothing accumulated into it).

        Returns this backward's ``unbound`` (nothing was bound: each gradient is copied in at its hook) and
        ``fresh_add`` (unbound: 1 where the gradient is added into a strategy's target), for its
        :class:`~gradientflow.engine.backward.Backward` record.
        """
        pool_views, fresh = self.pool.views, self.usage.fresh
        targets = self.sync.begin_backward() if sync else None
        views = self.bound = targets if targets is not None else pool_views
        params = self.params
        if sync and all(p.grad is None for p in params):
            fresh[:] = b"\x01" * len(params)  # the common step (after zero_grad()): nothing to bind
            # Where a strategy's target is not the pool (CSC's residual), the fresh gradient is added into it
            # at its hook, as autograd would have added it into a bound .grad (see Reducer.held for why not).
            return True, None if targets is None else bytearray(v is not pv for v, pv in zip(views, pool_views))
        with torch.no_grad():
            if all(p.grad is None for p in params):
                fresh[:] = b"\x01" * len(params)
                if targets is None:
                    for buf in self.pool.buffers:
                        buf.zero_()
                else:
                    for view, pv in zip(views, pool_views):
                        if view is pv:
                            view.zero_()
                for p, view in zip(params, views):
                    p.grad = view
                return False, None
            self._check_result_consumed()
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
                    self.adopt_grad(i, p)
        return False, None

    def rebind_to_pool(self) -> None:
        """After a step that accumulated outside the pool, or a re-layout: ``.grad`` shows the pool again."""
        pool_views = self.pool.views
        if self.bound is pool_views:
            return
        self.bound = pool_views
        for p, view in zip(self.params, pool_views):
            if p.grad is not None:
                p.grad = view

    def _check_result_consumed(self) -> None:
        """CSC: refuse to fold last step's synchronised result into this step's residual.

        After a CSC step ``.grad`` holds what was sent; a second synchronised backward before
        ``zero_grad()`` would add it to the residual again (sent twice).  The pool's version
        counter (bumped by any in-place write, e.g. ``zero_grad(set_to_none=False)``) tells
        whether the user touched ``.grad`` since — no pass over the pool needed.
        """
        versions = self.result_versions
        if versions is not None and versions == self._pool_versions():
            self.result_versions = None
            raise RuntimeError(
                "gradientflow: a second synchronised backward started while .grad still holds the previous "
                "step's sparse (density) result. Call optimizer.zero_grad() between steps, or accumulate "
                "micro-batches inside model.no_sync() and synchronise once."
            )

    def remember_result(self) -> None:
        """CSC: a step's result is in ``.grad`` now (see :meth:`_check_result_consumed`)."""
        self.result_versions = self._pool_versions()

    def _pool_versions(self) -> tuple[int, ...]:
        return tuple(b._version for b in self.pool.buffers)

    def adopt_grad(self, i: int, param: torch.Tensor) -> None:
        """A gradient autograd created outside the bound tensor (no bind happened first) moves into it."""
        view = self.bound[i]
        g = cast(torch.Tensor, param.grad)  # set: from its post-accumulate hook, or a caller that found it set
        if g is view:
            return
        if g.is_sparse:
            raise RuntimeError(
                f"gradientflow: parameter '{self.names[i]}' received a sparse gradient, which gradientflow "
                "does not synchronise; use a dense gradient (e.g. sparse=False in F.embedding)."
            )
        with torch.no_grad():
            if g.data_ptr() != view.data_ptr():
                view.copy_(g)
        param.grad = view
