"""Exit without ``destroy_process_group()``: N ``torchrun`` launches of the README's usage, count aborts.

``python -m gradientflow.bench.torch_suite.exit_check [--launches 20]``: the README's usage block
(a small model and loader around it, no destroy at the end) under ``torchrun --standalone
--nproc-per-node 2``; a launch fails when torchrun's exit status is not 0 or a rank printed
``terminate called`` (Gloo's abort at interpreter exit).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PRELUDE = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
gen = torch.Generator().manual_seed(int(__import__("os").environ["RANK"]))
loader = [(torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(5)]
"""


def usage_block(readme: Path) -> str:
    """The first Python code block of the README's Usage section, less its ``destroy_process_group()``
    line: the README shows the clean ending, this checks a script that forgets it."""
    text = readme.read_text()
    match = re.search(r"```python\n(.*?)```", text[text.index("## Usage") :], re.S)
    if match is None:
        raise ValueError(f"no python block under '## Usage' in {readme}")
    return "".join(line for line in match.group(1).splitlines(keepends=True) if "destroy_process_group" not in line)


def launch_without_destroy(block: str, launches: int, timeout: float = 180.0) -> list[tuple[int, str]]:
    """Run ``PRELUDE + block`` (which must not destroy the group) ``launches`` times; each launch's
    (exit status, output tail) where it failed, so an empty list means every launch exited cleanly."""
    if "destroy_process_group" in block:
        raise ValueError("the script under test must not call destroy_process_group()")
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "usage.py"
        script.write_text(PRELUDE + block)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for _ in range(launches):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
            output = proc.stdout + proc.stderr
            if proc.returncode != 0 or "terminate called" in output:
                failed.append((proc.returncode, output[-2000:]))
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradientflow torch-suite exit-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--readme", default="README.md")
    args = parser.parse_args(argv)
    failed = launch_without_destroy(usage_block(Path(args.readme)), args.launches)
    print(f"{args.launches - len(failed)}/{args.launches} launches exited cleanly without destroy_process_group()")
    for rc, tail in failed:
        print(f"--- exit status {rc}\n{tail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
