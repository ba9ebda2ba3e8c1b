"""The user's hooks on a gradientflow module, composed with gradientflow's reduction as torch's HSDP composes them.

gradientflow's reduction between nodes is the module's all-reduce hook (torch's ``set_all_reduce_hook`` on the 1-D
``shard`` submesh: :mod:`.module_comm`).  A user's ``set_all_reduce_hook`` on the same module would replace it:
the shards would stay each node's own and the replicas drift apart without an error.  So gradientflow's modules
are of a class of their own, torch's FSDP class of the module with :class:`GradientflowFSDPModule` before it (as
torch puts ``FSDPModule`` before the module's class), whose ``set_all_reduce_hook`` keeps the hook for after the
reduction: torch's HSDP calls it after its all-reduce, on the reduced shard, on no held micro-step, and refuses a
``stream`` (the hook runs on the reduction's stream).  The same class carries ``register_grad_scaler``, the DDP
wrapper's method of that name for gradientflow's modules (a torch ``GradScaler``'s loss scale, for the residuals).

``set_custom_reduce_scatter`` / ``set_custom_all_gather`` are torch's, unchanged: under torch's HSDP they replace
the collectives inside the node, and so they do here (the module's ``shard`` group); on Gloo they replace the ones
gradientflow bounds by ``timeout`` (:mod:`.bounded`), and the user's own then wait as they wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .mixing import comm_of

_CLASSES: dict[type, type] = {}
"""torch's FSDP class of a module -> gradientflow's (made once per class, as torch makes its own)."""


class GradientflowFSDPModule(FSDPModule):
    """What a module sharded by :func:`gradientflow.fsdp.fully_shard` adds to torch's ``FSDPModule``: the user's
    all-reduce hook after gradientflow's reduction between nodes."""

    # torch's FSDPModule.__new__ builds the module's own class (a container's slice) from this index of the MRO:
    # [GF<Orig>, GradientflowFSDPModule, FSDP<Orig>, FSDPModule, <Orig>, ...]
    _orig_cls_mro_index: int = 4

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Torch's ``set_all_reduce_hook`` as under its HSDP: ``hook(reduce_output)`` runs after gradientflow's
        reduction between nodes, on the reduced shard (in place, before torch casts it into ``.grad``), once per
        exchange (not on a micro-step held under ``set_requires_all_reduce(False)``).  ``stream``: refused, as
        torch refuses it under HSDP (the hook runs on the stream of the reduction before it)."""
        if stream is not None:
            # torch's own words, exactly (its tests compare the message); the advice rides as a note, which a
            # traceback prints below it (Python 3.11+)
            error = ValueError("stream cannot be set when using native HSDP")
            if hasattr(error, "add_note"):
                error.add_note(
                    "gradientflow.fsdp runs the hook after its reduction between nodes, on that reduction's stream, as "
                    "torch's HSDP runs it after its all-reduce: call set_all_reduce_hook(hook) without stream."
                )
            raise error
        comm_of(self).set_user_hook(hook)  # the unit's ModuleComm (this module's, or its list's first)

    def register_grad_scaler(self, scaler: Any) -> None:
        """Tell gradientflow's exchanges of this module and of every gradientflow module inside it about the
        ``torch.amp.GradScaler`` scaling the loss (the DDP wrapper's ``register_grad_scaler``): the error-feedback
        residuals are then kept in units of each step's loss scale while they are added to the scaled gradients,
        and an overflowing step (inf / NaN gradients: the scaler skips it) leaves them finite.  Call it on the root
        once, before the first backward; ``None`` forgets it.  Dense recipes need none (nothing is kept)."""
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"register_grad_scaler takes a torch.amp.GradScaler (or None), got {type(scaler).__name__}: pass "
                "the scaler whose scaler.scale(loss) you call backward on."
            )
        for module in cast(nn.Module, self).modules():
            comm = getattr(module, "_gf_fsdp", None)
            if comm is not None:
                comm.register_grad_scaler(scaler)


def adopt(module: nn.Module) -> None:
    """``module`` (just sharded by torch's ``fully_shard``) becomes an instance of gradientflow's class for its
    FSDP class: ``isinstance(module, FSDPModule)`` and ``isinstance(module, <its class>)`` still hold."""
    cls = type(module)
    ours = _CLASSES.get(cls)
    if ours is None:
        ours = _CLASSES[cls] = type(f"GF{cls.__name__}", (GradientflowFSDPModule, cls), {"__module__": cls.__module__})
        original = cls.__mro__[cast(Any, cls)._orig_cls_mro_index]
        assert ours.__mro__[GradientflowFSDPModule._orig_cls_mro_index] is original, ours.__mro__
    module.__class__ = ours
