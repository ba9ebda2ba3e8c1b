"""Synchronisation strategies: *what* goes on the wire for each bucket (the engine decides *when*).

- :mod:`.dense` — every gradient, averaged (optionally cast to a 16-bit wire);
- :mod:`.csc` — coarse-grained sparse communication (the ``"topk"`` recipes): the top chunks by score, the rest
  kept in a residual (:mod:`.selection`, :mod:`.residual`, :mod:`.slices`, :mod:`.scorer`, :mod:`.writeback`);
  ``"topk-3bit"``'s chunks on the quantised exchange (:mod:`.csc_quantized`);
- :mod:`.quantized` — every gradient every step, block-quantised to a few bits with error feedback
  (the ``"3bit"`` family), on a quantised ring (:mod:`gradientflow.comm.quantized_ring`).

Mechanisms only: which recipe runs is policy (:mod:`gradientflow.policy`), what each name sets is the recipe table
(:mod:`gradientflow.recipes`).  :func:`build_strategy` is the one place that maps a validated config's mechanism to
a strategy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.two_level import NodeGroups
from ..config import GradientFlowConfig
from ..diagnostics.watchdog import Watchdog
from ..engine.pool import GradPool
from ..engine.protocol import MakeSync, SyncStrategy
from .dense import DenseSync


def build_strategy(
    config: GradientFlowConfig,
    group: dist.ProcessGroup,
    watchdog: Watchdog,
    control: dist.ProcessGroup | None,
    nodes: NodeGroups | None = None,
) -> MakeSync:
    """The strategy ``config`` asks for, as the reducer's ``make_sync`` (built once the pool exists).

    ``nodes``: two-level synchronisation's groups (nodes of several ranks), ``None`` = flat."""

    def make(pool: GradPool, shapes: list[torch.Size]) -> SyncStrategy:
        if config.mechanism == "quantized":
            from .quantized import QuantizedSync  # noqa: PLC0415 — only quantised runs need it

            q = config.quantizer()
            return QuantizedSync(
                pool,
                group=group,
                world_size=dist.get_world_size(group),
                bits=q.bits,
                block=q.block,
                clip=q.clip,
                levels=q.levels,
                precondition=q.precondition,
                warmup=q.warmup_steps,
                shapes=shapes,
                watchdog=watchdog,
                nodes=nodes,
            )
        dense = DenseSync(
            group=group,
            world_size=dist.get_world_size(group),
            wire_dtype=config.wire_dtype,
            algorithm=config.algorithm,
            watchdog=watchdog,
            groups=nodes,
        )
        if not config.sparse:
            return dense
        from .csc import SparseSync  # noqa: PLC0415 — only sparse runs need it

        assert control is not None  # the wrapper makes a control group whenever density is set
        return SparseSync(pool, dense, config=config, shapes=shapes, control_group=control)

    return make


__all__ = ["build_strategy"]
