"""``isinstance(model, torch.nn.parallel.DistributedDataParallel)`` holds for gradientflow's wrapper
(issue 38, item 20), and what torch's class could have leaked does not: user code as written for torch DDP."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradientflow as gf
from gradientflow.wrapper.torch_api import DoubleWrapError
from gradientflow.wrapper.torch_class import KEPT, TorchDDPClass

from _dist import run_distributed
from _oracle import batch, pair


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def unwrap(model: nn.Module) -> nn.Module:
    """What user scripts and saving helpers write."""
    return model.module if isinstance(model, DDP) else model


def _worker(rank: int, world_size: int) -> None:
    ref, ours = pair(Net)
    assert isinstance(ours, DDP) and isinstance(ours, gf.DistributedDataParallel)
    assert not isinstance(ref, gf.DistributedDataParallel)
    # state dicts: torch DDP's keys, and the unwrapped model's without the prefix
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert list(unwrap(ours).state_dict()) == list(Net().state_dict())
    ours.load_state_dict(ref.state_dict())
    unwrap(ours).load_state_dict(unwrap(ref).state_dict())
    # torch.distributed.checkpoint's FQNs drop DDP's `module.` (it tests isinstance(DDP))
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415

    assert list(get_model_state_dict(ours)) == list(get_model_state_dict(ref)) == list(Net().state_dict())
    # torch's internals are not inherited: missing, as on any module
    for name in ("_pre_forward", "_post_forward", "_sync_buffers", "scatter", "gather", "to_kwargs"):
        assert not hasattr(ours, name), name
    with pytest.raises(AttributeError, match="_check_reducer_finalized"):
        ours._check_reducer_finalized()
    assert ours.train() is ours and ours.training and ours.eval() is ours and not ours.training
    assert DDP._get_active_ddp_module() is None  # dynamo's DDPOptimizer is not engaged by gradientflow
    assert repr(ours).startswith("DistributedDataParallel(")
    # it still trains beside torch DDP, also after a deepcopy (torch DDP's __setstate__ never runs)
    ours.train()
    twin = copy.deepcopy(ours)
    assert isinstance(twin, DDP)
    for m in (ref, ours, twin):
        m(batch(rank, 0)).sum().backward()
    for a, b, c in zip(ref.parameters(), ours.parameters(), twin.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(c.grad, a.grad, atol=1e-6, rtol=0)
    # torch DDP still refuses to wrap it (it would average twice)
    with pytest.raises(DoubleWrapError):
        DDP(ours)


def test_isinstance_torch_ddp_and_unwrapping() -> None:
    run_distributed(_worker, 2, timeout=120)


def test_every_torch_ddp_attribute_is_gradientflows_or_absent() -> None:
    """A torch release that adds a method to its DDP class: the method is absent here (TorchDDPClass) unless
    gradientflow defines it; none runs torch's code on gradientflow's state."""
    own = set()
    for cls in gf.DistributedDataParallel.__mro__:
        if cls is TorchDDPClass:
            break
        own |= set(vars(cls))
    for name in vars(DDP):
        if name.startswith("__") and name.endswith("__"):
            assert name not in ("__getstate__", "__setstate__", "__init__") or name in own, name
            continue
        assert name in own or name in KEPT or isinstance(vars(TorchDDPClass)[name], object), name
        if name not in own and name not in KEPT:
            assert not hasattr(gf.DistributedDataParallel, name), name
