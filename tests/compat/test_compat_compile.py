"""``torch.compile`` of the wrapper and of the module inside it: eager's gradients, no recompiles; and as many
compiles as torch DDP for the same loop, gradient accumulation included, without a warning from Dynamo."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable

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


# ---- against torch DDP: the same compiles for the same loop ---------------------------------------
class _UserNet(nn.Module):
    """A model defined in user code (dynamo skips torch's own files, so inside torch DDP an ``nn.Sequential`` is not
    compiled at all); BatchNorm's buffers make the forward broadcast them, as torch DDP does after ``no_sync``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


STEPS, MICRO = 3, 3  # 3 optimizer steps of 3 micro-batches: 2 accumulated locally, the third synchronised


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _accumulate_worker(rank: int, world_size: int, wrapper: str, how: str, make: Callable[[], nn.Module]) -> dict:
    """``STEPS`` steps of gradient accumulation under ``torch.compile``: the backend's calls (one per graph
    compiled), what Dynamo warned or wrote to stderr, and the parameters after the loop.

    ``how``: ``"no_sync"`` (the first micro-batches inside ``model.no_sync()``) or ``"flag"`` (setting
    ``model.require_backward_grad_sync`` directly, as Lightning and accelerate do).  ``make``: the model.
    """
    import torch._dynamo

    torch._dynamo.reset()
    compiles = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    torch.manual_seed(0)
    wrap = nn.parallel.DistributedDataParallel if wrapper == "torch" else gf.DistributedDataParallel
    model = wrap(make())
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Dynamo warns through warnings.warn (its "does not know how to trace the builtin time.perf_counter", when the
    # wrapper's forward was traced) and logs through torch's own handlers, which write to file descriptor 2
    with tempfile.TemporaryFile() as err, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            for step in range(STEPS):
                for micro in range(MICRO):
                    x = batch(rank, step * MICRO + micro, (8, 6))
                    last = micro == MICRO - 1
                    if how == "flag":
                        model.require_backward_grad_sync = last
                    accumulate = model.no_sync() if how == "no_sync" and not last else contextlib.nullcontext()
                    with accumulate:
                        compiled(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return {
        "compiles": compiles,
        "warnings": [str(w.message) for w in warned],
        "stderr": stderr,
        "params": [
            p.detach().tolist() for p in model.module.parameters()
        ],  # a tensor would share an exited rank's memory
    }


@pytest.mark.parametrize("how", ["no_sync", "flag"])
def test_compiles_as_often_as_torch_ddp_under_gradient_accumulation(how: str) -> None:
    ref = run_distributed(_accumulate_worker, 2, "torch", how, _UserNet, timeout=180)
    ours = run_distributed(_accumulate_worker, 2, "gradientflow", how, _UserNet, timeout=180)
    for rank in range(2):
        # torch DDP compiles the user's forward once: its own forward is skipped by Dynamo (torch's files), so
        # require_backward_grad_sync and require_forward_param_sync guard nothing; the wrapper's must not either
        assert len(ref[rank]["compiles"]) == 1, ref[rank]["compiles"]
        assert ours[rank]["compiles"] == ref[rank]["compiles"], (ours[rank]["compiles"], ref[rank]["compiles"])
        assert ours[rank]["warnings"] == [], ours[rank]["warnings"]
        assert ours[rank]["stderr"] == "", ours[rank]["stderr"]
        # and the same training: each synchronised step averages the accumulated fp32 gradients of 2 ranks, and
        # halving is exact in fp32, so only the order of the two-term sum could differ (it cannot: a + b = b + a)
        assert ours[rank]["params"] == ref[rank]["params"]


def test_a_model_of_torchs_containers_compiles_once_where_torch_ddp_compiles_none() -> None:
    """An ``nn.Sequential`` inside torch DDP is not compiled at all: dynamo skips the frames of torch's own files,
    and torch DDP's forward calls the module from one.  The wrapper's forward is traced (its own work runs in
    disabled methods), so the module inside is compiled, once, ``no_sync`` micro-steps included."""
    ref = run_distributed(_accumulate_worker, 2, "torch", "no_sync", _sequential, timeout=180)
    ours = run_distributed(_accumulate_worker, 2, "gradientflow", "no_sync", _sequential, timeout=180)
    for rank in range(2):
        assert ref[rank]["compiles"] == [], ref[rank]["compiles"]
        assert len(ours[rank]["compiles"]) == 1, ours[rank]["compiles"]
        assert ours[rank]["warnings"] == [] and ours[rank]["stderr"] == "", ours[rank]
        assert ours[rank]["params"] == ref[rank]["params"]  # compiled or not, the same training (see above)
