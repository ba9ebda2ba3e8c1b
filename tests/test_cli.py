"""The ``gradientflow`` command end to end: help, bad options, a 2-step bench, a short demo.

Every subprocess has a timeout; the emulated-cluster bench runs only where ``can_emulate()``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradientflow as gf
from gradientflow.bench.cluster import can_emulate, leftovers
from gradientflow.bench.report import readme_tables, reference_warnings, summarize
from gradientflow.bench.runner import ALONE_SUFFIX, MODES, BenchOptions, plan_variants, powersgd_wire_bytes
from gradientflow.cli import COMMANDS, build_parser, main

from _dist import run_distributed

CAN, WHY = can_emulate()
CLI = [sys.executable, "-m", "gradientflow.cli"]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_console_script_help():
    script = Path(sys.executable).with_name("gradientflow")  # the installed console script
    argv = [str(script)] if script.exists() else CLI
    top = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0
    assert "demo" in top.stdout and "bench" in top.stdout


def test_subcommand_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--nproc", "--steps", "--workload", "--bandwidth", "--theta-sweep", "--modes", "--out"):
        assert opt in out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "--density" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--bandwidth", "fast"],
        ["bench", "--nproc", "0"],
        ["bench", "--workload", "vgg"],
        ["bench", "--modes", "horovod"],
        ["bench", "--theta-sweep", "-1"],
        ["demo", "--density", "2"],
        ["demo", "--no-such-option"],
        [],
    ],
)
def test_bad_option_exits_2_with_one_error_line(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr()
    assert len([ln for ln in err.err.splitlines() if "error:" in ln]) == 1, err.err
    assert err.out == ""


def test_bad_option_from_the_shell():
    proc = _run(["bench", "--nproc", "-3"], 60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("gradientflow bench: error: argument --nproc")


def test_plan_variants_dedupes_sweep_and_adds_compute():
    vs = plan_variants(["gf-none", "ddp"], 25.0, [0, 25, 100])
    names = [v.name for v in vs]
    assert names[0] == "compute"
    assert names.count("gf-none") == 1 and "gf-none θ=25" not in names and "ddp θ=25" not in names
    assert {"gf-none θ=0", "ddp θ=0", "gf-none θ=100", "ddp θ=100"} <= set(names)
    # every requested mode again alone (one-rank group), at the mode's own θ; none for the sweep
    twins = [v for v in vs if v.alone]
    assert [(v.name, v.mode, v.theta_mb) for v in twins] == [
        ("gf-none alone", "gf-none", 25.0),
        ("ddp alone", "ddp", None),
    ]
    assert not any(v.alone for v in plan_variants(["gf-none", "ddp"], 25.0, [0], alone=False))


def test_a_mode_is_a_recipe_of_the_table_with_options_and_the_old_names_run_as_theirs(capsys, monkeypatch):
    """``gf-<recipe>[:OPTION=VALUE,...][@TOPOLOGY]``; the names from before the recipe table still run, as the
    table's (one line on stderr), and a ``results.json`` written under them reads in the table's words."""
    from gradientflow.bench.mode_names import OLD_MODES, canonical_mode, canonical_summary
    from gradientflow.bench.runner_spec import EXTRA_MODES, gf_recipe, split_mode
    from gradientflow.cli import types

    assert gf_recipe("gf-topk-fp16:csc_scope=global,schedule=auto") == (
        "topk-fp16",
        {"csc_scope": "global", "schedule": "auto"},
    )
    assert gf_recipe("gf-none:comm_dtype=bf16,density=0.1") == ("none", {"comm_dtype": "bf16", "density": 0.1})
    assert split_mode("gf-topk-fp16:csc_scope=global@flat") == ("gf-topk-fp16:csc_scope=global", "flat")
    for bad, says in (
        ("gf-fp16:nope=1", "not a wrapper option"),
        ("gf-fp16:fusion_threshold_mb=4", "not a wrapper option"),  # θ is --fusion-mb
        ("gf-topk-fp16:comm_dtype=bf16", "by its name"),  # the recipe's name states its wire
        ("gf-fp16:csc_scope", "not OPTION=VALUE"),
        ("ddp:bucket_cap_mb=1", "only gradientflow modes"),
    ):
        with pytest.raises(ValueError, match=says):
            split_mode(bad)
    # the old names: each the same recipe and options, under the table's name
    assert {old: split_mode(old)[0] for old in OLD_MODES} == OLD_MODES
    assert split_mode("gf-cscq@2x2") == ("gf-topk-3bit", "2x2") and canonical_mode("gf-q3p") == "gf-3bit-precond"
    assert canonical_mode("gf-csc@flat") == "gf-topk-fp16@flat" and canonical_mode("hsdp") == "hsdp"
    names = [v.name for v in plan_variants(["gf-fp32", "gf-none", "ddp"], 25.0, [4], alone=False)]
    assert names == ["compute", "gf-none", "ddp", "gf-none θ=4", "ddp θ=4"]
    assert types.bench_mode("gf-fp16-csc-slice@flat") == "gf-topk-fp16@flat"
    assert "gf-fp16-csc-slice@flat runs as gf-topk-fp16@flat" in capsys.readouterr().err
    old = {
        "command": "gradientflow bench --modes gf-fp32 gf-fp32@flat gf-cscq ddp --theta-sweep 4",
        "rows": [{"name": n, "mode": n.split()[0]} for n in ("gf-fp32", "gf-fp32@flat alone", "gf-fp32 θ=4")],
        "sweep": [{"theta_mb": 4, "gf": "gf-fp32 θ=4", "ddp": None}],
        "options": {"modes": ["gf-fp32", "gf-cscq"]},
    }
    new = canonical_summary(old)
    assert new["command"] == "gradientflow bench --modes gf-none gf-none@flat gf-topk-3bit ddp --theta-sweep 4"
    assert [(r["name"], r["mode"]) for r in new["rows"]] == [
        ("gf-none", "gf-none"),
        ("gf-none@flat alone", "gf-none@flat"),
        ("gf-none θ=4", "gf-none"),
    ]
    assert new["sweep"] == [{"theta_mb": 4, "gf": "gf-none θ=4", "ddp": None}]
    assert new["options"]["modes"] == ["gf-none", "gf-topk-3bit"] and old["rows"][0]["name"] == "gf-fp32"
    # --help prints the table's names only
    monkeypatch.setenv("COLUMNS", "100000")  # argparse wraps at a hyphen otherwise
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    shown = capsys.readouterr().out
    assert all(m in shown for m in (*MODES, *EXTRA_MODES))
    for gone in ("gf-fp32", "csc-slice", "gf-cscq", "gf-fp16-csc", "gf-bf16-csc"):
        assert gone not in shown, gone


def test_step_shares_split_by_the_alone_twin():
    # main launch: compute 200 ms, the mode 250 ms; the twins' launch: compute 190 ms, the mode alone
    # 215 ms.  Shares of the 250 ms step: 200/250 = 80% compute, (215 - 190)/250 = 10% the mode's own
    # cost (the twin over its own launch's compute), the remaining 10% communication
    def variant(name: str, ms: float, **kw: object) -> dict:
        return {"name": name, "mode": name.split()[0], "status": "ok", "step_s": [ms / 1e3] * 5, **kw}

    main = {
        "name": "main",
        "world_size": 2,
        "variants": [variant("compute", 200), variant("gf-fp16", 250), variant("ddp", 260)],
    }
    alone = {"name": "alone", "variants": [variant("compute", 190), variant("gf-fp16 alone", 215, alone=True)]}
    rows = {r["name"]: r for r in summarize([main, alone], BenchOptions(), emulated=False)["rows"]}
    g = rows["gf-fp16"]
    assert (g["alone_s"], g["compute_share"]) == (pytest.approx(0.215), pytest.approx(0.8))
    assert (g["own_cpu_share"], g["comm_share"]) == (pytest.approx(0.10), pytest.approx(0.10))
    assert "own_cpu_share" not in rows["ddp"] and rows["ddp"]["comm_share"] == pytest.approx(1 - 200 / 260)
    assert "alone_s" not in rows["gf-fp16 alone"]  # a twin has no twin


def test_powersgd_wire_bytes_follows_torchs_rule():
    import torch

    # 100x100 matrix at rank 1: (100+100)*1 = 200 < 10000/2 -> compressed; a bias is sent as is;
    # a 2x2 matrix: 2*2 = 4 is not > (2+2)*1*2 = 8 -> sent as is
    params = [torch.zeros(100, 100), torch.zeros(100), torch.zeros(2, 2)]
    assert powersgd_wire_bytes(params) == 4 * (200 + 100 + 4)


def _bench_buckets_worker(rank: int, world_size: int) -> dict[str, int]:
    import torch

    from gradientflow.bench.models import synthetic_batch
    from gradientflow.bench.runner import BenchSpec, Variant, _build, _step

    spec = BenchSpec(workload="resnet50", batch_size=2, steps=1, warmup=1, variants=[], out_path="unused")
    x, y = synthetic_batch("resnet50", 2, rank)
    buckets = {}
    for mode in ("ddp", "ddp-powersgd"):
        model, opt, _ = _build(Variant(mode, mode), spec, 32768, torch.device("cpu"))
        for _ in range(2):  # DDP re-lays its buckets out in the second step, from the first's order
            _step(model, opt, x, y)
        buckets[mode] = len(model.reducer._get_zeros_like_grad_buckets())
    return buckets


def _alone_twins_worker(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from gradientflow.bench.models import synthetic_batch
    from gradientflow.bench.runner import BenchSpec, _build, _step

    solo = [dist.new_group([r]) for r in range(world)][rank]
    spec = BenchSpec(workload="small_cnn", batch_size=4, steps=1, warmup=1, variants=[], out_path="unused")
    x, y = synthetic_batch("small_cnn", 4, rank)
    stepped = []
    if rank == 0:  # rank 1 steps nothing: a twin that talked to the default group would wait for it
        for v in plan_variants([m for m in MODES if m != "compute"], 25.0, []):
            if v.alone:
                model, opt, _ = _build(v, spec, 64, torch.device("cpu"), solo)
                for _ in range(3):  # CSC: dense step 0, sparse after (warmup_steps=0); DDP: its re-bucketing
                    _step(model, opt, x, y)
                stepped.append(v.name)
    dist.barrier()
    return stepped


def test_bench_alone_twins_stay_on_their_one_rank_group():
    """Each alone twin is the mode on a one-rank group of its own: it must not touch the default
    group (torch's fp16 hook takes its process group as its state: None would mean the world)."""
    r0, r1 = run_distributed(_alone_twins_worker, 2, timeout=150)
    assert r0 == [m + ALONE_SUFFIX for m in MODES if m not in ("compute", "ddp-powersgd")] and r1 == []


def test_bench_gives_torchs_powersgd_hook_one_bucket():
    """torch's powerSGD_hook starts its second allreduce from a future callback, which races the next
    bucket's allreduce under Gloo; the bench's DDP + PowerSGD therefore runs the model in one bucket
    (plain DDP keeps its default buckets: 4 on ResNet-50's 102 MB of gradients)."""
    for r in run_distributed(_bench_buckets_worker, 2, timeout=120):
        assert r["ddp-powersgd"] == 1 and r["ddp"] == 4, r


def _check_bench_json(out: Path) -> dict:
    res = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == set(MODES) | {m + ALONE_SUFFIX for m in MODES if m not in ("compute", "ddp-powersgd")}, sorted(
        rows
    )
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("error"))  # PowerSGD included: one bucket, no Gloo race
        assert r["steps"] == 2
        if name not in ("compute", "ddp-powersgd") and not r["alone"]:  # the whole step, in three shares
            assert r["alone_s"] == rows[name + ALONE_SUFFIX]["median_s"]
            shares = [r["compute_share"], r["own_cpu_share"], r["comm_share"]]
            assert min(shares) >= 0 and sum(shares) == pytest.approx(1.0), (name, shares)
        for key in ("median_s", "p10_s", "p90_s", "samples_per_s", "speedup", "exposed_s", "mem_added_mb"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] >= 0, (name, key, r[key])
        assert r["median_s"] > 0 and r["p10_s"] <= r["median_s"] <= r["p90_s"]
        assert r["wire_bytes"] is not None
        # one thread's CPU time cannot exceed the wall time it ran (per step, slowest rank, median)
        assert 0 < r["thread_cpu_s"] <= r["median_s"], (name, r["thread_cpu_s"], r["median_s"])
        assert ("thread_cpu_added_s" in r) == (name != "compute"), name  # against its own launch's compute
    assert rows["gf-none"]["wire_source"] == "measured" and rows["ddp"]["wire_source"] == "computed"
    # fp16 halves the measured payload; CSC at density 0.1 sends far less again
    assert rows["gf-fp16"]["wire_bytes"] == rows["gf-none"]["wire_bytes"] / 2
    assert rows["gf-topk-fp16:csc_scope=global"]["wire_bytes"] < 0.2 * rows["gf-fp16"]["wire_bytes"]
    assert rows["ddp"]["wire_bytes"] == rows["gf-none"]["wire_bytes"]  # both: 4 bytes per gradient
    assert (out / "bench.png").stat().st_size > 0
    assert "| gf-topk-fp16:csc_scope=global |" in (out / "table.md").read_text()
    assert "thread CPU ms (vs compute)" in (out / "table.md").read_text()
    assert (
        "| gf-topk-fp16:csc_scope=global alone |" not in (out / "table.md").read_text()
    )  # a column of its mode, not a row
    # the README's form of the tables, made from the same results (what test_readme_numbers compares)
    assert (out / "readme.md").read_text() == readme_tables(res)
    assert '| **gradientflow `"topk-fp16"` (default `"slice"`)** |' in (out / "readme.md").read_text()
    return res


