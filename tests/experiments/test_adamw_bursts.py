"""``experiments/adamw_bursts.py``: the burst arithmetic by hand, and one tiny run through its command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from adamw_bursts import burst_travel

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def test_adamw_burst_travel_is_the_geometric_series_by_hand():
    # betas (0.9, 0.95): each step (0.1 / sqrt(0.05)) * (0.9 / sqrt(0.95)) ** j, summed
    first, ratio = 0.1 / math.sqrt(0.05), 0.9 / math.sqrt(0.95)
    assert burst_travel(0.9, 0.95) == pytest.approx(first / (1 - ratio))
    assert burst_travel(0.9, 0.95) == pytest.approx(sum(first * ratio**j for j in range(2000)))
    assert burst_travel(0.0, 0.0) == 1.0  # no momentum: the burst is one step of size 1
    assert burst_travel(0.99, 0.9) == math.inf  # b1 >= sqrt(b2): m outlives sqrt(v)


def test_adamw_bursts_end_to_end_tiny(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(EXPERIMENTS / "adamw_bursts.py"),
        "--steps",
        "8",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["counted_steps"] == 4 and res["burst_travel_lr"] == pytest.approx(burst_travel(0.9, 0.95))
    # every element falls in exactly one band; 8 steps are all in the density ramp, so most are sent
    assert sum(b["elements"] for b in res["bands"]) == res["elements"] == 431_463
    assert all(b["v_gf_over_ddp"] > 0 and b["moved_gf_over_ddp"] > 0 for b in res["bands"])
    assert "| chunk sent on |" in (tmp_path / "table.md").read_text()
