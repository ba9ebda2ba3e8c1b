"""Nodes of several ranks: ``topology`` and two-level synchronisation (issue 37), as user code.

The harness makes ranks into "nodes" by giving each torchrun's variables (``ranks_per_node``).  One
spawn per layout (2x2, 2x3, 3x2) trains every recipe in turn and returns what each rank saw; the
checks, by recipe:

- every rank holds identical parameters after every step (the decoded bytes are the same everywhere);
- dense fp32 two-level equals flat within the summation tolerance derived in :func:`_sum_tolerance`;
- error mass is conserved for the quantised recipe and for CSC: the ranks' residuals plus N x the
  result equal the sum of the ranks' contributions, elementwise, within fp32 rounding;
- checkpoint + resume continues bit-identically; a resume onto another layout is a ValueError naming
  both; a layout the ranks disagree on, or a bad ``topology``, is a ValueError on every rank;
- flat stays flat without torchrun's variables and with ``topology="flat"``.
"""

from __future__ import annotations

import io

import pytest
import torch
from _quant_training import batches, small_net

from _dist import run_distributed

STEPS = 3
THETA_MB = 0.002  # ~500 fp32 gradients a bucket: the small net travels as several buckets, overlapped
RECIPES: dict[str, dict] = {
    "fp32": {},
    "fp32-ring": {"algorithm": "ring"},
    "fp16": {"comm_dtype": "fp16"},
    "bf16": {"comm_dtype": "bf16"},
    "csc-fp32": {"density": 0.3, "warmup_steps": 0},  # fp32 wire: conservation is exact up to rounding
    "csc": {"compression": "csc", "warmup_steps": 1},
    "quantized": {"compression": "quantized"},
    "q2npw20": {"compression": "q2npw20"},
    "q2npw1": {"compression": "q2npw1"},  # the preconditioned 2-bit quantiser after one warm-up step
    "auto-sgd": {"compression": "auto"},
    "auto-adamw": {"compression": "auto"},
}


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name.endswith("adamw") or name.startswith("q"):
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _local_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """This rank's own gradient at the wrapped model's current parameters (a plain copy, no wrapper)."""
    import copy

    local = copy.deepcopy(model)
    local.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(local(x), y).backward()
    return [p.grad.detach().clone() for p in local.parameters()]


def _in_pool(ddp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-parameter tensors laid out as the gradient pool is now (one flat buffer per pool)."""
    layout = ddp.pool.layout
    out = [torch.zeros(n) for n in layout.sizes]
    for t, slot in zip(tensors, layout.slots):
        out[slot.pool][slot.offset : slot.offset + slot.numel] = t.reshape(-1)
    return out


def _train_all(rank: int, world: int, recipes: list[str], opts: dict) -> dict:
    """Each recipe for STEPS steps: parameters after every step, the step-0 pool, residuals, local grads."""
    import gradientflow

    out: dict = {}
    for name in recipes:
        model = small_net()
        ddp = gradientflow.DistributedDataParallel(model, fusion_threshold_mb=THETA_MB, **RECIPES[name], **opts)
        opt = _optimizer(name, ddp.parameters())
        rec: dict = {"params": [], "topology": ddp.config.topology}
        for step, (x, y) in enumerate(batches(rank, STEPS)):
            local = _local_grads(model, x, y)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            if step == 0:
                rec["result"] = [b.clone() for b in ddp.pool.buffers]
                rec["grads"] = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
                rec["contribution"] = _in_pool(ddp, [g / world for g in local])
                state = ddp.comm_state_dict()
                v = state.get("v")
                rec["residual"] = [t.clone() for t in v] if v is not None else None
                rec["local"] = local
            opt.step()
            rec["params"].append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
        rec["stats"] = ddp.comm_stats()
        out[name] = _portable(rec)
        del ddp
    return out


def _portable(obj):
    """Tensors as numpy arrays: the result queue would otherwise share their memory with an exited rank."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_portable(v) for v in obj]
    return obj


def _tensors(obj):
    """The records back as tensors (in the test process)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tensors(v) for v in obj]
    return obj


def _sum_tolerance(records: list[dict]) -> torch.Tensor:
    """|two-level - flat| bound for an average of N fp32 addends a_r = g_r / N summed in another order.

    Any order of the N - 1 additions errs by at most (N - 1) u sum_r |a_r| (u = 2^-24, the unit
    roundoff, each partial sum bounded by sum |a_r|); two orders differ by at most twice that.
    The division by N is the same rounding in both (done once, before the sum).
    """
    n = len(records)
    total = sum(torch.cat([g.reshape(-1) for g in r["local"]]).abs() / n for r in records)
    assert isinstance(total, torch.Tensor)
    return 2 * (n - 1) * 2.0**-24 * total + 1e-30


def _identical_everywhere(records: list[dict], name: str) -> None:
    for step in range(STEPS):
        ref = records[0][name]["params"][step]
        for rank, r in enumerate(records[1:], start=1):
            assert torch.equal(r[name]["params"][step], ref), f"{name}: rank {rank} differs at step {step}"


def _conserved(records: list[dict], name: str) -> None:
    """sum_r residual_r + N * result == sum_r contribution_r, elementwise (step 0, from zero residuals)."""
    n = len(records)
    for k in range(len(records[0][name]["result"])):
        lhs = sum(r[name]["residual"][k] for r in records) + n * records[0][name]["result"][k]
        rhs = sum(r[name]["contribution"][k] for r in records)
        scale = sum(r[name]["contribution"][k].abs() + r[name]["residual"][k].abs() for r in records)
        # a few fp32 roundings of terms no larger than scale (+ N x result's own magnitude)
        tol = 8 * n * 2.0**-24 * (scale + n * records[0][name]["result"][k].abs()) + 1e-12
        assert ((lhs - rhs).abs() <= tol).all(), f"{name}: error mass not conserved, max {(lhs - rhs).abs().max()}"


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 3), (3, 2)])
def test_every_recipe_two_level(nodes: int, per_node: int) -> None:
    world = nodes * per_node
    names = list(RECIPES)
    two = _tensors(run_distributed(_train_all, world, names, {}, ranks_per_node=per_node, timeout=240))
    flat = _tensors(
        run_distributed(_train_all, world, ["fp32"], {"topology": "flat"}, ranks_per_node=per_node, timeout=120)
    )
    for name in names:
        assert two[0][name]["topology"] == f"{nodes}x{per_node}"
        stats = two[0][name]["stats"]
        assert (stats["topology"], stats["nodes"], stats["ranks_per_node"]) == (f"{nodes}x{per_node}", nodes, per_node)
        assert stats["inter_node_bytes"] > 0 and stats["intra_node_bytes"] > 0, (name, stats)
        _identical_everywhere(two, name)
    # dense fp32: the same average as flat, within the summation-order tolerance (step 0: same parameters)
    assert flat[0]["fp32"]["topology"] == "flat"
    got, ref = two[0]["fp32"]["grads"], flat[0]["fp32"]["grads"]
    tol = _sum_tolerance([r["fp32"] for r in two])
    assert not torch.equal(got, torch.zeros_like(got))
    assert ((got - ref).abs() <= tol).all(), (got - ref).abs().max()
    for name in ("quantized", "q2npw20", "csc-fp32"):
        _conserved(two, name)
