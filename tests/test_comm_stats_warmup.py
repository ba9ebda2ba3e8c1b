"""``comm_stats()`` says when a CSC step is on the warm-up ramp (``warmup_ramp``), beside ``warmup``
(the step was sent dense) and ``density`` (the fraction it sent)."""

from __future__ import annotations

import torch
from torch import nn

import gradientflow as gf

from _dist import run_distributed

DENSITY, RAMP = 0.25, 4


def _ramp_worker(rank: int, world_size: int) -> list[dict[str, float]]:
    torch.manual_seed(0)
    # 64 x 64 weights in chunks of 64: 4 KB fp32 chunks, so a 0.71 ramp step is no longer sent dense
    model = gf.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)),
        density=DENSITY,
        chunk_size=64,
        warmup_steps=RAMP,
    )
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(RAMP + 2):
        model.zero_grad()
        model(torch.randn(8, 64, generator=gen)).square().mean().backward()
        out.append({k: model.comm_stats()[k] for k in ("warmup", "warmup_ramp", "density")})
    return out


def test_comm_stats_names_the_warmup_ramp():
    for stats in run_distributed(_ramp_worker, 2, timeout=90):
        # step 0: dense, on the ramp; steps 1-3: sparse at 0.25 ** (t / 4), still on the ramp; then 0.25
        assert stats[0] == {"warmup": 1, "warmup_ramp": 1, "density": 1.0}
        for t in range(1, RAMP):
            assert stats[t] == {"warmup": 0, "warmup_ramp": 1, "density": DENSITY ** (t / RAMP)}
        assert stats[RAMP:] == [{"warmup": 0, "warmup_ramp": 0, "density": DENSITY}] * 2
