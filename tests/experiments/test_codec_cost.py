"""experiments/codec_cost.py: it times the quantised recipe's codec beside the model's step and says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_codec_cost_writes_both_paths_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    cmd = [sys.executable, "experiments/codec_cost.py", "--size", "32x1", "--repeats", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["params"] > 0
    assert res["compute_ms"] > 0 and res["codec_ms"] > 0
    # where the C kernel builds, the torch ops it replaced are timed beside it
    assert "codec_torch_ops_ms" in res or "no C compiler" in proc.stderr
