"""``schedule="auto"`` (engine/schedule.py): the rule by hand, its determinism, and that every rank
derives the same schedule from rank 0's measurement (and still averages gradients as torch DDP does)."""

from __future__ import annotations

import math

import pytest
import torch

from gradientflow.config import GradientFlowConfig
from gradientflow.engine.schedule import LinkEstimate, adapt, plan

from _dist import run_distributed

MB = 2**20
LINK = LinkEstimate(alpha_s=1e-4, bulk_Bps=1e8)  # 0.1 ms per collective, 100 MB/s: 10 KB of transfer


def test_rule_by_hand():
    # ResNet-50-sized fp32 pool (100 MB) on an fp16 wire at density 0.1: a pool byte is 0.05 wire bytes.
    # θ_msg = 0.1 ms * 1e8 B/s / 0.05 (share) / 0.05 (wire per pool byte) = 4e6 B, under the 25 MB default
    s = plan(LINK, 100 * MB, 0.05, sparse=True)
    assert (s.fusion_threshold_mb, s.csc_scope, s.latency_bound) == (25.0, "slice", False)
    # a slower collective (2 ms): θ_msg = 8e7 B = 76.3 MB > the 50 MB half pool: latency-bound
    slow = plan(LinkEstimate(2e-3, 1e8), 100 * MB, 0.05, sparse=True)
    assert (slow.fusion_threshold_mb, slow.csc_scope, slow.latency_bound) == (math.inf, "global", True)
    # dense fp32 (1 wire byte per pool byte), 20 ms per collective: θ_msg = 2e-2 * 1e8 / 0.05 = 4e7 B
    # (38.1 MB) is over the default and under half the pool: buckets grow to pay for their messages
    mid = plan(LinkEstimate(2e-2, 1e8), 100 * MB, 1.0, sparse=False)
    assert mid.fusion_threshold_mb == pytest.approx(4e7 / MB) and mid.csc_scope == "slice"
    # a small dense model is latency-bound too, and keeps "slice" (no CSC): one collective
    tiny = plan(LINK, MB // 4, 1.0, sparse=False)
    assert (tiny.fusion_threshold_mb, tiny.csc_scope) == (math.inf, "slice")
    # pure: the same inputs give the same schedule, every time
    assert plan(LINK, 100 * MB, 0.05, True) == s
    with pytest.raises(ValueError, match="pool_bytes"):
        plan(LINK, 0, 1.0, False)


def test_adapt_reads_the_wire_from_the_config():
    cfg = GradientFlowConfig(comm_dtype="fp16", density=0.1, schedule="auto")
    new, s = adapt(cfg, LINK, 100 * MB)
    assert (new.fusion_threshold_mb, new.csc_scope) == (25.0, "slice") == (s.fusion_threshold_mb, s.csc_scope)
    assert new.schedule == "auto" and new.density == 0.1  # nothing else changes
    with pytest.raises(ValueError, match="schedule must be one of 'fixed', 'auto'"):
        GradientFlowConfig(schedule="fast")


def _auto_rank(rank: int, world: int) -> list[dict]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import gradientflow as gf

    out = []
    for density in (None, 0.1):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        ref.load_state_dict(net.state_dict())
        model = gf.DistributedDataParallel(net, density=density, warmup_steps=0, schedule="auto")
        oracle = TorchDDP(ref)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()
        oracle(x).square().mean().backward()
        grads = zip(net.parameters(), ref.parameters())
        out.append(
            {
                "link": (model.schedule.link.alpha_s, model.schedule.link.bulk_Bps),
                "theta": model.config.fusion_threshold_mb,
                "scope": model.config.csc_scope,
                "buckets": len(model._gf_engine.pool.layout.buckets),
                "same_as_ddp": all(torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7) for a, b in grads),
            }
        )
    dist.barrier()
    return out


def test_every_rank_derives_the_same_schedule():
    r0, r1 = run_distributed(_auto_rank, 2)
    for dense, (a, b) in zip((True, False), zip(r0, r1)):
        # rank 0's measurement, broadcast: the same float bits everywhere, so the same θ, scope, layout
        assert a["link"] == b["link"] and a["link"][0] > 0 and a["link"][1] > 0
        assert (a["theta"], a["scope"], a["buckets"]) == (b["theta"], b["scope"], b["buckets"])
        if dense:  # the schedule moves θ only: the averaged gradient is torch DDP's
            assert a["same_as_ddp"] and b["same_as_ddp"]
