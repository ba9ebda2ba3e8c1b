"""The benches' FSDP2 / HSDP modes: torch's HSDP and ``gradientflow.fsdp.fully_shard`` on the launch's mesh.

A mode shards the model as FSDP2 users do theirs, each block and then the root (:func:`blocks`), on the 2-D mesh
(nodes, ranks per node) of torchrun's layout (:func:`gradientflow.fsdp.hsdp_mesh`): sharded inside a node,
replicated between nodes.  ``hsdp`` is torch's own ``fully_shard`` on that mesh, its reduction between nodes an
fp32 all-reduce of each shard (the default ``reduce_dtype``); ``hsdp-bf16`` the same with
``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``, what a user tries first to halve it; ``fsdp-<recipe>``
gradientflow's ``fully_shard`` with ``compression="<recipe>"``, one per row of the recipe table (each hook waits
for its exchange between nodes, the default), and ``fsdp-<recipe>-overlap`` the same with ``overlap=True`` (the
exchange overlapping the next module's backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradientflow.option_values import lookup
from gradientflow.recipes import PER_STEP_NAMES

HSDP_MODES = ("hsdp", "hsdp-bf16")
"""torch's HSDP: fp32 reduce (its default), bf16 reduce."""
FSDP_PREFIX = "fsdp-"
OVERLAP = "-overlap"
FSDP_MODES = tuple(f"{FSDP_PREFIX}{name}{wait}" for wait in ("", OVERLAP) for name in PER_STEP_NAMES)
"""``fsdp-<recipe>``: ``gradientflow.fsdp.fully_shard(..., compression="<recipe>")``; ``fsdp-<recipe>-overlap``:
the same with ``overlap=True``."""
SHARDED_MODES = (*HSDP_MODES, *FSDP_MODES)
_MESH: list[Any] = []  # one mesh per process: every sharded mode of a launch on the same groups


def is_sharded(mode: str) -> bool:
    """Whether ``mode`` (or a variant of it, ``fsdp-none:sync_every=100``) is one of the FSDP2 / HSDP modes."""
    return mode.partition(":")[0] in SHARDED_MODES


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules sharded before the root, as FSDP2 users pick them: the model's ``layers`` (the built-in
    transformer's blocks, torchtitan's convention), else its direct children that hold parameters."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    return [c for c in model.children() if any(True for _ in c.parameters())]


def mesh() -> Any:
    """The launch's HSDP mesh (built once, on every rank in the same order: it creates process groups)."""
    if not _MESH:
        from gradientflow.fsdp import hsdp_mesh

        _MESH.append(hsdp_mesh())
    return _MESH[0]


def shard(model: nn.Module, mode: str, **options: Any) -> nn.Module:
    """``model`` sharded by ``mode``'s ``fully_shard`` (each of :func:`blocks`, then the root), in place; ``options``:
    gradientflow's ``fully_shard`` keywords of a variant (``fsdp-3bit:sync_every=100`` -> ``sync_every=100``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import gradientflow.fsdp as gf

    on = mesh()
    for module in [*blocks(model), model]:
        if mode == "hsdp":
            torch_fully_shard(module, mesh=on)
        elif mode == "hsdp-bf16":
            torch_fully_shard(module, mesh=on, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
        else:
            recipe = mode.removeprefix(FSDP_PREFIX).removesuffix(OVERLAP)
            overlap = mode.endswith(OVERLAP)
            if lookup(recipe).recipe.mechanism.startswith("topk") and "warmup_steps" not in options:
                # the top-k recipes' sparse steps are timed, as the DDP modes' are: no density ramp
                options = {**options, "warmup_steps": 0}
            gf.fully_shard(module, mesh=on, compression=recipe, overlap=overlap, **options)
    return model


def hsdp_wire_bytes(mode: str, n_params: int, per_node: int) -> int:
    """Bytes one rank of torch's HSDP hands to the all-reduce between nodes per step: its shard (``1/G`` of the
    parameters, ``G`` ranks per node), in the reduce dtype (padding aside)."""
    return (2 if mode == "hsdp-bf16" else 4) * -(-n_params // per_node)


def stats(model: nn.Module) -> dict[str, float]:
    """gradientflow's FSDP counters of the last step in the bench's keys: what a rank handed to the exchange
    between nodes (``payload_bytes``, also ``inter_node_bytes``: all of it crosses), and its time in the hooks."""
    import gradientflow.fsdp as gf

    s = gf.comm_stats(model)
    return {
        "payload_bytes": float(s["payload_bytes"]),
        "inter_node_bytes": float(s["payload_bytes"]),
        "comm_seconds": float(s["seconds"]),
        # the time the hooks spent posting and waiting for their exchanges (with overlap, what backward did not hide)
        "exposed_seconds": float(s["seconds"]),
        "collectives": float(s["exchanges"]),
        "host_syncs": 0.0,
    }
