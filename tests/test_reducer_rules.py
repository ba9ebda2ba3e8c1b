"""The reducer's rules, pinned in milliseconds: a recording fake strategy on a one-rank group.

The multi-process parity tests (tests/compat, tests/test_engine.py) show that the rules add up to torch
DDP's results; these name each rule on its own, in-process, with no collective on the step's path:

- buckets are handed over in bucket order, each once per synchronised backward, then ``finish`` once;
- ``divided`` is True only when every gradient of the bucket entered through ``take_fresh`` returning True
  (a backward from ``None`` gradients), False when autograd accumulated into bound ``.grad``;
- a backward from ``None`` gradients that leaves a parameter without gradient (``find_unused_parameters``) hands
  its bucket over with zeros in that parameter's place (what a bound pool would hold);
- a joined rank's shadow step launches every bucket with zeros and leaves ``.grad`` as the user left it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradientflow.config import GradientFlowConfig
from gradientflow.diagnostics.stats import StepStats
from gradientflow.diagnostics.watchdog import Watchdog
from gradientflow.engine.pool import Bucket, GradPool
from gradientflow.engine.protocol import SyncStrategy
from gradientflow.engine.reducer import Reducer


class Recorder(SyncStrategy):
    """Records every call the engine makes; "synchronises" by leaving the pool as it is (one rank)."""

    def __init__(self, divides: bool) -> None:
        self.divides = divides
        self.calls: list[tuple] = []

    def take_fresh(self, grad: torch.Tensor, out: torch.Tensor) -> bool:
        out.copy_(grad)
        return self.divides

    def launch(self, bucket: Bucket, flat: torch.Tensor, stats: StepStats, divided: bool = False) -> None:
        self.calls.append(("launch", bucket.index, divided, flat.clone()))

    def finish(self, stats: StepStats) -> None:
        self.calls.append(("finish",))

    def launches(self) -> list[int]:
        return [c[1] for c in self.calls if c[0] == "launch"]


@pytest.fixture
def group() -> Iterator[dist.ProcessGroup]:
    """A one-rank Gloo group for this test alone (no collective runs on a dense step without checks)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(f"{tmp}/store", 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _reducer(
    model: nn.Module, group: dist.ProcessGroup, divides: bool = True, find_unused: bool = False
) -> tuple[Reducer, Recorder]:
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    # θ of one byte: every parameter is a bucket of its own, so the order of launches is the order of buckets
    config = GradientFlowConfig(fusion_threshold_mb=1e-6).resolved(sum(p.numel() for p in params), params[0].device)
    recorder = Recorder(divides)
    watchdog = Watchdog(group, timedelta(seconds=30))
    make = lambda pool, shapes: recorder  # noqa: E731
    reducer = Reducer(params, names, config, group, watchdog, None, False, None, make, find_unused=find_unused)
    return reducer, recorder


def _step(model: nn.Module, reducer: Reducer, x: torch.Tensor, use_last: bool = True) -> None:
    out = model(x) if use_last else model[:3](x)
    reducer.arm(out, sync=True)
    out.sum().backward()


def test_buckets_are_launched_in_order_once_then_finish_once(group: dist.ProcessGroup) -> None:
    model = _model()
    reducer, rec = _reducer(model, group)
    n_buckets = len(reducer.pool.layout.buckets)
    assert n_buckets == 6  # one per parameter at θ of one byte
    _step(model, reducer, torch.randn(3, 4))
    assert rec.launches() == list(range(n_buckets))
    assert [c[0] for c in rec.calls].count("finish") == 1 and rec.calls[-1] == ("finish",)


def test_divided_only_when_every_gradient_entered_through_take_fresh(group: dist.ProcessGroup) -> None:
    model = _model()
    reducer, rec = _reducer(model, group, divides=True)
    x = torch.randn(3, 4)
    _step(model, reducer, x)  # from None gradients: each is moved in through take_fresh, which divides
    assert all(c[2] for c in rec.calls if c[0] == "launch")
    rec.calls.clear()
    _step(model, reducer, x)  # .grad kept (no zero_grad): bound to the pool, autograd adds in place
    assert not any(c[2] for c in rec.calls if c[0] == "launch")

    model2 = _model()
    reducer2, rec2 = _reducer(model2, group, divides=False)  # a strategy that only copies
    _step(model2, reducer2, x)
    assert not any(c[2] for c in rec2.calls if c[0] == "launch")


def test_a_missing_gradient_is_launched_as_zeros(group: dist.ProcessGroup) -> None:
    """With ``find_unused_parameters=True`` the backward ends the step (without it, as torch's reducer, the step
    stays open for a further backward of the same forward: tests/compat/test_compat_multi_backward.py)."""
    model = _model()
    reducer, rec = _reducer(model, group, find_unused=True)
    last = {id(model[4].weight), id(model[4].bias)}
    slots = {i for i, p in enumerate(reducer.params) if id(p) in last}
    buckets = reducer.pool.layout.buckets  # the layout launched (the pool is re-laid after the first step)
    _step(model, reducer, torch.randn(3, 4), use_last=False)  # the last layer gets no gradient
    launched = {c[1]: c[3] for c in rec.calls if c[0] == "launch"}
    assert sorted(launched) == list(range(len(buckets)))  # every bucket still goes out
    for b in buckets:
        if set(b.params) <= slots:
            assert torch.count_nonzero(launched[b.index]) == 0
        else:
            assert torch.count_nonzero(launched[b.index]) > 0


def test_shadow_step_launches_zeros_and_keeps_grad_none(group: dist.ProcessGroup) -> None:
    model = _model()
    reducer, rec = _reducer(model, group)
    reducer.shadow_step()
    launched = [c for c in rec.calls if c[0] == "launch"]
    assert [c[1] for c in launched] == list(range(len(reducer.pool.layout.buckets)))
    assert all(torch.count_nonzero(c[3]) == 0 for c in launched)
    assert rec.calls[-1] == ("finish",)
    assert all(p.grad is None for p in model.parameters())  # the user's None stays None, as torch DDP


def test_the_pool_holds_every_gradient(group: dist.ProcessGroup) -> None:
    """``.grad`` is a view of the pool after a step: the strategy's result is what the optimizer reads."""
    model = _model()
    reducer, _ = _reducer(model, group)
    _step(model, reducer, torch.randn(3, 4))
    pool: GradPool = reducer.pool
    for i, p in enumerate(reducer.params):
        assert p.grad is not None and p.grad.data_ptr() == pool.views[i].data_ptr()
