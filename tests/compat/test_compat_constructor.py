"""torch DDP's constructor, whole: same parameters, positions and defaults; each with its meaning."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradientflow as gf

from _dist import run_distributed


def test_signature_is_torch_ddps_plus_keyword_only_options() -> None:
    ours = inspect.signature(gf.DistributedDataParallel.__init__).parameters
    ref = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    names = list(ref)
    assert list(ours)[: len(names)] == names
    for name in names:
        assert ours[name].default == ref[name].default, name
        assert ours[name].kind == ref[name].kind, name
    extra = list(ours)[len(names) :]
    assert "fusion_threshold_mb" in extra and "density" in extra
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in extra)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _arguments_worker(rank: int, world_size: int) -> None:
    DDP = gf.DistributedDataParallel
    # Accepted, as DDP accepts them (positionally too: module, device_ids, output_device, dim).
    m = DDP(_net(), None, None, 0)
    assert m.device_ids is None and m.output_device is None and m.dim == 0
    for kw in (
        {"find_unused_parameters": True},
        {"gradient_as_bucket_view": True},
        {"static_graph": True},
        {"skip_all_reduce_unused_params": True},
        {"batched_grad_copy": True},
        {"init_sync": False},
        {"forward_sync_buffers": False},
    ):
        DDP(_net(), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        DDP(_net(), check_reduction=True)
    # bucket_cap_mb is θ.
    assert DDP(_net(), bucket_cap_mb=3).config.fusion_threshold_mb == 3
    assert DDP(_net(), bucket_cap_mb=3, fusion_threshold_mb=3).config.fusion_threshold_mb == 3
    assert DDP(_net()).config.fusion_threshold_mb == 25
    with pytest.raises(ValueError, match="bucket_cap_mb=3 and fusion_threshold_mb=5 disagree"):
        DDP(_net(), bucket_cap_mb=3, fusion_threshold_mb=5)
    # Buffers: the deprecated broadcast_buffers warns as in torch 2.13 and maps to forward_sync_buffers.
    with pytest.warns(FutureWarning, match="broadcast_buffers"):
        m = DDP(_net(), broadcast_buffers=False)
    assert m.broadcast_buffers is False and m.forward_sync_buffers is False
    assert DDP(_net(), forward_sync_buffers=False).broadcast_buffers is False
    # Devices: DDP's rule — device_ids/output_device only for a module on one accelerator.
    with pytest.raises(ValueError, match="device_ids"):
        DDP(_net(), device_ids=[0])
    with pytest.raises(ValueError, match="output_device"):
        DDP(_net(), output_device=0)
    # A 1-D device mesh is a process group; both together is ambiguous.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    assert DDP(_net(), device_mesh=mesh).process_group is not None
    with pytest.raises(ValueError, match="Cannot specify both process_group and device_mesh"):
        DDP(_net(), process_group=dist.group.WORLD, device_mesh=mesh)
    # What has no counterpart here says what to use instead.
    for kw, hint in (
        ({"mixed_precision": object()}, "comm_dtype"),
        ({"delay_all_reduce_named_params": [], "param_to_hook_all_reduce": None}, "_ddp_params_and"),
    ):
        with pytest.raises(ValueError, match=hint):
            DDP(_net(), **kw)
    # bucket_cap_mb_list: recorded as torch DDP does (the pool is cut by one threshold).
    assert DDP(_net(), bucket_cap_mb_list=[1, 2]).bucket_bytes_cap_list == [1 << 20, 2 << 20]
    # Modules DDP refuses (RuntimeError in torch: DDPValueError is both); sparse gradients alone (named).
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError, match="no parameter that requires a gradient"):
        DDP(frozen)
    sparse = nn.Sequential(nn.Embedding(10, 3, sparse=True))
    with pytest.raises(ValueError, match=r"only sparse gradients \('0\.weight'\)"):
        DDP(sparse)
    sparse._ddp_params_and_buffers_to_ignore = ["0.weight"]
    with pytest.raises(ValueError, match="no parameter that requires a gradient"):
        DDP(sparse)  # ignored, then nothing is left to train
    # Communication hooks run (tests/compat/test_compat_comm_hooks.py); a hook must be callable, as in torch.
    with pytest.raises(TypeError, match="must be callable"):
        DDP(_net()).register_comm_hook(None, 3)
    # Options of ours are validated up front.
    with pytest.raises(ValueError, match="density"):
        DDP(_net(), density=2.0)


def test_constructor_arguments() -> None:
    run_distributed(_arguments_worker, 2)


def _init_sync_worker(rank: int, world_size: int) -> list[bool]:
    """init_sync=True broadcasts rank 0's parameters and buffers; init_sync=False leaves them."""
    out = []
    for init_sync in (True, False):
        torch.manual_seed(rank)  # different weights on every rank
        net = _net()
        net[1].running_mean.fill_(rank)
        gf.DistributedDataParallel(net, init_sync=init_sync)
        w = net[0].weight.detach().clone()
        gathered = [torch.empty_like(w) for _ in range(world_size)]
        dist.all_gather(gathered, w)
        out.append(all(torch.equal(gathered[0], g) for g in gathered))
        assert float(net[1].running_mean[0]) == (0 if init_sync else rank)
    return out


def test_init_sync() -> None:
    assert run_distributed(_init_sync_worker, 2) == [[True, False]] * 2


def _ignore_worker(rank: int, world_size: int) -> None:
    """``_ddp_params_and_buffers_to_ignore``: those parameters keep their local gradient, as in DDP."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    net._ddp_params_and_buffers_to_ignore = ["1.weight"]
    model = gf.DistributedDataParallel(net)
    x = torch.full((2, 3), float(rank + 1))
    model(x).sum().backward()
    local = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    local.load_state_dict(net.state_dict())
    local(x).sum().backward()
    torch.testing.assert_close(net[1].weight.grad, local[1].weight.grad)  # not averaged
    assert not torch.equal(net[0].weight.grad, local[0].weight.grad)  # averaged


def test_params_to_ignore() -> None:
    run_distributed(_ignore_worker, 2)


def test_inputs_move_to_the_module_device_as_ddp() -> None:
    """With ``device_ids`` DDP moves inputs (nested, kwargs too) to the device; here on "meta" (no GPU)."""
    from collections import namedtuple
    from dataclasses import dataclass

    from gradientflow.engine.hooks import iter_tensors
    from gradientflow.wrapper.compat import move_to_device

    Pair = namedtuple("Pair", "a b")

    @dataclass
    class Batch:
        x: torch.Tensor
        name: str

    inputs = (
        {"img": torch.ones(2), "ids": [torch.zeros(1), "text", 3]},
        Pair(torch.ones(1), None),
        Batch(torch.ones(3), "b"),
    )
    moved = move_to_device(inputs, torch.device("meta"))
    tensors = list(iter_tensors(moved))
    assert len(tensors) == 4 and all(t.device.type == "meta" for t in tensors)
    assert moved[0]["ids"][1:] == ["text", 3] and isinstance(moved[1], Pair) and moved[2].name == "b"
    assert all(t.device.type == "cpu" for t in iter_tensors(inputs))  # the caller's objects are untouched
