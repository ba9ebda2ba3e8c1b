"""Synchronisation strategies: *what* goes on the wire for each bucket (the engine decides *when*).

- :mod:`.dense` — every gradient, averaged (optionally cast to a 16-bit wire);
- :mod:`.csc` — coarse-grained sparse communication (the ``"topk"`` recipes): the top chunks by score, the rest
  kept in a residual (:mod:`gradientflow.exchange.error_feedback`, :mod:`gradientflow.exchange.selection`,
  :mod:`.slices`, :mod:`.scorer`, :mod:`.writeback`); ``"topk-3bit"``'s chunks on the quantised exchange
  (:mod:`.csc_quantized`);
- :mod:`.quantized` — every gradient every step, block-quantised to a few bits with error feedback
  (the ``"3bit"`` family), through :class:`gradientflow.exchange.quantized.QuantizedExchange`.

Mechanisms only: which recipe runs is policy (:mod:`gradientflow.policy`), what each name sets is the recipe table
(:mod:`gradientflow.recipes`).  Each mechanism's DDP form is registered here with :mod:`gradientflow.mechanisms`
(the door ``"ddp"``); :func:`build_strategy` looks the config's mechanism up there.  A form is
``make(config, parts, pool, shapes) -> SyncStrategy``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import mechanisms
from ..comm.two_level import NodeGroups
from ..config import GradientFlowConfig
from ..diagnostics.watchdog import Watchdog
from ..engine.pool import GradPool
from ..engine.protocol import MakeSync, SyncStrategy
from .dense import DenseSync


@dataclass(frozen=True)
class Parts:
    """What a DDP form is built on: the exchange's group, the watchdog, the control group (``None`` unless the
    config asks for one), two-level synchronisation's groups (``None``: flat)."""

    group: dist.ProcessGroup
    watchdog: Watchdog
    control: dist.ProcessGroup | None
    nodes: NodeGroups | None


def build_strategy(
    config: GradientFlowConfig,
    group: dist.ProcessGroup,
    watchdog: Watchdog,
    control: dist.ProcessGroup | None,
    nodes: NodeGroups | None = None,
) -> MakeSync:
    """The strategy ``config`` asks for, as the reducer's ``make_sync`` (built once the pool exists): its
    mechanism's DDP form (:mod:`gradientflow.mechanisms`).

    ``nodes``: two-level synchronisation's groups (nodes of several ranks), ``None`` = flat."""
    build = mechanisms.builder(config.mechanism, "ddp")
    parts = Parts(group, watchdog, control, nodes)

    def make(pool: GradPool, shapes: list[torch.Size]) -> SyncStrategy:
        return build(config, parts, pool, shapes)

    return make


def _dense(config: GradientFlowConfig, parts: Parts) -> DenseSync:
    return DenseSync(
        group=parts.group,
        world_size=dist.get_world_size(parts.group),
        wire_dtype=config.wire_dtype,
        algorithm=config.algorithm,
        watchdog=parts.watchdog,
        groups=parts.nodes,
    )


@mechanisms.form("dense", "ddp")
@mechanisms.form("auto", "ddp")  # "auto" before the optimizer's first step: dense fp32 (wrapper/auto.py switches)
def _dense_form(config: GradientFlowConfig, parts: Parts, pool: GradPool, shapes: list[torch.Size]) -> SyncStrategy:
    return _dense(config, parts)


@mechanisms.form("topk", "ddp")
@mechanisms.form("topk-quantized", "ddp")
def _topk_form(config: GradientFlowConfig, parts: Parts, pool: GradPool, shapes: list[torch.Size]) -> SyncStrategy:
    from .csc import SparseSync  # noqa: PLC0415 — only sparse runs need it

    assert parts.control is not None  # the wrapper makes a control group whenever density is set
    return SparseSync(pool, _dense(config, parts), config=config, shapes=shapes, control_group=parts.control)


@mechanisms.form("quantized", "ddp")
def _quantized_form(config: GradientFlowConfig, parts: Parts, pool: GradPool, shapes: list[torch.Size]) -> SyncStrategy:
    from .quantized import QuantizedSync  # noqa: PLC0415 — only quantised runs need it

    q = config.quantizer()
    return QuantizedSync(
        pool,
        group=parts.group,
        world_size=dist.get_world_size(parts.group),
        bits=q.bits,
        block=q.block,
        clip=q.clip,
        levels=q.levels,
        precondition=q.precondition,
        warmup=q.warmup_steps,
        shapes=shapes,
        watchdog=parts.watchdog,
        nodes=parts.nodes,
    )


__all__ = ["Parts", "build_strategy"]
