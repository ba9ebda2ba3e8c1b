"""Run ``examples/train_ddp.py`` under torchrun (2 ranks, standalone rendezvous) and read its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"


def run_example(
    tmp: Path, backend: str, *extra: str, max_restarts: int = 0, tag: str = "", timeout: float = 240
) -> dict:
    """``torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --backend B ...``; rank 0's json."""
    out = tmp / f"{backend}{tag}.json"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(max_restarts),
        str(EXAMPLE),
        "--backend",
        backend,
        "--epochs",
        "2",
        "--out",
        str(out),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    result["stdout"] = proc.stdout
    return result
