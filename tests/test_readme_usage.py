"""The README's usage example, run as written: its code block, with a user's model and loader around
it, on 2 Gloo ranks under torchrun.  A user's first contact with the library is that block, so it ends
as a script must, with ``dist.destroy_process_group()``; the test's checks run just before that line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """\
import os
import torch
torch.manual_seed(0)  # the same initial model on every rank, as a user's script would have it
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
initial = [p.detach().clone() for p in model.parameters()]
gen = torch.Generator().manual_seed(int(os.environ["RANK"]))  # each rank its own data
loader = [(torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(30)]
"""

EPILOGUE = """\
import json
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(every, flat)
moved = any(not torch.equal(p.detach(), q) for p, q in zip(model.parameters(), initial))
if dist.get_rank() == 0:
    result = {"identical": all(torch.equal(every[0], t) for t in every), "moved": moved,
              "stats": {k: v if isinstance(v, str) else float(v) for k, v in model.comm_stats().items()}}
    with open(os.environ["GF_TEST_OUT"], "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
"""


def usage_block() -> str:
    """The first Python code block of the README's Usage section."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Usage") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under ## Usage"
    return match.group(1)


def test_readme_usage_example_trains_two_ranks_to_identical_models(tmp_path: Path) -> None:
    block = usage_block()
    assert "gf.DistributedDataParallel(" in block and "comm_stats()" in block  # the block this test is about
    body, last = block.rstrip("\n").rsplit("\n", 1)
    assert last == "dist.destroy_process_group()", f"the usage block must end by destroying the group: {last!r}"
    script = tmp_path / "usage.py"
    script.write_text(PRELUDE + body + "\n" + EPILOGUE)  # EPILOGUE gathers the models, then destroys the group
    out = tmp_path / "result.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GF_TEST_OUT": str(out)}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # every rank applied the same averaged (sparse) gradient: the models stay bit-identical, and they trained
    assert result["identical"] and result["moved"], result
    stats = result["stats"]
    # compression="auto" with SGD momentum: "topk-3bit" after the first step; the last of 30 steps is sparse (the
    # density ramp from dense reaches 0.3 at step 100: ~0.3 ** 0.29 of the chunks here, in 3-bit blocks)
    assert stats["compression"] == "topk-3bit" and stats["compression_auto"] == "SGD -> topk-3bit", stats
    assert 0 < stats["payload_bytes"] < stats["dense_bytes"], stats
    assert stats["host_syncs"] <= 1 and "exposed_seconds" in stats and "phase_score_s" in stats
    assert "payload_bytes" in proc.stdout  # the example's own print of comm_stats() on each rank
