"""Mixed precision: fp16/bf16 on the wire, autocast + GradScaler, overflow handling."""

from __future__ import annotations

import torch
from torch import nn

import gradientflow as gf

from _dist import run_distributed


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def _data(rank: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    # A learnable task: the label is the argmax of a fixed random projection.
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(n, 20, generator=g)
    w = torch.randn(20, 5, generator=torch.Generator().manual_seed(99))
    return x, (x @ w).argmax(1)


def _one_step_worker(rank: int, world_size: int) -> dict[str, float]:
    x, y = _data(rank)
    ref = nn.parallel.DistributedDataParallel(_mlp())
    nn.functional.cross_entropy(ref(x), y).backward()
    errors = {}
    for dtype in ("fp16", "bf16"):
        ours = gf.DistributedDataParallel(_mlp(), comm_dtype=dtype, fusion_threshold_mb=0.01)
        nn.functional.cross_entropy(ours(x), y).backward()
        stats = ours.comm_stats()
        assert stats["payload_bytes"] * 2 == stats["dense_bytes"]  # 2-byte wire words
        errors[dtype] = max(
            ((a.grad - b.grad).norm() / a.grad.norm()).item()
            for a, b in zip(ref.module.parameters(), ours.module.parameters())
        )
    return errors


def test_half_precision_wire_gradients_match_fp32_ddp() -> None:
    for errors in run_distributed(_one_step_worker, 2):
        # One rounding to fp16 (11-bit significand, unit roundoff 2^-11 = 4.9e-4) per element
        # before the sum and one after: relative error <= ~1e-3.  bf16 has 8 bits: 2^-8 = 3.9e-3.
        assert errors["fp16"] <= 1e-3, errors
        assert errors["bf16"] <= 8e-3, errors


def _amp_worker(rank: int, world_size: int, steps: int, inject_at: int) -> dict[str, list[float]]:
    x, y = _data(rank, 256)
    ref = nn.parallel.DistributedDataParallel(_mlp())
    ours = gf.DistributedDataParallel(_mlp(), comm_dtype="fp16")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=20)
    curves: dict[str, list[float]] = {"ref": [], "ours": [], "scale": [], "skipped": []}
    for step in range(steps):
        batch = slice((step * 32) % 256, (step * 32) % 256 + 32)
        opt_ref.zero_grad()
        loss = nn.functional.cross_entropy(ref(x[batch]), y[batch])
        loss.backward()
        opt_ref.step()
        curves["ref"].append(loss.item())

        opt_ours.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ours(x[batch]), y[batch])
        scaled = scaler.scale(loss)
        if step == inject_at and rank == 1:
            scaled = scaled * float("inf")  # overflow on one rank only
        before = [p.detach().clone() for p in ours.parameters()]
        scaled.backward()
        scale = scaler.get_scale()
        scaler.step(opt_ours)
        scaler.update()
        skipped = all(torch.equal(a, p) for a, p in zip(before, ours.parameters()))
        curves["ours"].append(loss.item())
        curves["scale"].append(scale)
        curves["skipped"].append(float(skipped))
    return curves


def test_autocast_gradscaler_fp16_wire_tracks_fp32_ddp_and_skips_overflow_everywhere() -> None:
    steps, inject_at = 200, 50
    results = run_distributed(_amp_worker, 2, steps, inject_at, timeout=240)
    for curves in results:
        # The injected overflow is seen by every rank: the same step is skipped everywhere and
        # the scale backs off by half on every rank.
        assert curves["skipped"][inject_at] == 1.0
        assert curves["scale"][inject_at + 1] == curves["scale"][inject_at] / 2
        # 2-layer MLP, lr 0.1: the ref sees one more step than ours; fp16 autocast + fp16 wire
        # differ from fp32 by ~1e-3 relative per step and the gap compounds slowly (measured:
        # <= 0.012 nats).  The curves must agree to 0.03 nats averaged over windows of 20 steps,
        # while the loss itself falls from ~1.5 to ~0.25, i.e. 40x the allowed gap.
        ref, ours = torch.tensor(curves["ref"]), torch.tensor(curves["ours"])
        assert ref[-20:].mean() < 0.5 * ref[:20].mean()  # it did learn
        window_gap = (ref.view(-1, 20).mean(1) - ours.view(-1, 20).mean(1)).abs()
        assert window_gap.max() < 0.03, window_gap
    assert results[0]["scale"] == results[1]["scale"]
    assert results[0]["skipped"] == results[1]["skipped"]


def _fresh_vs_bound_worker(rank: int, world_size: int) -> None:
    x, y = _data(rank)
    for dtype in ("fp32", "fp16", "bf16"):
        model = gf.DistributedDataParallel(_mlp(), comm_dtype=dtype, fusion_threshold_mb=0.01)
        grads = {}
        for set_to_none in (False, True, False, True):
            model.zero_grad(set_to_none=set_to_none)
            nn.functional.cross_entropy(model(x), y).backward()
            grads.setdefault(set_to_none, []).append([p.grad.clone() for p in model.parameters()])
        # Step 2 re-lays the pool out (observed order); compare the steps after it, same inputs.
        for a, b in zip(grads[False][1], grads[True][1]):
            assert torch.equal(a, b), dtype


def test_division_folded_into_fresh_gradients_is_bit_identical() -> None:
    """From ``None`` gradients (``zero_grad()``'s default) each gradient is divided by the world size
    while it is copied into the pool (:meth:`DenseSync.take_fresh`); from zeroed gradients the launch
    divides the bucket.  Same inputs, 3 ranks (a division that is not a power of two): the averaged
    gradients are equal bit for bit, for every wire dtype — neither path divides twice or not at all."""
    run_distributed(_fresh_vs_bound_worker, 3)


def test_fp32_take_fresh_divides_as_divide_does_bit_for_bit() -> None:
    """The fp32 default's per-gradient division (:meth:`DenseSync.take_fresh`, by a 0-dim fp32 tensor:
    the step's hot path) gives the quotient :func:`divide` gives (by the Python int), bit for bit, for
    world sizes that are not powers of two and for zeros of both signs, infinities, NaN and denormals."""
    from gradientflow.comm.precision import divide
    from gradientflow.strategies.dense import DenseSync

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 10.0 ** torch.randint(-40, 39, (4096,), generator=g).float()
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-40, 3.4e38])
    for world_size in (2, 3, 5, 7, 12, 1000, 65537):
        sync = DenseSync(group=None, world_size=world_size, wire_dtype=None, algorithm="native")  # type: ignore[arg-type]
        ours, ref = torch.empty_like(x), torch.empty_like(x)
        assert sync.take_fresh(x, ours) is True
        divide(x, world_size, None, out=ref)
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), world_size