def test_bench_flags_a_noisy_compute_reference():
    # Speedups divide by the compute mode's median: one that sits > 10% above its own p10 is flagged.
    def launch(name: str, compute_ms: list[float]) -> dict:
        return {
            "name": name,
            "variants": [
                {"mode": "compute", "step_s": [t / 1e3 for t in compute_ms]},
                {"mode": "gf-none", "step_s": [0.3] * len(compute_ms)},
            ],
        }

    quiet = [200, 202, 204, 206, 208, 210, 212, 214, 216, 240]  # median 209, p10 201.8: +3.6%
    noisy = [215, 215, 248, 250, 251, 251, 252, 255, 256, 258]  # median 251, p10 215: +16.7%
    assert reference_warnings([launch("main", quiet)]) == []
    (w,) = reference_warnings([launch("main", quiet), launch("isolated", noisy)])
    assert w.startswith("launch 'isolated': the compute reference was noisy (median 251 ms, p10 215 ms, +17%)")


BENCH_ARGS = ["bench", "--steps", "2", "--warmup", "1", "--workload", "small_cnn", "--nproc", "2"]


def test_bench_times_the_users_own_model(tmp_path):
    # tests/_user_model.py:build, found from the working directory as `python -m` would; its outputs (a
    # tuple holding a dict and an integer tensor) are trained on the mean square of the float ones
    args = [
        "bench",
        "--workload",
        "_user_model:build",
        "--input-shape",
        "3,4,4",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--nproc",
        "2",
        "--bandwidth",
        "none",
        "--modes",
        "gf-none",
        "gf-topk-fp16",
        "ddp",
        "--no-alone",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=150, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["n_params"] == 48 * 32 + 32 + 32 * 8 + 8 + 32 * 2 + 2
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {"compute", "gf-none", "gf-topk-fp16", "ddp"}  # --no-alone: no twins
    assert "own_cpu_share" not in rows["gf-none"]
    line = next(ln for ln in (tmp_path / "table.md").read_text().splitlines() if ln.startswith("| gf-none |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[3] == "—" and " / — / " in cells[8], cells  # no alone step, no own-CPU share: dashes
    assert all(r["status"] == "ok" and r["steps"] == 2 for r in rows.values())
    assert rows["gf-none"]["wire_bytes"] == 4 * res["n_params"]  # every gradient reached the wire


@pytest.mark.parametrize(
    "args, says",
    [
        (["--workload", "_user_model:build"], "needs --input-shape"),
        (["--workload", "resnet50", "--input-shape", "3,32,32"], "--input-shape is for your own model"),
    ],
)
def test_bench_input_shape_goes_with_a_users_model(args, says, capsys):
    assert main(["bench", *args]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    "workload, says", [("nope", "package.module:factory"), ("no_such_module_here:build", "No module named")]
)
def test_bench_refuses_a_model_it_cannot_load(workload, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--workload", workload, "--input-shape", "3"])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_bench_loopback_two_steps(tmp_path):
    proc = _run([*BENCH_ARGS, "--bandwidth", "none", "--out", str(tmp_path)], 150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = _check_bench_json(tmp_path)
    assert res["network"] == "loopback"
    assert "| mode |" in proc.stdout


def test_bench_device_placement(monkeypatch):
    import torch

    from gradientflow.bench.runner import process_group_backend, rank_device

    assert rank_device("cpu", 3) == torch.device("cpu")
    assert process_group_backend(torch.device("cpu"), 2) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device("cuda", 3) == torch.device("cuda", 1)  # local rank mod the GPU count
    assert process_group_backend(torch.device("cuda", 0), 2) == "nccl"  # a GPU per rank
    assert process_group_backend(torch.device("cuda", 0), 4) == "gloo"  # ranks share GPUs: NCCL cannot
    # an emulated cluster's nodes (one rank each) share this machine: Gloo, whose bytes cross the shaped link
    assert process_group_backend(torch.device("cuda", 0), 1, emulated=True) == "gloo"


def test_bench_device_refusals(capsys):
    import torch

    if not torch.cuda.is_available():
        assert main(["bench", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err
        assert main(["bench", "--quality", "--device", "cuda"]) == 2  # --quality trains on GPUs too
        assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA")
def test_bench_on_cuda_two_steps(tmp_path):
    proc = _run([*BENCH_ARGS, "--bandwidth", "none", "--device", "cuda", "--out", str(tmp_path)], 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = _check_bench_json(tmp_path)
    assert res["options"]["device"] == "cuda"
    rows = {r["name"]: r for r in res["rows"]}
    assert rows["gf-topk-fp16"]["host_syncs"] <= 1  # CSC's one finite check at most


@pytest.mark.skipif(not CAN, reason=f"cannot emulate a cluster: {WHY}")
def test_bench_emulated_1gbit_leaves_nothing_behind(tmp_path):
    prefix = f"gfc{os.getpid() % 100000}"  # our own: never touches a concurrent run's cluster
    proc = _run([*BENCH_ARGS, "--bandwidth", "1gbit", "--netns-prefix", prefix, "--out", str(tmp_path)], 200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = _check_bench_json(tmp_path)
    assert res["network"].startswith("emulated 1gbit")
    assert leftovers(prefix) == []


@pytest.mark.skipif(CAN, reason="only meaningful where a cluster cannot be emulated")
def test_bench_without_root_says_so_in_one_line(tmp_path):
    proc = _run([*BENCH_ARGS, "--modes", "gf-none", "--bandwidth", "1gbit", "--out", str(tmp_path)], 150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum("running on loopback" in ln for ln in proc.stderr.splitlines()) == 1


def test_demo_runs_and_reports_accuracy(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [*CLI, "demo", "--steps", "150", "--out", str(tmp_path)], capture_output=True, text=True, timeout=150, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test accuracy" in proc.stderr
    rep = json.loads((tmp_path / "demo.json").read_text())
    assert rep["steps"] == 150 and rep["ranks"] == 2
    # 150 steps of 2x32 digits (~7 epochs) beat chance (10%) by far
    assert rep["test_accuracy"] > 0.5
    assert rep["mode"].startswith('compression="topk-3bit" (density 0.3'), rep["mode"]  # "auto" with SGD
    assert 0 < rep["payload_bytes"] < rep["ddp_bytes"]


SMALL_CNN_PARAMETERS = 188_234
"""small_cnn's parameters (its two convolutions and two linear layers, biases included: counted once by hand from
``gradientflow.bench.models``, checked in the test below): DDP's fp32 allreduce hands over 4 bytes of each a step."""


def test_demo_shows_fewer_syncs_against_every_step(tmp_path):
    """``gradientflow demo --sync-every 10``: the ranks train on their own gradients and are averaged every 10
    steps through 3 bits, so 150 steps make 15 outer syncs, each 3 bits and one bf16 scale per block of 128
    (3/32 + 16/(128 * 32) = 0.0977 of fp32's bytes, a few blocks padded): 0.0977/10 of DDP's bytes over the run;
    the digits are still learnt (the every-step demo above reaches > 0.5 at 150 steps too)."""
    from gradientflow.bench.models import build_model

    assert sum(p.numel() for p in build_model("small_cnn").parameters()) == SMALL_CNN_PARAMETERS
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [*CLI, "demo", "--steps", "150", "--sync-every", "10", "--out", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "handed to 15 outer syncs over the run" in proc.stderr, proc.stderr[-1500:]
    rep = json.loads((tmp_path / "demo.json").read_text())
    assert rep["mode"].startswith('compression="none" (comm_dtype fp32), sync_every=10 (outer_compression="3bit")')
    assert rep["outer_syncs"] == 15 and rep["ddp_bytes"] == 150 * 4 * SMALL_CNN_PARAMETERS
    three_bits = 3 / 32 + 16 / (128 * 32)
    # padding each tensor to whole blocks of 128 adds under 1% on this model (its 16-element biases)
    assert 1.0 <= rep["payload_bytes"] / (rep["ddp_bytes"] * three_bits / 10) < 1.01, rep
    assert rep["test_accuracy"] > 0.5


@pytest.mark.parametrize("flag", [["--compression", "3bit"], ["--density", "0.3"], ["--comm-dtype", "bf16"]])
def test_demo_refuses_a_per_step_option_beside_sync_every_naming_it(flag, capsys):
    """Between syncs nothing is sent: a per-step option beside --sync-every is refused before any rank starts,
    with advice in the demo's own flags (the library's names outer_compression=, which the demo does not take)."""
    assert main(["demo", "--sync-every", "10", *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradientflow demo: error: --sync-every 10 sends nothing between syncs") and flag[0] in err
    assert "drop it, or drop --sync-every" in err and "outer_compression" not in err


_ALLOCATOR_PROBE = """
import ctypes, torch
from gradientflow.bench.runner import timing_allocator
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def mmapped_while_alive():
    t = torch.empty(1 << 20)  # 4 MB
    return libc.mallinfo2().hblkhd
before = mmapped_while_alive()
ok = timing_allocator()
print(ok, before - mmapped_while_alive())
"""


def test_bench_times_in_mallocs_steady_state():
    """Workers start with every block over 128 KB mmapped (exact RSS per mode); timing_allocator()
    then makes a 4 MB tensor come from the heap, as in any long-running process."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-c", _ALLOCATOR_PROBE], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok, freed = proc.stdout.split()
    assert ok == "True" and int(freed) >= 4 << 20


# ---- the command takes the library's values, starts without torch, and explains a bad trace file ----
def _parsed(argv: list[str]):
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("text, density", [("0.1", 0.1), ("1", 1), ("none", None), ("None", None)])
def test_demo_density_takes_the_librarys_values(text, density):
    assert _parsed(["demo", "--density", text]).density == density  # none = dense, as density=None


@pytest.mark.parametrize("text, got", [("0", "0"), ("-0.5", "-0.5"), ("1.5", "1.5"), ("nan", "nan"), ("x", "'x'")])
def test_demo_density_refuses_what_the_library_refuses_with_its_message(text, got, capsys):
    with pytest.raises(ValueError) as lib:
        gf.GradientFlowConfig(density=_number(text))  # what the library says to the same value
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--density", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"gradientflow demo: error: argument --density: {lib.value}" and err.endswith(f"got {got}")


def _number(text: str) -> object:
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "half"])
def test_demo_comm_dtype_takes_every_library_value(dtype):
    gf.GradientFlowConfig(comm_dtype=dtype)  # the library takes it ...
    assert _parsed(["demo", "--comm-dtype", dtype]).comm_dtype == dtype  # ... and so does the command


def test_demo_comm_dtype_refuses_with_the_librarys_message(capsys):
    with pytest.raises(ValueError) as lib:
        gf.GradientFlowConfig(comm_dtype="fp8")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--comm-dtype", "fp8"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"argument --comm-dtype: {lib.value}")


_WITHOUT_TORCH = """
import sys
from gradientflow.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy") or m.startswith("gradientflow.bench"))
print(code, heavy[:5])
"""


@pytest.mark.parametrize("argv", [["--help"], ["trace-summary", "TRACE"], ["trace-summary", "--help"]])
def test_help_and_trace_summary_start_without_torch(argv, tmp_path):
    trace = tmp_path / "t.json"
    event = {"ph": "X", "name": "forward", "cat": "forward", "ts": 0, "dur": 5, "tid": 0, "pid": 0, "args": {"step": 1}}
    trace.write_text(json.dumps({"traceEvents": [event], "otherData": {"rank": 0, "world_size": 1}}))
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "0 []"


@pytest.mark.parametrize(
    "content, says",
    [
        ("step,ms\n1,2.5\n", "is not a trace: expected the Chrome-trace JSON"),  # a CSV
        ('{"rank": 0}', "is not a Chrome trace (no traceEvents list): expected the Chrome-trace JSON"),
        ("", "is not a trace: expected the Chrome-trace JSON"),  # empty: a run killed before writing
        (None, "cannot read"),  # no such file
    ],
)
def test_trace_summary_on_a_file_that_is_not_a_trace(content, says, tmp_path, capsys):
    path = tmp_path / "notes.txt"
    if content is not None:
        path.write_text(content)
    assert main(["trace-summary", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()  # one line, naming the file
    assert line.startswith("gradientflow trace-summary: error: ") and str(path) in line and says in line, line


_LAZY_NAMES = """
import sys
import gradientflow as gf
print("torch" in sys.modules)
from gradientflow import *
from gradientflow.wrapper.ddp import DistributedDataParallel as DDP
print(DistributedDataParallel is DDP is gf.DistributedDataParallel, all(n in globals() for n in gf.__all__))
try:
    gf.NoSuchName
except AttributeError as exc:
    print(exc)
"""


def test_public_names_load_on_first_use():
    # `import gradientflow` imports no torch (the command's start-up); each documented name loads on first use
    proc = subprocess.run([sys.executable, "-c", _LAZY_NAMES], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["False", "True True", "module 'gradientflow' has no attribute 'NoSuchName'"]


def test_bench_quality_adamw_settings_reach_the_job(monkeypatch, capsys):
    """--adamw-lr / --adamw-beta2 set the quality transformer's AdamW (the settings docs/results/adamw.md sweeps);
    a beta2 outside [0, 1) is refused by the parser."""
    import gradientflow.bench.quality as quality

    seen = {}

    def fake_run(opts):
        seen["jobs"] = quality.plan_jobs(opts)[0]

    monkeypatch.setattr(quality, "run_quality", fake_run)
    argv = ["bench", "--quality", "--workload", "tiny_transformer", "--bandwidth", "none"]
    assert main([*argv, "--adamw-lr", "1e-3", "--adamw-beta2", "0.999"]) == 0
    (job,) = seen["jobs"]
    assert (job.lr, job.beta2) == (1e-3, 0.999)
    assert main([*argv]) == 0
    assert (seen["jobs"][0].lr, seen["jobs"][0].beta2) == (6e-3, 0.95)  # the defaults: 6e-3 x 128 / d_model
    with pytest.raises(SystemExit):
        main([*argv, "--adamw-beta2", "1.0"])
    assert "expected a number in [0, 1)" in capsys.readouterr().err


def test_torch_suite_subcommand_takes_the_runners_options():
    """`gradientflow torch-suite` is the runner of docs/torch-ddp-suite.md, same options (one module per subcommand)."""
    from gradientflow.cli import COMMANDS, build_parser

    assert COMMANDS["torch-suite"].module == "gradientflow.cli.torch_suite"
    args = build_parser(["torch-suite", "--ci", "--out", "d"]).parse_args(["torch-suite", "--ci", "--out", "d"])
    assert (args.command, args.ci, args.all, args.out, args.tests) == ("torch-suite", True, False, "d", [])
    args = build_parser(["torch-suite", "test_ddp_namedtuple"]).parse_args(["torch-suite", "test_ddp_namedtuple"])
    assert args.tests == ["test_ddp_namedtuple"] and args.pg_timeout == 60.0 and args.only is None
    args = build_parser(["torch-suite", "--only", "gradientflow"]).parse_args(["torch-suite", "--only", "gradientflow"])
    assert args.only == "gradientflow"  # the torch DDP column is then read from --out's earlier results.json


def test_torch_suite_only_without_the_other_column_stops_before_running_a_test(tmp_path, monkeypatch, capsys):
    """`--only gradientflow` into a folder without torch DDP's column: exit 1 with "run both first" at once, not
    after minutes of tests (each test a pair of ranks)."""
    pytest.importorskip("expecttest")  # the runner requires it before anything else (docs/install.md)
    from gradientflow.bench.torch_suite import runner
    from gradientflow.cli import main

    ran: list[str] = []
    monkeypatch.setattr(runner, "run_tests", lambda impl, *a, **k: ran.append(impl) or [])
    assert main(["torch-suite", "--only", "gradientflow", "--out", str(tmp_path), "test_ddp_namedtuple"]) == 1
    assert "run both first" in capsys.readouterr().err
    assert ran == []  # nothing ran


def test_version_prints_the_installed_version_and_exits_0(capsys):
    """``gradientflow --version``: the package's version as installed (importlib.metadata), no COMMAND needed."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"gradientflow {version('gradientflow')}"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_help_text_renders_without_a_doubled_percent(command, capsys):
    """argparse %-formats an option's help (so a literal % is written %%) but not a description without
    %(prog): a %% there is printed as is ("the top 30%% of the gradient's chunks")."""
    with pytest.raises(SystemExit) as exc:
        main(["--help"] if command is None else [command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "%%" not in out and "%(" not in out, out
    if command == "demo":
        assert "the top 30% of the gradient's chunks" in " ".join(out.split())
