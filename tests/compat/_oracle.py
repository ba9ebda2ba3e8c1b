"""Helpers of the compatibility suite: run torch DDP and gradientflow side by side on one rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import gradientflow as gf


def pair(make: Callable[[], nn.Module], ours_kw: dict | None = None, ref_kw: dict | None = None):
    """(torch DDP, gradientflow) around two identical copies of ``make()``."""
    torch.manual_seed(0)
    ref = nn.parallel.DistributedDataParallel(make(), **(ref_kw or {}))
    torch.manual_seed(0)
    ours = gf.DistributedDataParallel(make(), **(ours_kw or {}))
    return ref, ours


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def assert_same_grads(ref: nn.Module, ours: nn.Module, atol: float = 1e-6, what: str = "") -> None:
    """Same gradients, and ``None`` exactly where torch DDP leaves ``None``.

    1e-6: both sum the same fp32 values with Gloo; only the grouping of the sum may differ.
    """
    for (name, a), b in zip(ref.module.named_parameters(), ours.module.parameters()):
        assert (a.grad is None) == (b.grad is None), f"{what} {name}: DDP {a.grad is None=}, ours {b.grad is None=}"
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=atol, rtol=0, msg=f"{what} {name}")


def assert_same_params(ref: nn.Module, ours: nn.Module, atol: float = 1e-6, what: str = "") -> None:
    for (name, a), b in zip(ref.module.named_parameters(), ours.module.parameters()):
        torch.testing.assert_close(b, a, atol=atol, rtol=1e-5, msg=f"{what} {name}")


def batch(rank: int, step: int, shape: tuple[int, ...] = (4, 6)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * step + rank))
