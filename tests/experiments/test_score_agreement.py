"""``experiments/score_agreement.py``: the agreement measures by hand, and one short run through its command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from score_agreement import agreement

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def test_score_agreement_by_hand() -> None:
    C = 1024
    rows = torch.arange(1.0, 11.0)[:, None].expand(10, C).clone()  # chunk i: uniform i + 1
    assert agreement(rows) == {"overlap": 1.0, "mass": 1.0}  # uniform chunks: the estimate is exact
    # Chunk 0 gets 20 on every unsampled element: exact L1 20 * 896 = 17920, the largest by far, but
    # its sample still reads 1s.  k = ceil(0.1 * 10) = 1: exact sends chunk 0, sampled chunk 9.
    blind = rows[0].view(8, 128)
    blind[:, 16:] = 20.0
    assert agreement(rows) == {"overlap": 0.0, "mass": pytest.approx(10 * C / (128 + 17920), rel=1e-6)}  # fp32


def test_score_agreement_bench_end_to_end(tmp_path) -> None:
    cmd = [
        sys.executable,
        str(EXPERIMENTS / "score_agreement.py"),
        "--workloads",
        "resnet50",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (res,) = json.loads((tmp_path / "results.json").read_text())
    assert res["chunk_size"] == 32768 and res["n_chunks"] == 780 and len(res["per_step"]) == 2
    assert all(0 < s["overlap"] <= 1 and 0 < s["mass"] <= 1 for s in res["per_step"])
    assert res["exact_ms"] > 0 and res["sampled_ms"] > 0
    assert "| resnet50 | 780 x 32768 |" in (tmp_path / "table.md").read_text()
