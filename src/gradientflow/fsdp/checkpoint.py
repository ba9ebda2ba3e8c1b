"""The recipe state in ``torch.distributed.checkpoint`` (DCP): :func:`comm_state`, beside the model and optimizer.

Each module's residual differs between ranks (each rank's error on its shard of its node's sum), so it is saved as
a DTensor sharded over both mesh dimensions (``(Shard(0), Shard(0))``: rank ``node * G + local`` holds piece
``node * G + local``); the preconditioner's ``q``, identical on every node (it is computed from the exchange's
result), as the parameters are: ``(Replicate(), Shard(0))``.  The exchanges counted (the warm-up's) and the recipe
running (``"auto"``'s pick) travel as plain values.  With ``sync_every > 1`` the outer loop's state (its anchor,
momentum and residual shards, the phase, this replica's shards and this rank's inner optimizer state) is one item
per rank, ``outer.rank<r>@<mesh>`` (:func:`gradientflow.fsdp.outer.state_items`).

A residual is a rank's share of its node's delayed gradient on a layout of shards: on another mesh it means
nothing, so its keys carry the layout (``residual@2x2``) and a resume onto another mesh fails in DCP's load with
that key missing; :func:`check_checkpoint` reads the checkpoint's metadata first and says so in words, on every rank.

Usage::

    state = {"model": model_sd, "optim": optim_sd, "gradientflow": gradientflow.fsdp.comm_state(model)}
    dcp.save(state, checkpoint_id=path)
    ...
    gradientflow.fsdp.check_checkpoint(path, model)  # optional: a clear error for another mesh
    dcp.load(state, checkpoint_id=path)               # then set_state_dict(model, optimizer, ...)
"""

from __future__ import annotations

import os
from typing import Any

import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import outer
from .counters import comms

KEY = "gradientflow"
"""The key :func:`check_checkpoint` looks for the state under (the one the usage above saves it as)."""


def _name(fqn: str) -> str:
    return fqn or "<root>"


class CommState(Stateful):
    """DCP's ``Stateful`` for the recipe state of every module of ``model`` that gradientflow sharded."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for fqn, comm in comms(self.model):
            name, mesh = _name(fqn), comm.mesh
            out[f"{name}.recipe"] = comm.recipe
            q = comm.feedback
            if q is None:
                continue
            tag = f"@{mesh.label}"
            out[f"{name}.residual{tag}"] = DTensor.from_local(q.err, mesh.mesh, [Shard(0), Shard(0)], run_check=False)
            if q.sq is not None:
                out[f"{name}.sq{tag}"] = DTensor.from_local(q.sq, mesh.mesh, [Replicate(), Shard(0)], run_check=False)
            out[f"{name}.step"] = q.step
        out.update(outer.state_items([comm for _, comm in comms(self.model)]))  # sync_every > 1: per rank
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The tensors were loaded in place (they are the live state's views); the recipe and the count here."""
        for fqn, comm in comms(self.model):
            name = _name(fqn)
            comm.loaded(model=False)
            recipe = state_dict[f"{name}.recipe"]
            if recipe != comm.recipe:
                if comm.requested != "auto":
                    raise ValueError(
                        f"gradientflow.fsdp: the checkpoint's module {name!r} ran compression={recipe!r}, this one "
                        f"runs {comm.recipe!r}. Resume with the same compression (or 'auto', which continues the "
                        "saved pick)."
                    )
                comm.switch(comm.config.with_recipe(recipe), f"resumed: {recipe}")
            if comm.feedback is not None and f"{name}.step" in state_dict:
                comm.feedback.resume(int(state_dict[f"{name}.step"]))
        outer.load_items([comm for _, comm in comms(self.model)], state_dict)


def comm_state(model: nn.Module) -> CommState:
    """The recipe state of ``model`` (residuals, ``q``, counts, ``"auto"``'s pick) for DCP's save and load."""
    return CommState(model)


def check_checkpoint(checkpoint_id: str | os.PathLike[str], model: nn.Module, key: str = KEY) -> None:
    """``ValueError`` (on every rank: each reads the same metadata) if the DCP checkpoint at ``checkpoint_id`` holds
    gradientflow state (under ``key``) of another mesh than ``model``'s."""
    saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    layouts = {k.rsplit("@", 1)[1] for k in saved if k.startswith(f"{key}.") and "@" in k}
    here = {comm.mesh.label for _, comm in comms(model)}
    if layouts and layouts != here:
        was, now = ", ".join(sorted(layouts)), ", ".join(sorted(here))
        raise ValueError(
            f"gradientflow.fsdp: the checkpoint at {os.fspath(checkpoint_id)!r} was saved on a {was} mesh (nodes x "
            f"ranks per node), this model runs on {now}. The error-feedback "
            "residuals are per rank of a mesh: resume on the same mesh, or load the model and optimizer alone "
            f"(without the {key!r} entry) to restart the residuals at zero."
        )
