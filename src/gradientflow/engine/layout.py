"""The pool's layout over a reducer's life: allocated for a planned order, re-laid once to the observed one.

A mixin of :class:`gradientflow.engine.reducer.Reducer` (split out by idea): step 4 of the reducer's
algorithm.  The first layout follows the parameters' reverse registration order (about backward's);
after the first synchronised backward the pool is re-laid in the order rank 0 observed, broadcast so
every rank agrees, as torch DDP rebuilds its buckets.  The strategy follows (``relayout``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .pool import GradPool, Layout, plan_layout, small_last

if TYPE_CHECKING:
    from ..config import GradientFlowConfig
    from ..diagnostics.watchdog import Watchdog
    from .protocol import SyncStrategy

logger = logging.getLogger(__name__)


class PoolLayout:
    """Layout of the reducer's gradient pool (the attributes below are the reducer's)."""

    params: list[torch.nn.Parameter]
    config: GradientFlowConfig
    pool: GradPool
    bound: list[torch.Tensor]
    bucket_of: list[int]
    sync: SyncStrategy
    src: int
    group: dist.ProcessGroup
    watchdog: Watchdog
    layout_final: bool

    def keys(self) -> list[tuple[torch.dtype, torch.device]]:
        return [(p.dtype, p.device) for p in self.params]

    def install(self, layout: Layout) -> None:
        """Allocate the pool for ``layout``; gradients that exist move into it, ``None`` stays ``None``."""
        sparse = self.config.sparse
        pool = GradPool(layout, self.params, pad_to=int(self.config.chunk_size) if sparse else 1)
        with torch.no_grad():
            for p, view in zip(self.params, pool.views):
                if p.grad is not None:
                    view.copy_(p.grad)
                    p.grad = view
        self.pool = pool
        self.bound = pool.views  # where .grad points (the pool, or a strategy's targets mid-backward)
        self.bucket_of = [0] * len(self.params)
        for b in layout.buckets:
            for i in b.params:
                self.bucket_of[i] = b.index

    def plan(self, order: list[int]) -> Layout:
        """The layout for a backward ``order`` (CSC with ``dense_1d``: 1-D parameters last)."""
        cfg = self.config
        if cfg.sparse and cfg.dense_1d:
            order = small_last(order, [p.dim() <= 1 for p in self.params])
        # CSC slices: what the last bucket holds is scored, exchanged and sent only after backward
        tail = cfg.threshold_bytes / 8 if cfg.sparse and cfg.csc_scope == "slice" else None
        return plan_layout([p.numel() for p in self.params], self.keys(), order, cfg.threshold_bytes, tail)

    def adopt_order(self, order: list[int]) -> bool:
        """Re-lay the pool out for ``order``; False (nothing done) if the layout would not change."""
        old, layout = self.pool, self.plan(order)
        if layout.order == old.layout.order:
            return False
        self.install(layout)
        self.sync.relayout(old.layout, self.pool)
        return True

    def _relayout_from_observed(self, observed: list[int]) -> None:
        """Adopt rank 0's observed backward order (unseen parameters keep their relative order)."""
        seen = set(observed)
        order = observed + [i for i in self.pool.layout.order if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)
        work = dist.broadcast(order_t, src=self.src, group=self.group, async_op=True)
        self.watchdog.wait(work, "layout broadcast", order_t.numel() * 8)
        order = order_t.tolist()
        self.layout_final = True
        if self.adopt_order(order):
            logger.debug("gradientflow: gradient pool re-laid in observed backward order")
