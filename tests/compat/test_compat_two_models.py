"""Two wrapped models in one backward (CLIP's two towers, an encoder and a decoder wrapped apart), and a collective of
the model's own in backward (SyncBatchNorm's pattern), as with torch DDP.

torch DDP issues every collective from autograd's hooks, so the two models' allreduces interleave in the same order
on every rank. gradientflow's compressed recipes also issue work when messages arrive (CSC: a slice's chunks once
its scores are in; the quantised ring: its second round once its first is in), at moments that differ from rank to
rank: on a shared group one rank would issue model A's exchange before model B's and another after, and the backend
matches messages in the order they were issued (Gloo: "Received data size doesn't match", or a hang). The same for
a collective the model itself issues on the user's group in backward (SyncBatchNorm does; it needs a GPU, so a
module of ours does the same here). So each wrapper exchanges on a group of its own, with a waiter thread of its
own (found with these tests: before, every two-model case under a compressed recipe aborted or hung once one
rank was late, and so did CSC beside the model's own collective).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradientflow as gf

from _dist import run_distributed
from _oracle import assert_same_grads

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


def _tower() -> nn.Module:
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])


def _loss(a: nn.Module, b: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One loss through both models: their hooks run interleaved in one backward."""
    return (a(x) * b(x.flip(1))).mean() + a(x).square().mean()


def _torch_worker(rank: int, world_size: int) -> None:
    models = []
    for ddp in (nn.parallel.DistributedDataParallel, gf.DistributedDataParallel):
        torch.manual_seed(0)
        models.append((ddp(_tower()), ddp(_tower())))
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randn(8, 32, generator=gen)
        for a, b in models:
            a.zero_grad()
            b.zero_grad()
            _loss(a, b, x).backward()
        (ref_a, ref_b), (ours_a, ours_b) = models
        assert_same_grads(ref_a, ours_a, what=f"step {step} model A")
        assert_same_grads(ref_b, ours_b, what=f"step {step} model B")


def test_two_models_in_one_backward_get_torch_ddps_gradients() -> None:
    run_distributed(_torch_worker, 2, timeout=120)


def _late_rank_worker(rank: int, world_size: int, kw: dict, kind: str = "cpu") -> list[list[float]]:
    device = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")  # every rank on the one GPU (Gloo)
    torch.manual_seed(0)
    a, b = (gf.DistributedDataParallel(_tower().to(device), **kw) for _ in range(2))
    if rank == 0:  # rank 0 dawdles inside both backwards: its exchanges' messages arrive before it goes on
        for m in (a, b):
            m.module[3].register_full_backward_hook(lambda *_: time.sleep(0.05))
    opt = torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        _loss(a, b, torch.randn(8, 32, generator=gen).to(device)).backward()
        opt.step()
    for m in (a, b):
        stats = m.comm_stats()
        assert stats["payload_bytes"] < stats["dense_bytes"], stats  # the recipe ran, compressed
    return [p.detach().reshape(-1).tolist() for p in (*a.parameters(), *b.parameters())]


@pytest.mark.parametrize(
    ("world_size", "kw"),
    [
        (2, {"density": 0.25, "chunk_size": 128, "warmup_steps": 0, "fusion_threshold_mb": 0.001}),
        (3, {"compression": "cscq", "chunk_size": 128, "warmup_steps": 0, "fusion_threshold_mb": 0.001}),
        (3, {"compression": "quantized", "fusion_threshold_mb": 0.001}),
        (4, {"compression": "quantized", "fusion_threshold_mb": 0.001, "topology": "2x2"}),
        (3, {"compression": "auto", "fusion_threshold_mb": 0.001}),  # AdamW: the quantised recipe from step 1
        (3, {"comm_dtype": "fp16", "fusion_threshold_mb": 0.001}),
    ],
    ids=["csc-2", "cscq-3", "quantized-3", "quantized-2x2", "auto-3", "fp16-3"],
)
@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_two_models_in_one_backward_stay_in_step_with_one_rank_late(world_size: int, kw: dict, kind: str) -> None:
    """Every rank ends with the same parameters, bit for bit, under a compressed recipe (on a GPU where there is one:
    the bytes staged through the host for Gloo)."""
    results = run_distributed(_late_rank_worker, world_size, kw, kind, timeout=120)
    for other in results[1:]:
        assert other == results[0]


class _AllReduceInBackward(torch.autograd.Function):
    """Identity forward; backward sums the incoming gradient over the default group (as SyncBatchNorm's backward
    all-reduces its statistics' gradients), issued from autograd in the same order on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 — autograd's context
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class _SyncedTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = _tower()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(_AllReduceInBackward.apply(x) if i in (2, 4) else x)
        return x


def _own_collective_worker(rank: int, world_size: int, kw: dict) -> list[list[float]]:
    torch.manual_seed(0)
    model = gf.DistributedDataParallel(_SyncedTower(), **kw)
    if rank == 0:
        model.module.layers[3].register_full_backward_hook(lambda *_: time.sleep(0.05))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 32, generator=gen)).square().mean().backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


@pytest.mark.parametrize(
    ("world_size", "kw"),
    [
        (2, {"density": 0.25, "chunk_size": 128, "warmup_steps": 0, "fusion_threshold_mb": 0.001}),
        (3, {"compression": "quantized", "fusion_threshold_mb": 0.001}),
    ],
    ids=["csc-2", "quantized-3"],
)
def test_a_collective_of_the_model_in_backward_stays_in_step_with_one_rank_late(world_size: int, kw: dict) -> None:
    """CSC failed before its exchanges had a group of their own; the quantised ring's point-to-point messages are
    matched apart from Gloo's collectives, so that case passed before too (kept: it is the recipe's contract)."""
    results = run_distributed(_own_collective_worker, world_size, kw, timeout=120)
    for other in results[1:]:
        assert other == results[0]
