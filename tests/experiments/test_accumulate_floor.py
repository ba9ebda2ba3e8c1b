"""``experiments/accumulate_floor.py``: one short run through its command on a small model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def test_accumulate_floor_times_each_pass_and_counts_its_bytes(tmp_path) -> None:
    cmd = [sys.executable, str(EXPERIMENTS / "accumulate_floor.py"), "--model", "tiny_transformer"]
    cmd += ["--repeats", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    n = result["parameters"]
    assert {"torch_add", "copy"} <= set(result["passes"])
    for name, row in result["passes"].items():
        assert len(row["samples_s"]) == 2 and row["ms"] > 0, name
        # GB/s is the bytes the pass moves (12 per parameter for an add, 8 for a copy) over its median time
        moved = (8 if name == "copy" else 12) * n
        assert abs(row["GBps"] - moved / (row["ms"] / 1e3) / 1e9) <= 1e-6 * row["GBps"]
    assert "| torch_add |" in (tmp_path / "table.md").read_text()
