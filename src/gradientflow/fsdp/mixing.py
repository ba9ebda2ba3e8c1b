"""Torch's ``fully_shard`` and gradientflow's in one model: where it works, and the errors where it cannot.

gradientflow's modules are torch's FSDP on each node's 1-D ``shard`` submesh, with the reduction between nodes in
the all-reduce hook.  A module torch sharded on the 2-D mesh runs torch's native HSDP (an fp32 all-reduce between
nodes): it works, uncompressed, and is logged.  A module torch sharded on a 1-D mesh inside a gradientflow model
would reduce its gradients inside the node only: the nodes' replicas would drift apart without an error, so that is
refused, at ``fully_shard`` for a child already sharded, and at the first backward for a parent sharded after.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger(__name__)

HOW = (
    "Shard every module of the model with gradientflow.fsdp.fully_shard (blocks first, then the root, with the same "
    "mesh), or every one with torch's fully_shard on the 2-D mesh (torch's HSDP)."
)


def comm_of(module: object) -> Any:
    """The :class:`~gradientflow.fsdp.module_comm.ModuleComm` of the FSDP unit ``module`` belongs to, or ``None``.

    ``fully_shard`` marks the first module it was given (``_gf_fsdp``); torch's ``fully_shard([norm, lm_head])``
    gives every module of the list one shared FSDP state (``_get_fsdp_state()``, whose ``_modules`` are the list), so
    the list's other modules are found through it: each is gradientflow's as much as the first."""
    comm = getattr(module, "_gf_fsdp", None)
    if comm is not None or not isinstance(module, FSDPModule):
        return comm
    for member in module._get_fsdp_state()._modules:
        comm = getattr(member, "_gf_fsdp", None)
        if comm is not None:
            return comm
    return None


def ours(module: object) -> bool:
    return comm_of(module) is not None


def check_children(module: nn.Module) -> None:
    """Before sharding ``module``: ``ValueError`` if it is sharded already, or if torch sharded a submodule on a 1-D
    mesh (its gradients would never leave the node)."""
    if isinstance(module, FSDPModule):
        who = "gradientflow.fsdp.fully_shard" if ours(module) else "torch's fully_shard"
        raise ValueError(
            f"gradientflow.fsdp.fully_shard: {type(module).__name__} is sharded already (by {who}); call fully_shard "
            "once per module, blocks first, then the root."
        )
    for name, child in module.named_modules():
        if child is module or not isinstance(child, FSDPModule) or ours(child):
            continue
        if _mesh_ndim(child) == 1:
            raise ValueError(
                f"gradientflow.fsdp.fully_shard: submodule {name!r} was sharded by torch's fully_shard on a 1-D mesh, "
                f"so its gradients would be reduced inside the node only and the nodes' replicas would drift apart. "
                f"{HOW}"
            )
        logger.info("submodule %r runs torch's native HSDP: its gradients cross between nodes uncompressed", name)


def _mesh_ndim(module: Any) -> int:
    groups = module._get_fsdp_state()._fsdp_param_groups
    return max((g.mesh_info.mesh.ndim for g in groups), default=2)


def check_tree(module: nn.Module) -> None:
    """At the first backward (the root's lazy init has run): ``RuntimeError`` if any FSDP module of the tree is
    torch's on a 1-D mesh (a parent sharded by torch after gradientflow sharded its blocks).  Every rank holds the
    same tree, so every rank raises."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    for other in state._state_ctx.all_states:
        mods = other._modules
        if any(ours(m) for m in mods) or not other._fsdp_param_groups:
            continue
        if max(g.mesh_info.mesh.ndim for g in other._fsdp_param_groups) == 1:
            names = ", ".join(type(m).__name__ for m in mods)
            raise RuntimeError(
                f"gradientflow.fsdp: {names} was sharded by torch's fully_shard on a 1-D mesh in a model whose other "
                f"modules gradientflow shards, so its gradients would be reduced inside the node only and the "
                f"nodes' replicas would drift apart. {HOW}"
            )
