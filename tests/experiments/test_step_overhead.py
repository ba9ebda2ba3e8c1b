"""``experiments/step_overhead.py``: one short launch through its command writes its table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def test_step_overhead_end_to_end(tmp_path: Path) -> None:
    cmd = [sys.executable, str(EXPERIMENTS / "step_overhead.py"), "--rounds", "1", "--steps", "2", "--warmup", "1"]
    cmd += ["--models", "mlp-6.5K", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["command"].startswith("python experiments/step_overhead.py --rounds 1")
    assert "| mlp-6.5K | 6,570 |" in (tmp_path / "table.md").read_text()
