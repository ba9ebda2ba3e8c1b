"""The inner optimizer's steps driving an :class:`.loop.OuterLoop`, the same for every door (the DDP wrapper's
:mod:`gradientflow.wrapper.fewer_syncs`, ``fully_shard``'s :mod:`gradientflow.fsdp.outer`).

The hook point: torch's global optimizer step pre- and post-hooks, for the optimizer stepping the loop's parameters
(the inner optimizer, the user's, unchanged), so a sync due after step ``k * H - 1`` happens inside that
``optimizer.step()`` call: the next forward, an evaluation and a checkpoint written after the step see the
synchronised parameters.  The pre-hook of the first step takes the starting parameters as the first anchor.
One optimizer only: a second one stepping the same parameters would count steps twice (refused when it steps).
Torch's ``get_state_dict`` / ``get_optimizer_state_dict`` step a fresh optimizer once with zero gradients at lr 0
to create its state (``_init_optim_state`` in torch/distributed/checkpoint/state_dict.py): that step trains nothing
and is not counted (:func:`is_state_init_step`), or every later sync would come one step early (and the first
anchor would be taken from the parameters before a checkpoint's were loaded into them).

Between syncs every replica has its own parameters and its own inner optimizer state (moments of its own
gradients), while a checkpoint written the usual way holds one replica's (torch DDP's: rank 0's model and
optimizer; DCP under HSDP: one copy of each shard, whichever replica wrote it).  So the door's checkpoint keeps
this rank's inner optimizer state (:meth:`InnerSteps.state_dict`), written back at the next optimizer step: an exact
resume whichever replica's state the framework loaded.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .loop import OuterLoop


class InnerSteps:
    """The steps of the one optimizer holding any of ``owned`` (the door's parameters as the optimizer holds them:
    the wrapper's, or FSDP's sharded DTensors) counted for ``loop``."""

    def __init__(self, loop: OuterLoop, owned: Iterable[torch.Tensor]) -> None:
        self.loop = loop
        self.own = frozenset(id(p) for p in owned)
        self.optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self.inner_state: dict[int, Any] | None = None  # a loaded checkpoint's inner optimizer state, this rank's
        self.hooks: list[Any] = []
        self.skipping = False  # the step between before() and after() is torch's state-creating one: not counted

    def ours(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self.own for group in optimizer.param_groups for p in group["params"])

    def before(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a step of ``optimizer`` (one of ours): the one-optimizer check, a loaded inner state written back,
        the first anchor; nothing for torch's state-creating step (:func:`is_state_init_step`), which
        :meth:`after` then does not count."""
        self.skipping = is_state_init_step(optimizer)
        if self.skipping:
            return
        self._check_one_optimizer(optimizer)
        self._restore_inner_state(optimizer)
        self.loop.start()

    def after(self) -> list[int]:
        """After a step of ours: the fragments the outer loop synchronised (or merged) now."""
        if self.skipping:
            self.skipping = False
            return []
        return self.loop.after_step()

    def hook(self, owner: object, after_sync: Callable[[Any], None]) -> None:
        """Torch's global step hooks for this loop, removed with ``owner`` (held weakly: the hooks outlive no
        model); ``after_sync(owner)`` runs after a step that changed parameters."""
        alive = weakref.ref(owner)

        def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if alive() is not None and self.ours(optimizer):
                self.before(optimizer)

        def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            owner = alive()
            if owner is not None and self.ours(optimizer) and self.after():
                after_sync(owner)

        self.hooks = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
        for h in self.hooks:
            weakref.finalize(owner, h.remove)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    def _check_one_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        known = self.optimizer() if self.optimizer is not None else None
        if known is None:
            self.optimizer = weakref.ref(optimizer)
        elif known is not optimizer:
            raise ValueError(
                "gradientflow: sync_every > 1 counts the steps of one optimizer (the inner optimizer), but a second "
                f"optimizer ({type(optimizer).__name__}) steps this model's parameters too. Put every parameter group "
                "in one optimizer."
            )

    # ---- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The outer loop's state, this replica's parameters and this rank's inner optimizer state (a sharded
        parameter's state by its local shard)."""
        state = self.loop.state_dict()
        known = self.optimizer() if self.optimizer is not None else None
        inner = self.inner_state
        if inner is None and known is not None:
            inner = known.state_dict()["state"]
        state["inner_optimizer"] = None if inner is None else _cloned(inner)
        return state

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        self.loop.validate_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loop.load_state_dict(state)
        inner = state.get("inner_optimizer")  # saved before it was kept: the optimizer's loaded state stands
        self.inner_state = None if inner is None else _cloned(inner)

    def _restore_inner_state(self, optimizer: torch.optim.Optimizer) -> None:
        """The first step after a load: this rank's saved inner optimizer state replaces what the optimizer loaded.
        Plain tensors: torch's own ``load_state_dict`` with the optimizer's current parameter groups, so a
        scheduler's learning rate stands and torch casts and places the state.  A sharded parameter's state (a
        DTensor, as FSDP's optimizers hold it): written into the loaded state's local shard, in place (torch's
        ``load_state_dict`` would replace the DTensor by the plain local tensor the checkpoint holds)."""
        if self.inner_state is None:
            return
        live = optimizer.state_dict()["state"]  # the live tensors, by index
        if any(isinstance(v, DTensor) for per in live.values() for v in per.values()):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            with torch.no_grad():
                for k, per in self.inner_state.items():
                    for name, value in per.items():
                        now = live.get(k, {}).get(name)
                        if isinstance(now, torch.Tensor) and isinstance(value, torch.Tensor):
                            _local(now).copy_(value)
                        else:  # a plain number, or state the optimizer had not loaded: set as saved
                            optimizer.state[params[k]][name] = value
        else:
            optimizer.load_state_dict(
                {"state": self.inner_state, "param_groups": optimizer.state_dict()["param_groups"]}
            )
        self.inner_state = None


_STATE_INIT = ("torch.distributed.checkpoint.state_dict", "_init_optim_state")
"""Where torch takes its state-creating step: the module and the function."""


def is_state_init_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the step ``optimizer`` is about to take is the one torch's ``_init_optim_state`` takes: the optimizer
    has no state, every learning rate is 0, and that function is on the call stack.  Each of the three is the same on
    every rank (the gradients are not: a rank's shard may be all zeros, or empty, while a real step's are not on
    another rank; a warm-up's first real step may have lr 0), so every rank counts alike.  The stack is read only
    for a step at lr 0 on an optimizer without state."""
    if optimizer.state or any(float(g.get("lr", 1.0)) != 0.0 for g in optimizer.param_groups):
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == _STATE_INIT:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage), a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _cloned(state: dict[int, Any]) -> dict[int, Any]:
    """An optimizer's per-parameter state with its tensors copied (torch's ``state_dict()`` returns the live ones),
    a DTensor's as its local shard (this rank's)."""
    return {
        k: {n: _local(v).detach().clone() if isinstance(v, torch.Tensor) else v for n, v in per.items()}
        for k, per in state.items()
    }
