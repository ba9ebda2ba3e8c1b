"""The pool's layout over a reducer's life: allocated for a planned order, re-laid once to the observed one.

A part the :class:`gradientflow.engine.reducer.Reducer` holds (``reducer.layout``): step 4 of the reducer's
algorithm.  The first layout follows the parameters' reverse registration order (about backward's); after
the first synchronised backward the pool is re-laid in the order rank 0 observed, broadcast so every rank
agrees, as torch DDP rebuilds its buckets.  The reducer then points ``.grad`` and the strategy at the new
pool (:meth:`Reducer.adopt_order`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .pool import GradPool, Layout, plan_layout, small_last

if TYPE_CHECKING:
    from ..config import GradientFlowConfig
    from ..diagnostics.watchdog import Watchdog


class PoolLayout:
    """The gradient pool of one reducer's parameters, its buckets and whether its layout is final.

    ``order``: the first layout's parameter order; ``final``: the layout already follows an observed
    backward (a rebuilt engine keeps its predecessor's), so it is never re-laid; ``materialize=False``: the pool
    holds no memory (:class:`GradPool`) and ``.grad`` is never moved into it (an engine that never synchronises).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        config: GradientFlowConfig,
        order: list[int],
        final: bool = False,
        materialize: bool = True,
    ) -> None:
        self.params = params
        self.config = config
        self.materialize = materialize
        self.final = final  # True once the pool follows an observed backward order (torch's has_rebuilt_buckets)
        self.pool, self.bucket_of = self._allocate(self.plan(order))

    def keys(self) -> list[tuple[torch.dtype, torch.device]]:
        return [(p.dtype, p.device) for p in self.params]

    def _allocate(self, layout: Layout) -> tuple[GradPool, list[int]]:
        """The pool for ``layout`` (gradients that exist move into it, ``None`` stays ``None``) and each
        parameter's bucket index."""
        sparse = self.config.sparse
        pad = int(self.config.chunk_size) if sparse else 1
        pool = GradPool(layout, self.params, pad_to=pad, materialize=self.materialize)
        with torch.no_grad():
            for p, view in zip(self.params, pool.views):
                if p.grad is not None and self.materialize:
                    view.copy_(p.grad)
                    p.grad = view
        bucket_of = [0] * len(self.params)
        for b in layout.buckets:
            for i in b.params:
                bucket_of[i] = b.index
        return pool, bucket_of

    def plan(self, order: list[int]) -> Layout:
        """The layout for a backward ``order`` (CSC with ``dense_1d``: 1-D parameters last)."""
        cfg = self.config
        if cfg.sparse and cfg.dense_1d:
            order = small_last(order, [p.dim() <= 1 for p in self.params])
        # CSC slices: what the last bucket holds is scored, exchanged and sent only after backward
        tail = cfg.threshold_bytes / 8 if cfg.sparse and cfg.csc_scope == "slice" else None
        return plan_layout([p.numel() for p in self.params], self.keys(), order, cfg.threshold_bytes, tail)

    def adopt(self, order: list[int]) -> Layout | None:
        """Re-lay the pool out for ``order``: the old layout, or None (nothing done) if it would not change."""
        old, layout = self.pool.layout, self.plan(order)
        if layout.order == old.order:
            return None
        self.pool, self.bucket_of = self._allocate(layout)
        return old

    def mark_final(self) -> None:
        """The layout follows an observed backward (a loaded communication state's): never re-laid again."""
        self.final = True

    def observed_order(self, observed: list[int], src: int, group: dist.ProcessGroup, watchdog: Watchdog) -> list[int]:
        """Rank 0's observed backward order, broadcast (unseen parameters keep their relative order); the
        layout is final from here on."""
        seen = set(observed)
        order = observed + [i for i in self.pool.layout.order if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)
        work = dist.broadcast(order_t, src=src, group=group, async_op=True)
        watchdog.wait(work, "layout broadcast", order_t.numel() * 8)
        self.final = True
        return list(order_t.tolist())
