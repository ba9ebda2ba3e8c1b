"""``torch.compile`` of the wrapper and of the module inside it: eager's gradients, no recompiles."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import gradientflow as gf

from _dist import run_distributed
from _oracle import batch


def _make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def _compile_worker(rank: int, world_size: int, where: str, backend: str) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    inner = _make()
    eager = gf.DistributedDataParallel(_make())
    if where == "inner":
        wrapper = compiled = gf.DistributedDataParallel(torch.compile(inner, backend=backend))
    else:
        wrapper = gf.DistributedDataParallel(inner)
        compiled = torch.compile(wrapper, backend=backend)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    graphs = []
    for step in range(5):
        for m, o in zip((eager, compiled), opts):
            o.zero_grad()
            m(batch(rank, step)).pow(2).mean().backward()
        # Hooks fired: every .grad is a view of the pool and holds the averaged gradient.
        for a, b in zip(eager.module.parameters(), inner.parameters()):
            assert b.grad.untyped_storage().data_ptr() == wrapper.pool.buffers[0].untyped_storage().data_ptr()
            torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5)
        for o in opts:
            o.step()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[0] >= 1, graphs  # compiled once, not once per step


@pytest.mark.parametrize("where", ["wrapper", "inner"])
def test_compile_aot_eager(where: str) -> None:
    run_distributed(_compile_worker, 2, where, "aot_eager", timeout=180)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_compile_inductor() -> None:
    run_distributed(_compile_worker, 2, "wrapper", "inductor", timeout=300)
