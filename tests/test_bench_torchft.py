"""torchft's DiLoCo as a peer recipe of ``bench --quality`` (issue 59): a 2-rank loopback launch beside ddp."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradientflow.bench.quality import QualityOptions, plan_jobs
from gradientflow.bench.quality_recipes import parse_recipe

CLI = [sys.executable, "-m", "gradientflow.cli"]


def test_torchft_diloco_syncs_every_h_steps_beside_ddp(tmp_path):
    """Every rank its own replica group; after each sync (steps 2 and 4 at H=2) the replicas are bit-identical,
    and the computed bytes are 4 per parameter on those steps, none on the others."""
    # not skipped without torchft: CI installs it (the test extra); a missing one fails naming the extra
    h, steps = 2, 4
    args = ["bench", "--quality", "--workload", "tiny_transformer", "--nproc", "2", "--steps", str(steps)]
    averaging = f"torchft-diloco:sync_every={h},outer_lr=1,outer_momentum=0"
    ours = f"gf-auto:compression=none,sync_every={h},outer_compression=none"  # averaging through fp32, as that
    args += ["--recipes", "ddp", f"torchft-diloco:sync_every={h}", averaging, ours]
    args += ["--transformer-size", "32x1", "--batch-size", "4"]
    args += ["--eval-every", "2", "--bandwidth", "none", "--timeout", "90", "--out", str(tmp_path)]
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = json.loads((tmp_path / "raw-quality.json").read_text())["jobs"]
    runs = {r["recipe"]: r for r in job["runs"]}
    ft = runs[f"torchft-diloco:sync_every={h}"]
    assert ft["status"] == "ok" and len(ft["step_s"]) == steps, ft["error"]
    assert ft["options"]["sync_every"] == h and ft["options"]["outer_optimizer"].startswith("SGD(lr=0.7")
    first, second = ft["replica_params_sha1"]
    assert first == second  # identical after the last sync (step 4)
    assert len(set(runs["ddp"]["replica_params_sha1"])) == 1
    n = job["n_params"]
    assert [s["payload_bytes"] for s in ft["stats"]] == [4.0 * n if (i + 1) % h == 0 else 0.0 for i in range(steps)]
    rows = {
        r["recipe"]: r for r in json.loads((tmp_path / "results.json").read_text())["workloads"]["transformer"]["rows"]
    }
    assert rows[ft["recipe"]]["bytes_per_step"] == 4.0 * n / h and rows[ft["recipe"]]["bytes_source"] == "computed"
    # the outer SGD named in the recipe: lr 1 without momentum averages the replicas, as gradientflow's
    # sync_every does by default, here through fp32 on both sides: the same parameters
    avg = runs[averaging]
    assert avg["status"] == "ok" and avg["options"]["outer_optimizer"] == "SGD(lr=1, momentum=0, nesterov=False)"
    assert len(set(avg["replica_params_sha1"])) == 1
    assert avg["replica_params_sha1"] == runs[ours]["replica_params_sha1"] != ft["replica_params_sha1"]


def test_torchft_recipes_take_h_and_the_outer_sgd_and_are_trained_when_named():
    assert parse_recipe("torchft-diloco") == ("torchft-diloco", {})
    assert parse_recipe("torchft-diloco-quantized:sync_every=30") == ("torchft-diloco-quantized", {"sync_every": 30})
    averaging = parse_recipe("torchft-diloco:sync_every=10,outer_lr=1,outer_momentum=0")
    assert averaging == ("torchft-diloco", {"sync_every": 10, "outer_lr": 1.0, "outer_momentum": 0.0})
    for bad, says in (
        ("torchft-diloco:sync_every=0", ">= 1"),
        ("torchft-diloco:sync_every=2.5", "whole number"),
        ("torchft-diloco:outer_lr=0", "> 0"),
        ("torchft-diloco:outer_lr=fast", "> 0"),
        ("torchft-diloco:outer_momentum=1", r"in \[0, 1\)"),
        ("torchft-diloco:outer_compression=3bit", "sync_every=N, outer_lr=X, outer_momentum=X"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_recipe(bad)
    (job,), _ = plan_jobs(QualityOptions(workloads=["transformer"], bandwidth="none"))
    assert not any(r.startswith("torchft") for r in job.recipes)  # torchft is an extra: never a default
    named = ["torchft-diloco", "torchft-diloco:sync_every=30"]
    (job,), _ = plan_jobs(QualityOptions(workloads=["transformer"], recipes=named, bandwidth="none"))
    assert job.recipes == ["ddp", *named]
