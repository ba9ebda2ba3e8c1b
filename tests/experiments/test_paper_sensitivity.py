"""``experiments/paper_sensitivity.py``: the break-even of one assumption by hand, and one run through its command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from paper_sensitivity import break_even

from gradientflow.sim import ModelProfile, SimConfig

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
HAND = ModelProfile("hand", numels=(1000, 3000), order=(1, 0), ready=(1.0, 0.5), source="hand")
"""2 tensors, t(1) = 1 s (forward 0.5, backward 0.5): tests/test_sim.py's schedule by hand."""


def test_break_even_by_hand() -> None:
    # `ring` at 2 GPUs: after backward, one ring per tensor: t = 1 + 2 x 0.01 + 16000 B / B; speedup 2 / t
    cfg = SimConfig(bandwidth=1e5, latency=0.01, batch=1, gpu_images_per_s=1.0, backward_fraction=0.5)
    b = break_even(HAND, cfg, 2, "ring", 1.0, "bandwidth", 1e3, 1e6)  # speedup 1: t = 2 s
    assert b == pytest.approx(16000 / 0.98, rel=1e-6)
    assert break_even(HAND, cfg, 2, "ring", 1.99, "bandwidth", 1e3, 1e6) is None  # not reached in the range


def test_the_command_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "sensitivity"
    cmd = [sys.executable, str(EXPERIMENTS / "paper_sensitivity.py"), "--models", "alexnet", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "sensitivity.md").read_text()
    assert table.startswith("`python experiments/paper_sensitivity.py --models alexnet")
    assert "| alexnet 512 csc | 410.2x |" in table and (tmp_path / "sensitivity.json").exists()
