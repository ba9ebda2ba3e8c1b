"""The benches' FSDP2 / HSDP modes (issue 58): torch's HSDP and gradientflow.fsdp side by side, as a user runs them.

``gradientflow bench --modes hsdp hsdp-bf16 fsdp-...`` and ``bench --quality --recipes hsdp fsdp-...`` on 2 nodes of
2 ranks (two torchruns joined by c10d on loopback): every mode runs, torch's bytes are its shard in its reduce dtype,
gradientflow's are what it measured, and the byte ratios are those of the wire formats.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradientflow.bench.sharded import blocks, hsdp_wire_bytes, is_sharded

CLI = [sys.executable, "-m", "gradientflow.cli"]
LAYOUT = ["--nproc", "4", "--nproc-per-node", "2", "--bandwidth", "none", "--transformer-size", "32x1"]


def test_the_modes_and_what_they_shard() -> None:
    import torch

    from gradientflow.bench.models import build_model

    assert is_sharded("hsdp") and is_sharded("hsdp-bf16") and is_sharded("fsdp-3bit") and is_sharded("fsdp-auto")
    assert not is_sharded("gf-3bit") and not is_sharded("ddp") and not is_sharded("fsdp-nothing")
    net = build_model("tiny_transformer", d_model=32, n_layers=2)
    assert blocks(net) == list(net.layers)  # the transformer's blocks, as torchtitan shards them
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    assert blocks(mlp) == [mlp[0], mlp[2]]  # elsewhere: the children holding parameters
    # a rank's shard of 10 parameters over 4 ranks a node: 3 of them, 4 bytes each in fp32, 2 in bf16
    assert hsdp_wire_bytes("hsdp", 10, 4) == 12 and hsdp_wire_bytes("hsdp-bf16", 10, 4) == 6


def test_step_bench_runs_torchs_hsdp_beside_gradientflows_fsdp(tmp_path) -> None:
    modes = ["hsdp", "hsdp-bf16", "fsdp-3bit", "fsdp-topk-3bit"]
    args = ["bench", "--workload", "tiny_transformer", "--optimizer", "adamw", *LAYOUT, "--steps", "2"]
    args += ["--warmup", "1", "--no-alone", "--timeout", "200", "--out", str(tmp_path), "--modes", *modes]
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw = json.loads((tmp_path / "raw-main.json").read_text())
    assert raw["world_size"] == 4 and raw["nodes"] == 2
    runs = {v["name"]: v for v in raw["variants"]}
    assert all(runs[m]["status"] == "ok" for m in modes), {m: runs[m]["error"] for m in modes}
    n = raw["n_params"]
    assert runs["hsdp"]["computed_wire_bytes"] == 4 * -(-n // 2)  # torch's: the rank's half, fp32
    assert runs["hsdp-bf16"]["computed_wire_bytes"] == 2 * -(-n // 2)
    q = runs["fsdp-3bit"]["stats"]["payload_bytes"]
    topk = runs["fsdp-topk-3bit"]["stats"]["payload_bytes"]
    shard = 4 * n / 2
    # 3 bits a coordinate plus a bf16 scale per 128: 3.125 / 32 of fp32, per-parameter padding aside
    assert all(0.09 * shard < b < 0.11 * shard for b in q), (q, shard)
    assert all(0 < b < max(q) for b in topk), (topk, q)  # 0.3 of the chunks at 3 bits, no ramp in the bench


@pytest.mark.parametrize("optimizer", ["adamw"])
def test_quality_bench_trains_hsdp_and_fsdp_recipes(tmp_path, optimizer: str) -> None:
    args = ["bench", "--quality", "--workload", "tiny_transformer", *LAYOUT, "--steps", "4", "--eval-every", "2"]
    args += ["--transformer-optimizer", optimizer, "--timeout", "200", "--out", str(tmp_path)]
    args += ["--recipes", "hsdp", "fsdp-auto"]
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["recipe"]: r for r in res["workloads"]["transformer"]["rows"]}
    assert set(rows) == {"ddp", "hsdp", "fsdp-auto"}
    assert all(r["status"] == "ok" and r["steps"] == 4 for r in rows.values()), rows
    n = res["workloads"]["transformer"]["n_params"]
    assert rows["hsdp"]["bytes_source"] == "computed" and rows["hsdp"]["bytes_per_step"] == 4 * -(-n // 2)
    # "auto": step 0 dense fp32 (torch's bytes), then 3 bits: the mean of 4 steps well below torch's
    assert rows["fsdp-auto"]["bytes_source"] == "measured"
    assert 0 < rows["fsdp-auto"]["bytes_per_step"] < 0.5 * rows["hsdp"]["bytes_per_step"]
    # the same model and batches: the first evaluation (step 0, before any update) is the same for all three
    first = {r["curve"]["val_loss"][0] for r in rows.values()}
    assert max(first) - min(first) < 1e-5, first
