"""A user's model for the bench's ``--workload package.module:factory`` test (returns a tuple and a dict)."""

from __future__ import annotations

import torch
from torch import nn


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU())
        self.a, self.b = nn.Linear(32, 8), nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.body(x)
        return self.a(h), {"b": self.b(h), "ids": torch.zeros(len(x), dtype=torch.long)}


def build() -> nn.Module:
    return TwoHeads()
