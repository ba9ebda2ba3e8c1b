"""The small model and batches the quantised recipe's training tests use (as a user's script would)."""

from __future__ import annotations

import torch
from torch import nn


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(steps)]
