"""``experiments/csc_outside_harness.py``: one short run through its command (every mode, the baseline export)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def test_outside_harness_end_to_end(tmp_path) -> None:
    cmd = [sys.executable, str(EXPERIMENTS / "csc_outside_harness.py"), "--baseline", "HEAD"]
    cmd += ["--steps", "2", "--warmup", "1", "--repeats", "1", "--out", str(tmp_path)]
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "1"}  # dropped for the ranks: they run on glibc's defaults
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert list(result["runs"]) == ["compute", "gf", "gf@base", "ddp"] and result["baseline"] == "HEAD"
    for mode, runs in result["runs"].items():
        (run,) = runs
        assert len(run["steps"]) == 2, mode
        assert all(s["wall_ms"] > 0 and s["cpu_ms"] > 0 and s["minflt"] >= 0 for s in run["steps"]), mode
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {m} |" in table for m in result["runs"])
