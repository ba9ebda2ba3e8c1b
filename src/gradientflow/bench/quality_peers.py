"""torch DDP's own ways to send less, as ``bench --quality`` recipes: their hooks and their bytes.

``ddp-fp16-hook`` (``fp16_compress_hook``), ``ddp-powersgd`` (``powerSGD_hook``, rank 4, error
feedback, dense for the first steps), ``ddp-postlocal`` (``post_localSGD_hook`` +
``PostLocalSGDOptimizer`` / ``PeriodicModelAverager``), each with the user's optimizer.  torch does
not report what its hooks send, so :func:`torch_peer_bytes` computes it.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

TORCH_PEERS = ("ddp-fp16-hook", "ddp-powersgd", "ddp-postlocal")
"""torch DDP's own ways to send less, with the user's optimizer: ``fp16_compress_hook``; PowerSGD
(rank 4, error feedback, 10 dense warm-up steps); post-local SGD (``PostLocalSGDOptimizer`` +
``PeriodicModelAverager``: local steps after 10 dense ones, parameters averaged every 8 steps)."""
POWERSGD_RANK = 4
POSTLOCAL_PERIOD = 8
TORCH_PEER_WARMUP = 10


def register_torch_hook(recipe: str, wrapped: nn.parallel.DistributedDataParallel) -> dict[str, Any]:
    """torch DDP's communication hook of a torch peer recipe (none for ``ddp``, ``ddp-sgd``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

    if recipe == "ddp-fp16-hook":
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return {"comm_hook": "fp16_compress_hook"}
    if recipe == "ddp-powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=TORCH_PEER_WARMUP,
            use_error_feedback=True,
            warm_start=True,
        )
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return {"comm_hook": f"powerSGD_hook(rank={POWERSGD_RANK}, start_iter={TORCH_PEER_WARMUP})"}
    if recipe == "ddp-postlocal":
        import torch.distributed as dist

        # Each rank is one node of the emulated cluster: no intra-node group to average in between.
        alone, _ = dist.new_subgroups(group_size=1)
        local_state = post_localSGD_hook.PostLocalSGDState(
            process_group=None, subgroup=alone, start_localSGD_iter=TORCH_PEER_WARMUP
        )
        wrapped.register_comm_hook(local_state, post_localSGD_hook.post_localSGD_hook)
        return {"comm_hook": f"post_localSGD_hook + PeriodicModelAverager(period={POSTLOCAL_PERIOD})"}
    return {}


def torch_peer_bytes(recipe: str, shapes: list[tuple[int, ...]], step: int) -> float:
    """Bytes one rank hands to collectives at 0-based ``step`` under a torch recipe (computed: torch
    does not report them).  ddp: 4 per gradient; fp16 hook: 2; PowerSGD after its dense steps: its P
    and Q factors (fp32, rank ``POWERSGD_RANK``) for matrices it compresses, 4 per element of the rest;
    post-local SGD after its dense steps: one fp32 parameter average every ``POSTLOCAL_PERIOD`` steps."""
    n = sum(math.prod(s) for s in shapes)
    if recipe == "ddp-fp16-hook":
        return 2.0 * n
    if recipe in ("ddp-powersgd", "ddp-postlocal") and step >= TORCH_PEER_WARMUP:
        if recipe == "ddp-postlocal":
            return 4.0 * n if (step - TORCH_PEER_WARMUP) % POSTLOCAL_PERIOD == 0 else 0.0
        total = 0
        for s in shapes:
            m, k = (s[0], math.prod(s[1:])) if len(s) > 1 else (1, math.prod(s))
            r = min(POWERSGD_RANK, m, k)
            # powerSGD_hook compresses a tensor only where it saves at least 2x (min_compression_rate)
            total += 4 * (m + k) * r if len(s) > 1 and (m + k) * r * 2 < m * k else 4 * m * k
        return float(total)
    return 4.0 * n
