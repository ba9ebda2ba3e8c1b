"""Uneven inputs with ``model.join()``: no hang, identical parameters, torch DDP's result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradientflow as gf

from _dist import run_distributed
from _oracle import batch


def _make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train_uneven(model: nn.Module, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(2 + 2 * rank):  # rank r has 2 + 2r batches
            opt.zero_grad()
            model(batch(rank, step)).pow(2).mean().backward()
            opt.step()
    return [t.detach().clone() for t in list(model.module.parameters()) + list(model.module.buffers())]


def _identical_on_all_ranks(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.double().flatten() for t in tensors])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return torch.equal(lo, hi)


def _join_worker(rank: int, world_size: int, kw: dict) -> None:
    ours = _train_uneven(gf.DistributedDataParallel(_make(), **kw), rank)
    assert _identical_on_all_ranks(ours)
    # Dense: joined ranks contribute zero and the mean divides by the initial world size, as in DDP
    # (compressed recipes are not torch DDP's numbers: identical ranks is their contract).
    if not kw.get("density") and not kw.get("compression"):
        ref = _train_uneven(nn.parallel.DistributedDataParallel(_make()), rank)
        for a, b in zip(ref, ours):
            torch.testing.assert_close(b.float(), a.float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_dense_matches_torch_ddp(world_size: int) -> None:
    run_distributed(_join_worker, world_size, {})


def test_join_with_per_step_checks() -> None:
    """Joined ranks take part in check_consistency / check_finite without tripping them."""
    run_distributed(_join_worker, 3, {"check_consistency": True, "check_finite": True})


@pytest.mark.parametrize("scope", ["global", "slice"])
def test_join_sparse_ends_identical(scope: str) -> None:
    run_distributed(_join_worker, 2, {"density": 0.5, "chunk_size": 8, "csc_scope": scope, "momentum": 0.5})


@pytest.mark.parametrize("kw", [{}, {"compression": "quantized"}], ids=["dense", "quantized"])
def test_join_two_level(kw: dict) -> None:
    """Nodes of 2 ranks (2x2, two-level): joined ranks' shadow steps take part in every stage; dense still
    gives torch DDP's result (within the summation order), the quantised recipe identical ranks."""
    run_distributed(_join_worker, 4, {"fusion_threshold_mb": 0, **kw}, ranks_per_node=2, timeout=180)
