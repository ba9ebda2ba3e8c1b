"""experiments/fewer_syncs_memory.py: the resident set each ``sync_every`` kind adds beside torch DDP's, and the
outer loop's exact count of what it holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_memory_script_measures_a_kind_beside_torch_ddp(tmp_path: Path) -> None:
    cmd = [sys.executable, "experiments/fewer_syncs_memory.py", "--size", "64x1", "--every", "2", "--repeats", "1"]
    # two launches (torch DDP and one kind): the counts of the other kinds are tested in tests/test_diloco.py
    cmd += ["--kinds", "diloco", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert list(runs) == ["torch", "diloco"], "torch DDP first: the reference"
    n = runs["torch"][0][0]["params"]
    residual = 4 * 128 * -(-n // 128)  # the 3-bit exchange's residual: the whole model (flat), whole blocks
    held = {kind: {r["state_bytes"] for r in launches[0]} for kind, launches in runs.items()}
    assert held == {"torch": {0}, "diloco": {8 * n + residual}}, "the anchor, the outer momentum, the residual"
    for launches in runs.values():
        assert all(r["peak_mb"] >= r["after_mb"] - 0.5 for r in launches[0]), "the peak is sampled over the steps"
    table = (tmp_path / "results.md").read_text()
    assert "| torch DDP |" in table and "| `diloco` " in table
