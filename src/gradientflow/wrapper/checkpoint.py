"""Checkpoints of the wrapper: pickling/deepcopy (as torch DDP: the group and the engine are rebuilt),
the communication state (CSC residuals) beside the model, and the optimizer-facing checks.

A mixin of :class:`gradientflow.DistributedDataParallel`, split out of ``ddp.py`` by idea, that sets no attribute
of the wrapper: its own state (the optimizer hook, the optimizers checked, the grad scaler) is an
:class:`OptimizerWatch` the wrapper holds (``model._gf_optimizers``, made anew with each engine).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..config import GradientFlowConfig
from ..engine import comm_state
from ..policy.pitfalls import optimizer_pitfalls
from . import auto
from .surface import WrapperSurface

# Engine attributes that are plain settings and survive pickling; the rest is rebuilt.
_PICKLED = {"_gf_device", "_gf_ignored", "_gf_auto", "_gf_torch", "_gf_outer"}  # _gf_outer: None (else refused)


def warn_pitfalls(config: GradientFlowConfig, optimizer: torch.optim.Optimizer, stacklevel: int) -> None:
    """Warn about the measured pitfalls of ``optimizer`` under the top-k recipe ``config`` runs
    (:mod:`gradientflow.policy.pitfalls`; nothing for dense or quantised synchronisation).  ``stacklevel``: the
    warning's frame counted from here, so that it names the user's line."""
    if not config.sparse:
        return
    quantized_chunks = config.mechanism == "topk-quantized"
    assert config.density is not None
    for message in optimizer_pitfalls(optimizer, config.density, config.momentum, quantized_chunks):
        warnings.warn(message, stacklevel=stacklevel)


class OptimizerWatch:
    """CSC: run :meth:`Checkpointing.check_optimizer` on every optimizer that steps this model's parameters, at
    its first ``step()``, so the measured pitfalls are reported without the user knowing the method; and the
    grad scaler registered, which a rebuilt engine keeps.

    One global optimizer step pre-hook (torch's), holding the wrapper weakly and removed with it (or with the
    next engine's watch, ``old``); after an optimizer's first step it costs one WeakSet lookup per step.
    """

    def __init__(self, model: Checkpointing, old: OptimizerWatch | None) -> None:
        if old is not None and old.hook is not None:
            old.hook.remove()
        self.scaler: Any = old.scaler if old is not None else None  # register_grad_scaler's
        self.checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.hook: RemovableHandle | None = None
        if not (model.config.sparse or model._gf_auto.requested):
            return  # check_optimizer has nothing to say about dense or quantised synchronisation
        me = weakref.ref(model)
        checked = self.checked

        def first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            model = me()
            if model is None or optimizer in checked:
                return
            checked.add(optimizer)
            own = {id(p) for p in model._gf_params}
            if any(id(p) in own for group in optimizer.param_groups for p in group["params"]):
                warn_pitfalls(model.config, optimizer, stacklevel=4)  # the user's optimizer.step() line
                auto.note_optimizer(model, optimizer, stacklevel=3)  # the user's optimizer.step() line

        self.hook = register_optimizer_step_pre_hook(first_step)
        weakref.finalize(model, self.hook.remove)


class Checkpointing(WrapperSurface):
    """Pickling, the communication state, and the optimizer-facing checks (mixed into the wrapper)."""

    _gf_optimizers: OptimizerWatch  # made by ddp.py with each engine

    def __getstate__(self) -> dict[str, Any]:
        """As torch DDP: the process group and the engine are not pickled (rebuilt on load)."""
        default = dist.distributed_c10d._get_default_group()
        if self.process_group is not dist.group.WORLD and self.process_group != default:
            raise ValueError(
                "gradientflow: pickling/deepcopy is only supported with the default process group (as torch DDP)"
            )
        if self._gf_outer is not None:
            raise ValueError(
                "gradientflow: pickling/deepcopy of a model with sync_every > 1 is not supported (its outer loop holds "
                "process groups and optimizer hooks). Save model.module.state_dict() and comm_state_dict() instead."
            )
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_gf_") or k in _PICKLED}
        state.pop("process_group", None)
        state["_gf_comm_state"] = self.comm_state_dict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        comm = state.pop("_gf_comm_state")
        self.__dict__.update(state)
        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("gradientflow: unpickling a wrapped model needs an initialised default process group")
        self._gf_attach_group(world)
        self._gf_collect_tensors()
        self._gf_build_engine(order=comm.get("layout_order"))
        self.load_comm_state_dict(comm)

    # ---- state of the communication (CSC residuals) ---------------------------------------
    def comm_state_dict(self) -> dict[str, Any]:
        """Communication state (CSC residuals u, v and step counter) to checkpoint with the model.

        Per rank: residuals differ between ranks, so every rank saves its own.  Plain Python
        values and tensors only, so ``torch.load(..., weights_only=True)`` reads it.
        """
        state = auto.save(self, comm_state.save(self._gf_engine, self._gf_world_size))
        if self._gf_outer is not None:  # sync_every > 1: the anchor, the outer momentum, residuals, the step phase
            state["outer"] = self._gf_outer.state_dict()
        return state

    def load_comm_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`comm_state_dict` returned (same model, options and world size).

        Everything is checked first: a state from another model, world size or chunk size, or a
        truncated one, raises ``ValueError`` and leaves this model as it was.
        """
        state = dict(state)
        outer = state.pop("outer", None)
        if (outer is None) != (self._gf_outer is None):
            mine = self.config.sync_every
            raise ValueError(
                f"gradientflow: the communication state was saved {'with' if outer is not None else 'without'} "
                f"sync_every > 1, this model runs sync_every={mine}. Build the model with the sync_every it was "
                "saved with."
            )
        if self._gf_outer is not None and outer is not None:
            self._gf_outer.validate_state_dict(outer)  # before anything changes
        state = auto.prepare_load(self, state)  # first: "auto" may rebuild the engine for the saved recipe
        comm_state.load(self._gf_engine, state, self._gf_world_size)
        if self._gf_outer is not None and outer is not None:
            self._gf_outer.load_state_dict(outer)

    def register_grad_scaler(self, scaler: Any) -> None:
        """Tell CSC about the ``torch.amp.GradScaler`` in use (residuals are kept unscaled).

        Without it CSC assumes a loss scale of 1.  Dense communication does not need it.
        """
        self._gf_optimizers.scaler = scaler
        self._gf_engine.register_grad_scaler(scaler)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn if CSC momentum correction is on and ``optimizer`` applies momentum too, or if an
        Adam-type optimizer meets a CSC density below ``policy.pitfalls.ADAPTIVE_MIN_DENSITY`` (measured to lose
        quality).

        Runs by itself at the first ``step()`` of every optimizer holding this model's parameters;
        calling it first (to see the warnings before training) keeps that from repeating them."""
        self._gf_optimizers.checked.add(optimizer)
        warn_pitfalls(self.config, optimizer, stacklevel=3)
