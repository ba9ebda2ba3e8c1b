"""torch DDP's communication hooks on gradientflow, beside torch DDP with the same hook; option errors.

Each hook is torch's own (``torch.distributed.algorithms.ddp_comm_hooks``), registered on both
models; the gradients after every step must match torch DDP's.  Tolerance 1e-6 for the fp32
hooks (the same sums), 1e-5 for fp16 compression and PowerSGD (the same low-precision / low-rank
arithmetic on the same buckets; only the grouping of the sums may differ).
"""

from __future__ import annotations

import pathlib
import tempfile
import time

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

import gradientflow as gf

from _dist import run_distributed
from _oracle import assert_same_grads, assert_same_params, batch, pair


def _make() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _train_both(rank: int, ref: nn.Module, ours: nn.Module, steps: int, atol: float, what: str) -> None:
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, ours)]
    for step in range(steps):
        for m, o in zip((ref, ours), opts):
            o.zero_grad()
            m(batch(rank, step)).pow(2).mean().backward()
        assert_same_grads(ref, ours, atol=atol, what=f"{what} step {step}")
        for o in opts:
            o.step()
    assert_same_params(ref, ours, atol=atol, what=what)


def _allreduce_and_fp16_worker(rank: int, world_size: int) -> None:
    for hook, atol in ((default_hooks.allreduce_hook, 1e-6), (default_hooks.fp16_compress_hook, 1e-5)):
        ref, ours = pair(_make)
        ref.register_comm_hook(None, hook)
        ours.register_comm_hook(None, hook)
        _train_both(rank, ref, ours, 3, atol, hook.__name__)
        assert ours._get_ddp_logging_data()["comm_hook"] == hook.__qualname__


def _powersgd_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(_make)
    for m in (ref, ours):  # vanilla allreduce for 2 steps, then rank-1 compression with error feedback
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        m.register_comm_hook(state, powerSGD.powerSGD_hook)
    _train_both(rank, ref, ours, 5, 1e-5, "PowerSGD")


def _then_chain_worker(rank: int, world_size: int) -> None:
    """A user's hook: allreduce, then a ``then()`` that halves the sum's mean (DDP's GradBucket contract)."""
    seen = []

    def hook(state, bucket):  # noqa: ANN001, ANN202 - torch checks a hook's annotations: none, or unquoted ones
        seen.append((bucket.index(), bucket.is_last(), len(bucket.parameters()), len(bucket.gradients())))
        fut = torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / (2 * world_size))

    ref, ours = pair(_make)
    ref.register_comm_hook(None, hook)
    ours.register_comm_hook(None, hook)
    _train_both(rank, ref, ours, 2, 1e-6, "then-chain")
    assert seen[-1][1] and seen[-1][2] == seen[-1][3] == 4  # one bucket, the last, 4 parameters
    with pytest.raises(RuntimeError, match="only be called once"):
        ours.register_comm_hook(None, hook)
    with pytest.raises(ValueError, match="use one or the other"):
        gf.DistributedDataParallel(_make(), comm_dtype="fp16").register_comm_hook(None, hook)


def _options_worker(rank: int, world_size: int, tmp: str) -> float:
    model = gf.DistributedDataParallel(_make(), trace_path=pathlib.Path(tmp) / "trace{rank}.json", trace_steps=(0, 1))
    model(batch(rank, 0)).sum().backward()
    assert (pathlib.Path(tmp) / f"trace{rank}.json").exists()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="comm_dtype" if rank == 1 else "could not be built on rank 1"):
        gf.DistributedDataParallel(_make(), comm_dtype="fp8" if rank == 1 else "fp32")  # an error on rank 1 only
    return time.perf_counter() - t0


def _run_all(rank: int, world_size: int, tmp: str) -> float:
    _allreduce_and_fp16_worker(rank, world_size)
    _powersgd_worker(rank, world_size)
    _then_chain_worker(rank, world_size)
    return _options_worker(rank, world_size, tmp)


def test_comm_hooks_match_torch_ddp_and_option_errors_reach_every_rank() -> None:
    """allreduce/fp16/PowerSGD/then() hooks as torch DDP; PathLike trace_path; an option error on rank 1
    raises on both ranks within seconds (the process group's timeout is 60 s)."""
    with tempfile.TemporaryDirectory() as tmp:
        seconds = run_distributed(_run_all, 2, tmp)
    assert max(seconds) < 10, seconds
