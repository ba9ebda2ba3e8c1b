"""The example scripts as a pip user runs them: copied out of the repository (examples/ is not in the wheel; the
README says to take them from a clone), run by torchrun from that folder, with nothing of the checkout importable
but the installed package.  One per door: the DDP wrapper with fewer syncs (``--sync-every``), and FSDP2 (HSDP)
``fully_shard`` beside torch's own on the same 2 x 2 mesh.  Short runs (1-2 epochs of the digits) with a timeout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_a_pip_user(
    tmp: Path, script: str, nproc: int, *args: str, tag: str = "", timeout: float = 240, nodes: int = 1
) -> dict:
    """``torchrun --standalone --nproc-per-node N SCRIPT ARGS --out result.json`` on a copy of ``examples/SCRIPT``
    in ``tmp``, from ``tmp``; rank 0's json, with its stdout.  ``nodes`` > 1: one torchrun per node on this machine
    (``--nnodes``, ``--node-rank``, a free port on 127.0.0.1), as the script's docstring says to launch it."""
    user = tmp / "user"
    user.mkdir(exist_ok=True)
    copy = Path(shutil.copy(EXAMPLES / script, user / script))
    assert not copy.resolve().is_relative_to(ROOT)
    # The installed package only: an editable install (CI's) or a PYTHONPATH to its src/; never the checkout's root,
    # its examples/ or tests/, where a helper the script should not need could be found.
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    assert all(Path(p).resolve() not in (ROOT, EXAMPLES, ROOT / "tests") for p in path), path
    out = user / f"result{tag}.json"
    # faulthandler: a rank that aborts (an exit that once ended in "terminate called without an active exception",
    # intermittently, after the FSDP example's destroy_process_group) prints every thread's stack into the report
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        launches = [[*run, "--standalone", "--nproc-per-node", str(nproc), script]]
    else:
        port = str(_free_port())
        launches = [
            [*run, "--nnodes", str(nodes), "--node-rank", str(n), "--nproc-per-node", str(nproc // nodes)]
            + ["--master-addr", "127.0.0.1", "--master-port", port, script]
            for n in range(nodes)
        ]
    procs = [
        subprocess.Popen(
            [*argv, *args, "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=user,
        )
        for argv in launches
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:  # a launch that outlived the timeout (or its peer's failure) is stopped, never left behind
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stdout[-3000:] + stderr[-10000:]  # torchrun's summary follows the rank's stacks
    return {**json.loads(out.read_text()), "stdout": outputs[0][0]}


DIGITS_MLP_PARAMETERS = 64 * 128 + 128 + 128 * 10 + 10
"""examples/train_ddp.py's MLP: 9,610 parameters, 76 blocks of 128 (75.08 rounded up)."""


def test_the_ddp_example_with_fewer_syncs(tmp_path: Path) -> None:
    """``--sync-every 10`` on 2 ranks: 2 epochs of the digits are 2 x 28 batches of 32 per rank = 56 steps, so 5
    outer syncs (after steps 10, ..., 50), each handing over the 76 blocks of 128 in 3 bits and a bf16 scale:
    76 * (128 * 3 / 8 + 2) = 3,800 bytes; nothing per step (one machine: the ranks are flat replicas)."""
    r = _as_a_pip_user(tmp_path, "train_ddp.py", 2, "--sync-every", "10", "--epochs", "2")
    stats = r["comm_stats"]
    assert r["steps"] == 56 and stats["sync_every"] == 10 and stats["outer_syncs"] == 5
    assert stats["outer_payload_bytes"] == 5 * 76 * (128 * 3 // 8 + 2) and -(-DIGITS_MLP_PARAMETERS // 128) == 76
    # what crossed between the replicas is the outer syncs' bytes (comm_stats' payload_bytes, as for every recipe)
    assert stats["payload_bytes"] == stats["outer_payload_bytes"] and stats["steps"] == 56
    assert r["loss"] < 0.5 * 2.303, r["loss"]  # learnt: chance is ln 10 = 2.303 (every step ends near 0.2 here)


def test_the_fsdp_example_beside_torchs_hsdp(tmp_path: Path) -> None:
    """``examples/train_fsdp.py`` on 2 nodes of 2 ranks (one torchrun each: a 2 x 2 mesh), one epoch (1,792 digits / (4
    x 32) = 14 steps), SGD: gradientflow's ``"auto"`` runs ``"4bit"`` between nodes after its dense step 0 (the
    policy's FSDP_SGD_RECIPE), handing over 4 bits and a bf16 scale per block of 128 of each shard: 4/32 + 16/(128 *
    32) = 0.1289 of fp32's bytes, more where a shard's last block is padded (the 5-element shards of the 10-element
    bias). torch's HSDP, the same script with torch's import, ends at the same loss to within 1e-3 (measured over
    200 steps, 3 seeds: 0.9995-1.0000x; docs/results/fsdp.md)."""
    from gradientflow.policy.auto_choice import FSDP_SGD_RECIPE

    ours = _as_a_pip_user(tmp_path, "train_fsdp.py", 4, "--epochs", "1", tag="-gf", nodes=2)
    torch_ = _as_a_pip_user(tmp_path, "train_fsdp.py", 4, "--epochs", "1", "--backend", "torch", nodes=2)
    assert ours["steps"] == torch_["steps"] == 14
    assert "on a 2x2 mesh" in ours["stdout"] and torch_["comm_stats"] is None
    last, total = ours["comm_stats"]["last"], ours["comm_stats"]["total"]
    assert last["compression"] == FSDP_SGD_RECIPE == "4bit" and (last["nodes"], last["ranks_per_node"]) == (2, 2)
    assert 4 / 32 + 16 / (128 * 32) <= last["payload_bytes"] / last["dense_bytes"] < 0.14, last
    # step 0 dense (fp32: payload = dense), then 13 steps of 4 bits
    assert total["payload_bytes"] == last["dense_bytes"] + 13 * last["payload_bytes"], total
    assert abs(ours["loss"] - torch_["loss"]) <= 1e-3 * torch_["loss"], (ours["loss"], torch_["loss"])
