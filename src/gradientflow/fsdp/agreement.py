"""The ranks' agreement on a module's recipe at ``fully_shard``: one tiny all-gather per mesh dimension.

Every rank of an HSDP job must run the same recipe on the same module: a node quantising while its peer all-reduces
fp32 would pair mismatched messages (a hang, or garbage).  A fingerprint of the settings (recipe, quantiser, mesh,
the module's shard size) is all-gathered on the replicate group and on the shard group: agreeing with both, every
rank agrees with the whole mesh.  Where they differ, every rank raises, naming what each rank passed.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


def fingerprint(settings: str) -> int:
    return int.from_bytes(hashlib.sha256(settings.encode()).digest()[:7], "little")


def check_same(settings: str, groups: list[dist.ProcessGroup], device: torch.device) -> None:
    """``ValueError`` on every rank unless every rank of ``groups`` passed the same ``settings`` (a string)."""
    mine = torch.tensor([fingerprint(settings)], dtype=torch.int64, device=device)
    for group in groups:
        size = dist.get_world_size(group)
        if size == 1:
            continue
        gathered = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(gathered, mine, group=group)
        if len({int(g) for g in gathered}) > 1:
            every: list[object] = [None] * size
            dist.all_gather_object(every, settings, group=group)
            ranks = dist.get_process_group_ranks(group)
            per_rank = "; ".join(f"rank {r}: {s}" for r, s in zip(ranks, every))
            raise ValueError(
                f"gradientflow.fsdp.fully_shard: ranks passed different settings for the same module ({per_rank}). "
                "Every rank must shard the same model with the same compression and quant_* options and mesh."
            )
