"""An existing DDP script, changed only in its import, gives torch DDP's result under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def run_example(tmp: Path, backend: str, *extra: str, max_restarts: int = 0, timeout: float = 240) -> dict:
    """``torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --backend B``; rank 0's json."""
    out = tmp / f"{backend}.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts), str(EXAMPLE), "--backend", backend, "--epochs", "2",
            "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    result["stdout"] = proc.stdout
    return result


def test_train_ddp_same_result_with_either_import(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    ref = run_example(tmp_path, "torch")
    ours = run_example(tmp_path, "gradientflow", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "10")
    assert ref["steps"] == ours["steps"] > 0
    # Dense fp32, the same summation of the same gradients: equal to 1e-5.
    assert abs(ref["loss"] - ours["loss"]) <= 1e-5, (ref["loss"], ours["loss"])
    for name, values in ref["params"].items():
        assert max(abs(a - b) for a, b in zip(values, ours["params"][name])) <= 1e-5, name
    assert (tmp_path / "ckpt" / "checkpoint.pt").exists()
