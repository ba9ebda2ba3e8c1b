"""The ranks' agreement on a module's recipe at ``fully_shard``: one tiny all-gather per mesh dimension.

Every rank of an HSDP job must run the same recipe on the same module: a node quantising while its peer all-reduces
fp32 would pair mismatched messages (a hang, or garbage).  A fingerprint of the settings (recipe, quantiser, mesh,
the module's parameters) is all-gathered on the replicate group, then, with whether that group agreed, on the shard
group.  The mesh is a grid: the shard group is this rank's row, each of its members' replicate group a column, and
every column crosses the row; so after the two gathers every rank knows whether the whole mesh agrees, and all of
them know the same answer.  Only then does any rank raise: a rank that raised after the first gather would leave its
row's peers waiting in the second (Gloo's "Connection closed by peer" on them, not the error).

A rank whose own check refused an option takes part all the same, its error as its settings: every rank raises
that error, naming the ranks that passed the bad option.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

ERROR = "error: "
"""Prefix of the settings of a rank whose own check refused its options (the error's message follows)."""


def fingerprint(settings: str) -> int:
    return int.from_bytes(hashlib.sha256(settings.encode()).digest()[:7], "little")


def check_same(settings: str, groups: list[dist.ProcessGroup], device: torch.device) -> None:
    """``ValueError`` on every rank unless every rank of ``groups`` (the mesh's replicate group, then its shard
    group) passed the same ``settings``; settings ``ERROR + message`` (a rank's own refusal) raise that message on
    every rank, with the ranks that passed it."""
    agreed = not settings.startswith(ERROR)
    mine = torch.tensor([fingerprint(settings), int(agreed)], dtype=torch.int64, device=device)
    for group in groups:
        if dist.get_world_size(group) == 1:
            continue
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        agreed = all(int(g[1]) for g in gathered) and len({int(g[0]) for g in gathered}) == 1
        mine[1] = int(agreed)
    if agreed:
        return
    every: dict[int, str] = {dist.get_rank(): settings}  # every rank's settings, by the same two gathers
    for group in groups:
        if dist.get_world_size(group) == 1:
            continue
        parts: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, every, group=group)
        every = {r: s for part in parts if isinstance(part, dict) for r, s in part.items()}
    raise ValueError(_message(every))


def _message(every: dict[int, str]) -> str:
    errors = {r: s.removeprefix(ERROR) for r, s in every.items() if s.startswith(ERROR)}
    if errors:
        by_message: dict[str, list[int]] = {}
        for r in sorted(errors):
            by_message.setdefault(errors[r], []).append(r)
        if len(by_message) == 1 and len(errors) == len(every):
            return next(iter(by_message))  # every rank refused the same input: the error as each would raise it
        said = " ".join(f"{_ranks(ranks)}: {message}" for message, ranks in by_message.items())
        return f"gradientflow.fsdp.fully_shard refused the options of {said}"
    per_rank = "; ".join(f"rank {r}: {every[r]}" for r in sorted(every))
    return (
        f"gradientflow.fsdp.fully_shard: ranks passed different settings for the same module ({per_rank}). "
        "Every rank must shard the same model with the same compression and quant_* options and mesh."
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
