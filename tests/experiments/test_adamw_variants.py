"""The AdamW experiments' pieces (``experiments/adamw_variants.py``): each one does what its README line says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_csc import CHUNK, _batch, _Ledger, _mlp, _residual, _sparse
from torch import nn

import gradientflow.strategies.csc as csc_module

from _dist import run_distributed
from adamw_variants import (
    VARIANTS,
    AgedSelection,
    ArrivalAdamW,
    FrozenSecondMomentAdamW,
    PredictorSync,
    _selection,
    per_tensor_selection,
    rotating_selection,
)

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def test_arrival_adamw_with_every_gradient_delivered_is_torch_adamw():
    torch.manual_seed(0)
    a = torch.randn(50, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    opts = [
        ArrivalAdamW([a], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1),
        torch.optim.AdamW([b], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1),
    ]
    for _ in range(6):
        g = torch.randn(50)
        g[g == 0] = 1.0  # a delivered gradient is nonzero
        a.grad, b.grad = g.clone(), g.clone()
        for o in opts:
            o.step()
    # the same formulas in a different order of fp32 operations: a few roundings per step
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_arrival_adamw_moves_only_on_arrival_and_scales_by_the_wait():
    plain, aged = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    opts = [
        ArrivalAdamW([plain], lr=0.1, betas=(0.5, 0.5), eps=0.0, weight_decay=0.0),
        ArrivalAdamW([aged], lr=0.1, betas=(0.5, 0.5), eps=0.0, weight_decay=0.0, scale_by_age=True),
    ]
    # element 0: gradient 2 at step 1, nothing at steps 2-3, gradient 1 at step 4; element 1: never
    for g0 in (2.0, 0.0, 0.0, 1.0):
        before = (plain.detach().clone(), aged.detach().clone())
        for p, o in zip((plain, aged), opts):
            p.grad = torch.tensor([g0, 0.0])
            o.step()
        if g0 == 2.0:  # the first arrival: bias-corrected m / sqrt(v) = 2 / 2 = 1, age 1
            assert plain[0].item() == pytest.approx(-0.1) and aged[0].item() == pytest.approx(-0.1)
        elif g0 == 0.0:  # no arrival, no weight decay: nothing moves
            assert torch.equal(plain.detach(), before[0]) and torch.equal(aged.detach(), before[1])
    # arrival 2 (t = 2): m = (0.25*2 + 0.5*1) / 0.75 = 4/3, v = (0.25*4 + 0.5*1) / 0.75 = 2
    step = 0.1 * (4 / 3) / 2**0.5
    assert plain[0].item() == pytest.approx(-0.1 - step)
    assert aged[0].item() == pytest.approx(-0.1 - 3 * step)  # it waited 3 steps
    assert plain[1].item() == 0.0 and aged[1].item() == 0.0


def test_arrival_adamw_decays_weights_every_step():
    p = torch.ones(3, requires_grad=True)
    opt = ArrivalAdamW([p], lr=0.1, weight_decay=0.5)
    for _ in range(4):
        p.grad = torch.zeros(3)
        opt.step()
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.95**4))


def test_rotating_selection_visits_every_chunk_once_per_round():
    assert rotating_selection(10, 3, 0).tolist() == [0, 1, 2]
    assert rotating_selection(10, 3, 3).tolist() == [0, 1, 9]  # 9, 10, 11 wrap to 9, 0, 1
    seen = torch.cat([rotating_selection(10, 3, s) for s in range(4)])  # ceil(10 / 3) steps
    assert sorted(set(seen.tolist())) == list(range(10))


def test_per_tensor_selection_takes_each_groups_share():
    scores = torch.tensor([5.0, 1.0, 4.0, 0.0, 9.0, 8.0, 7.0, 0.5, 0.1, 0.2])
    # k/n = 0.5: group [0, 4) gets 2 (5 and 4), group [4, 10) gets 3 (9, 8, 7)
    assert per_tensor_selection(scores, 5, [(0, 4), (4, 10)]).tolist() == [0, 2, 4, 5, 6]
    # the pool's top 5 would be 4, 5, 6, 0, 2 as well; at k = 2 every group still gets one
    assert per_tensor_selection(scores, 2, [(0, 4), (4, 10)]).tolist() == [0, 4]


def test_aged_selection_forces_or_boosts_chunks_that_waited():
    scores = torch.tensor([4.0, 3.0, 2.0, 1.0])
    force = AgedSelection("force", 2)
    assert force(scores, 2).tolist() == [0, 1]  # nothing waited yet: the top 2
    assert force(scores, 2).tolist() == [0, 1]  # chunks 2, 3 have waited 1 step
    assert force(scores, 2).tolist() == [2, 3]  # ... now 2 steps: they go first
    assert force(scores, 2).tolist() == [0, 1]  # 0, 1 waited 1 step only
    boost = AgedSelection("boost", 1)
    assert boost(scores, 1).tolist() == [0]
    # chunk 1 waited 1 step: 3 x 2 = 6 beats 4 x 1; chunk 2: 2 x 2 = 4 ties with chunk 0, 6 wins
    assert boost(scores, 1).tolist() == [1]
    # waited: chunk 0 1 step (8), chunk 2 2 steps (6), chunk 3 2 steps (3): chunk 0
    assert boost(scores, 1).tolist() == [0]


def test_frozen_second_moment_stops_after_its_steps():
    p = torch.zeros(3, requires_grad=True)
    opt = FrozenSecondMomentAdamW([p], freeze_from=2, lr=0.1, betas=(0.9, 0.95))
    seen = []
    for g in (1.0, 2.0, 5.0, 7.0):
        p.grad = torch.full((3,), g)
        opt.step()
        seen.append(opt.state[p]["exp_avg_sq"][0].item())
    # steps 1-2 update v as AdamW does (0.05 * 1, then 0.95 * 0.05 + 0.05 * 4); then it stays
    assert seen[0] == pytest.approx(0.05) and seen[1] == pytest.approx(0.95 * 0.05 + 0.2)
    assert seen[2] == seen[1] and seen[3] == seen[1]
    assert opt.state[p]["exp_avg"][0].item() != pytest.approx(0.0)  # the first moment goes on


def test_selection_rule_keeps_forced_chunks_and_is_undone():
    original = csc_module.select_chunks
    with _selection(lambda scores, k: rotating_selection(scores.numel(), k, 1)):
        # 10 scores, the last 2 forced (1-D parameters): the rule picks 3 of the first 8
        assert csc_module.select_chunks(torch.arange(10.0), 5, forced=2).tolist() == [3, 4, 5, 8, 9]
    assert csc_module.select_chunks is original


def _predictor_worker(rank: int, world_size: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [_batch(gen) for _ in range(steps)]
    # warmup_steps=3: step 0 dense (it seeds the estimates), steps 1-2 on the ramp, then density 0.25
    model = _sparse(_mlp(), warmup_steps=3)
    PredictorSync.adopt(model._gf_engine.sync, "predictor")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.module.parameters())
    ledger = _Ledger(params, world_size)
    unsent_fed = 0
    for x, y in batches:
        local = torch.autograd.grad(nn.functional.cross_entropy(model.module(x), y), params)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        ledger.add_local(local)
        ledger.add_applied()
        if model.comm_stats()["warmup"] == 0:  # a sparse step: count nonzeros beyond the sent chunks
            sent = model._gf_engine.sync.last_selected.numel()
            unsent_fed = max(unsent_fed, int(model.pool.buffers[0].ne(0).sum()) - CHUNK * sent)
        opt.step()
    # Nothing lost: sum(applied) + mean_r(v) == sum_t mean_r(g).  Per step the predictor adds one
    # rounding (v -= E; E is applied exactly) to the engine's two; E is a mean of gradients already
    # in A, so the engine's bound 2*T*eps*A becomes 3*T*eps*A.
    held = ledger.check(model, 3 * steps)

    # residual-decay: after one sparse step (no earlier residual) v is 0.95 x the plain run's
    runs = []
    for decay in (False, True):
        m = _sparse(_mlp())
        if decay:
            PredictorSync.adopt(m._gf_engine.sync, "decay")
        x, y = batches[0]
        nn.functional.cross_entropy(m(x), y).backward()
        runs.append(torch.cat(_residual(m, "v")))
    return {"held": held, "unsent_fed": unsent_fed, "decayed": torch.equal(runs[1], runs[0] * 0.95)}


def test_predictor_feeds_unsent_chunks_and_loses_nothing():
    for r in run_distributed(_predictor_worker, 2, 12):
        assert r["held"] > 0 and r["decayed"]
        assert r["unsent_fed"] > 0  # the optimizer saw gradient outside the sent chunks


def test_adamw_variants_end_to_end_tiny(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(EXPERIMENTS / "adamw_variants.py"),
        "--steps",
        "6",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == list(VARIANTS)
    ddp = rows[0]["val_loss"]
    assert all(r["ratio"] == pytest.approx(r["val_loss"] / ddp) for r in rows)
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {v} | {what} |" in table for v, what in VARIANTS.items())
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "1",
            str(EXPERIMENTS / "adamw_variants.py"),
            "--variants",
            "nope",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "unknown variants ['nope']" in bad.stderr
