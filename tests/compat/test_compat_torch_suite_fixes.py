"""The behaviours torch's own DDP tests found wrong (issue 29), each as user code beside torch DDP.

Every worker builds torch DDP and gradientflow around identical copies of a model on 2 Gloo ranks
(``_oracle.pair``), runs the same steps and compares; 1e-6: both sum the same fp32 values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradientflow as gf

from _dist import run_distributed
from _oracle import assert_same_grads, assert_same_params, batch, pair

# Both DDPs search for unused parameters, as torch DDP requires when some go without a gradient.
UNUSED = {"find_unused_parameters": True}


class Reassigns(nn.Module):
    """Rank 0 *reassigns* its buffer at every forward (a new tensor, not an in-place change)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("count", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + (1.0 + torch.distributed.get_rank())  # rank 0: +1, rank 1: +2
        return self.lin(x) + self.count


def _reassigned_buffer_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(Reassigns)
    for step in range(3):
        for m in (ref, ours):
            m(batch(rank, step)).sum().backward()
    # The forward adds after the broadcast: rank 0's value (1 per step) + this rank's own last increment.
    assert torch.equal(ours.module.count, ref.module.count), (ours.module.count, ref.module.count)
    # rank 0's count before the last forward (2), broadcast, plus this rank's own increment (1 or 2)
    assert ours.module.count.tolist() == [3.0 + rank] * 2


def _batchnorm_worker(rank: int, world_size: int) -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))

    ref, ours = pair(make)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        for m, o in zip((ref, ours), opts):
            m.train()
            o.zero_grad()
            m(batch(rank, step) * (1 + rank)).pow(2).mean().backward()  # different stats on each rank
            o.step()
    for m in (ref, ours):  # the validation loop: no grad, eval mode
        m.eval()
        with torch.no_grad():
            m(batch(rank, 99))
    # torch DDP broadcasts rank 0's buffers at the first no-grad forward after a training step
    for a, b in zip(ref.module.buffers(), ours.module.buffers()):
        assert torch.equal(a, b)
    mine = torch.cat([b.float().reshape(-1) for b in ours.module.buffers()])
    every = [torch.empty_like(mine) for _ in range(world_size)]
    torch.distributed.all_gather(every, mine)
    assert all(torch.equal(every[0], t) for t in every)  # the same running stats on every rank


def _undefined_grad_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(lambda: nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 1)), UNUSED, UNUSED)
    for step in range(2):
        for m in (ref, ours):
            out = m(batch(rank, step)).sum()
            torch._C._functions.UndefinedGrad()(out).backward()  # autograd produces no gradient at all
        assert_same_grads(ref, ours, what=f"step {step}")
        assert all(p.grad is None for p in ours.parameters())
    for m in (ref, ours):  # and a normal step afterwards still averages
        m(batch(rank, 5)).sum().backward()
    assert_same_grads(ref, ours, what="after")


class WithSparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.lin = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(idx))


def _sparse_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(WithSparse)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        idx = torch.tensor([[rank + step, 2 * rank + 1, 7]])
        for m, o in zip((ref, ours), opts):
            o.zero_grad()
            m(idx).sum().backward()
        gr, go = ref.module.emb.weight.grad, ours.module.emb.weight.grad
        assert go.is_sparse
        torch.testing.assert_close(go.to_dense(), gr.to_dense(), atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.module.lin.weight.grad, ref.module.lin.weight.grad, atol=1e-6, rtol=0)
        for o in opts:
            o.step()
    assert_same_params(ref, ours)


def _static_graph_worker(rank: int, world_size: int) -> None:
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 1), nn.Linear(6, 1)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.a(x) + (self.b(x) if use_b else 0)

    model = gf.DistributedDataParallel(Branch(), static_graph=True)
    model(batch(rank, 0), False).sum().backward()
    with pytest.raises(RuntimeError, match="Your training graph has changed in this iteration"):
        model(batch(rank, 1), True).sum().backward()
    model = gf.DistributedDataParallel(Branch(), static_graph=True)
    model(batch(rank, 0), True).sum().backward()
    with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration"):
        model(batch(rank, 1), False).sum().backward()
    assert "Expected to have finished" in model._get_ddp_logging_data()["error"]


def _double_wrap_worker(rank: int, world_size: int) -> None:
    ours = gf.DistributedDataParallel(nn.Linear(4, 1))
    with pytest.raises(RuntimeError, match="already a gradientflow"):
        nn.parallel.DistributedDataParallel(ours)
    # gradientflow in gradientflow, both dense: one engine (issue 38; tests/compat/test_compat_nested.py)
    assert gf.DistributedDataParallel(ours).comm_stats() == ours.comm_stats()
    with pytest.raises(RuntimeError, match="both average densely"):
        gf.DistributedDataParallel(gf.DistributedDataParallel(nn.Linear(4, 1), comm_dtype="fp16"))
    with pytest.raises(RuntimeError, match="would both write the same .grad"):
        gf.DistributedDataParallel(nn.parallel.DistributedDataParallel(nn.Linear(4, 1)))


BEHAVIOURS = [
    _reassigned_buffer_worker,
    _batchnorm_worker,
    _undefined_grad_worker,
    _sparse_worker,
    _static_graph_worker,
    _double_wrap_worker,
]


def _run_all(rank: int, world_size: int, checks: list) -> list[str]:
    """Every check on one pair of ranks (one spawn, not six); the names of those that failed."""
    import traceback

    failed = []
    for check in checks:
        try:
            check(rank, world_size)
        except Exception:  # noqa: BLE001 - reported by name below
            failed.append(f"{check.__name__}: {traceback.format_exc()[-1500:]}")
    return failed


def test_behaviours_found_by_torchs_ddp_suite() -> None:
    """Reassigned buffer broadcast; BatchNorm stats equal after train + validation; undefined gradient;
    sparse embedding as torch DDP; torch's static-graph errors; a double wrap raises where two DDPs would differ."""
    for failed in run_distributed(_run_all, 2, BEHAVIOURS):
        assert not failed, "\n".join(failed)
