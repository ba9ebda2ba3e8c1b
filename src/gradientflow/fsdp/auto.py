"""``compression="auto"`` for FSDP: dense fp32 until the first optimizer step, then a recipe for the optimizer.

As the DDP wrapper's ``"auto"`` (:mod:`gradientflow.wrapper.auto`): one global optimizer step pre-hook sees the
first ``step()`` of every optimizer; the modules whose sharded parameters it holds switch together, after the
ranks agreed on the pick (:func:`gradientflow.policy.auto_choice.agree_on_recipe`, on the mesh's two groups).
Step 0's gradients crossed between nodes densely in fp32, as torch's HSDP sends them; the switch applies from the
next backward on.

The choice is the policy's (:func:`gradientflow.policy.auto_choice.fsdp_recipe_for_optimizer`): Adam-type
optimizers (and others) get the quantised recipe DDP's ``"auto"`` measured for them, ``"3bit"`` for two nodes and
``"3bit-precond"`` beyond; SGD, which DDP's ``"auto"`` gives ``"topk-3bit"``, gets ``"4bit"`` here
(:data:`gradientflow.policy.auto_choice.FSDP_SGD_RECIPE`, with what was measured).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..policy.auto_choice import agree_on_recipe, fsdp_recipe_for_optimizer, recipe_for_optimizer, unmeasured_warning
from .module_comm import ModuleComm

logger = logging.getLogger(__name__)


class _Registry:
    """The modules waiting for ``"auto"``'s choice (weakly held, in construction order) and the optimizers seen."""

    def __init__(self) -> None:
        self.waiting: list[weakref.ref[ModuleComm]] = []
        self.seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.hook: RemovableHandle | None = None

    def add(self, comm: ModuleComm) -> None:
        self.waiting.append(weakref.ref(comm))
        if self.hook is None:
            self.hook = register_optimizer_step_pre_hook(self._first_step)

    def _first_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer in self.seen:
            return
        self.seen.add(optimizer)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        alive = [c for c in (r() for r in self.waiting) if c is not None]
        mine = [c for c in alive if c.recipe == "auto" and c.param_ids & held]
        self.waiting = [weakref.ref(c) for c in alive if c not in mine]
        if mine:
            decide(mine, optimizer)


REGISTRY = _Registry()


def choose(optimizer: torch.optim.Optimizer, nodes: int) -> tuple[str, str]:
    """(the optimizer's pick the ranks agree on, the recipe FSDP runs for it on ``nodes`` nodes)."""
    return recipe_for_optimizer(optimizer), fsdp_recipe_for_optimizer(optimizer, nodes)


def decide(comms: list[ModuleComm], optimizer: torch.optim.Optimizer) -> None:
    """Switch ``comms`` (auto modules ``optimizer`` steps) to its recipe, once every rank picked the same."""
    first = comms[0]
    pick, name = choose(optimizer, first.mesh.nodes)
    reason = f"{type(optimizer).__name__} -> {name}"
    for group in (first.mesh.replicate, first.mesh.shard.get_group()):
        agree_on_recipe(pick, reason, group, first.watchdog, first.device)
    message = unmeasured_warning(optimizer, name)
    if message is not None:
        warnings.warn(message, stacklevel=4)
    logger.info("gradientflow.fsdp: compression='auto' picked %s for %d modules", reason, len(comms))
    for comm in comms:
        comm.switch(comm.config.with_recipe(name), reason)
