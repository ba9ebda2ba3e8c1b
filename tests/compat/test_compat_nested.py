"""A DDP inside a DDP (issue 38, item 19: torch's ``test_ddp_static_graph_nested_types``), beside torch DDP.

torch's two reducers each average the same local gradients; densely, that is one average.  gradientflow's
outer wrapper shares the inner model's engine: the same gradients and parameters as torch's nest, step by
step, whichever of the two is called.  Where the two DDPs' results would differ (a compression recipe,
CSC, a communication hook) or two engines would write one ``.grad`` (torch's DDP inside or around), the
wrap is refused on construction, saying why.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradientflow as gf
from gradientflow.wrapper.torch_api import DoubleWrapError

from _dist import run_distributed
from _oracle import assert_same_grads, assert_same_params, batch


def _make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def _worker(rank: int, world_size: int) -> None:
    ref_inner = DDP(_make())
    ref_outer = DDP(ref_inner, static_graph=True)
    inner = gf.DistributedDataParallel(_make())
    outer = gf.DistributedDataParallel(inner, static_graph=True)
    assert list(outer.state_dict()) == list(ref_outer.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref_inner, inner)]
    step = 0
    # inner alone, outer, outer inside no_sync (the inner still synchronises, as torch's inner reducer does)
    for which in ("inner", "outer", "outer_no_sync", "outer", "inner"):
        for (i, o), opt in zip(((ref_inner, ref_outer), (inner, outer)), opts):
            opt.zero_grad()
            model = i if which == "inner" else o
            if which == "outer_no_sync":
                with o.no_sync():
                    model(batch(rank, step)).pow(2).sum().backward()
            else:
                model(batch(rank, step)).pow(2).sum().backward()
        assert_same_grads(ref_inner, inner, what=f"step {step} ({which})")
        for opt in opts:
            opt.step()
        assert_same_params(ref_inner, inner, what=f"step {step} ({which})")
        step += 1
    assert outer.comm_stats() == inner.comm_stats()  # one engine
    with pytest.raises(RuntimeError, match="nested"):
        outer.register_comm_hook(None, lambda s, b: b.buffer())
    # refused, saying why
    for inner_kw, outer_kw, why in (
        ({"comm_dtype": "fp16"}, {}, "the inner model's comm_dtype='fp16'"),
        ({}, {"density": 0.1}, "the outer's density=0.1"),
        ({}, {"compression": "quantized"}, "the outer's compression='3bit'"),
    ):
        with pytest.raises(DoubleWrapError, match=why):
            gf.DistributedDataParallel(gf.DistributedDataParallel(_make(), **inner_kw), **outer_kw)
    with pytest.raises(DoubleWrapError, match="torch's reducer and gradientflow's engine"):
        gf.DistributedDataParallel(DDP(_make()))
    with pytest.raises(DoubleWrapError):
        DDP(gf.DistributedDataParallel(_make()))


def test_nested_dense_ddps_train_as_torchs_nest() -> None:
    run_distributed(_worker, 2, timeout=180)
