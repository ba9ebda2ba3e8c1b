"""The planner knows the quantised recipe (issue 27): its bytes by hand, and what "auto" runs per optimizer."""

from __future__ import annotations

import json
import math

import pytest

from gradientflow.sim import ModelProfile, SimConfig, simulate
from gradientflow.sim.planner import THREE_BIT_SYSTEM, plan, recommendation
from gradientflow.sim.schedule import THREE_BIT

# Two tensors of 1000 and 3000 gradients, t(1) = 1 s, a 1 GB/s link (tests/test_sim.py's hand model).
HAND = ModelProfile("hand", numels=(1000, 3000), order=(1, 0), ready=(1.0, 0.5), source="hand")
CFG = SimConfig(bandwidth=1e9, latency=1e-5, batch=1, gpu_images_per_s=1.0, backward_fraction=0.5, theta_mb=0.0)


def test_quantized_bytes_and_time_by_hand():
    it = simulate(HAND, CFG, 2, "3bit", THREE_BIT)
    # 3 bits + one 2-byte scale per 128 gradients = 0.390625 bytes per gradient, per tensor (theta 0)
    assert it.bytes_per_gpu == math.ceil(3000 * 0.390625) + math.ceil(1000 * 0.390625)
    assert it.bytes_per_gpu / (4 * 4000) == pytest.approx(0.0977, abs=1e-3)
    assert it.collectives == 2
    # passes are free at the default pass rate; the last tensor (1000, ready at the end of backward)
    # goes on the wire at 1.0 s: 1e-5 + 2 * 1/2 * 391 B / 1 GB/s after it
    assert it.iteration_s == pytest.approx(1.0 + 1e-5 + 391 / 1e9)


def test_planner_lists_quantized_and_recommends_by_optimizer():
    rows = plan(HAND, CFG, [1, 4], densities=(0.1,))
    assert [r.system for r in rows if r.gpus == 4][-1] == THREE_BIT_SYSTEM
    adamw = recommendation(rows, "adamw")
    assert "4 GPUs, adamw" in adamw and THREE_BIT_SYSTEM in adamw and "1 GPUs" not in adamw
    assert 'gradientflow "topk-fp16" density 0.1' in recommendation(rows, "sgd")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        recommendation(rows, "lbfgs")


def test_planner_recommends_only_what_keeps_the_optimizers_quality_and_says_what_it_assumed(capsys):
    """``simulate --plan --optimizer adamw``: "topk-fp16" at density 0.01 is the fastest on this model and link,
    but with AdamW top-k was measured at 1.07-1.13x DDP's loss: the recommendation is "3bit", the
    speed-alone line says so, and the latency is stated as assumed with the measured 1 Gbit/s value."""
    from gradientflow.cli import main

    argv = ["simulate", "--model", "resnet50", "--bandwidth", "1gbit", "--gpu-images-per-s", "300"]
    argv += ["--gpus", "1,8", "--plan", "--optimizer", "adamw"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    recommended = [ln for ln in out.splitlines() if ln.startswith("- 8 GPUs, adamw:")]
    assert len(recommended) == 1 and THREE_BIT_SYSTEM in recommended[0] and "topk" not in recommended[0]
    assert 'fastest on speed alone is gradientflow "topk-fp16" density 0.01' in out
    assert "not measured to keep adamw's quality" in out and 'left out: "topk-fp16" (any density): 1.07-1.13x' in out
    latency = next(ln for ln in out.splitlines() if ln.startswith("Latency α:"))
    assert "assumed 50 µs" in latency and "423 µs" in latency
    assert main([*argv[:-1], "sgd", "--latency", "423us"]) == 0
    out = capsys.readouterr().out
    assert '- 8 GPUs, sgd: gradientflow "topk-fp16" density 0.1 (' in out and "given: --latency 423us" in out
    assert main([*argv[:-2], "--json"]) == 0  # no optimizer: speed alone, and the JSON says where α came from
    assert "assumed 50 µs" in json.loads(capsys.readouterr().out)["assumptions"]["latency_source"]


def test_the_measured_latency_is_the_one_fitted_and_documented():
    from pathlib import Path

    from gradientflow.sim.presets import MEASURED_LATENCY_1GBIT

    root = Path(__file__).resolve().parents[1]
    fitted = json.loads((root / "benchmarks/sim_validation/alpha_beta.json").read_text())["fits"]["native"]["alpha_s"]
    assert round(fitted * 1e6) == round(MEASURED_LATENCY_1GBIT.value * 1e6) == 423
    doc = (root / "docs/cost-model.md").read_text()
    assert "| Gloo native | 423 µs |" in doc and "--optimizer adamw" in doc
