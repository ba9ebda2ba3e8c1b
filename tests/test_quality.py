"""``gradientflow bench --quality``: the pure helpers with hand-derived values, the report on a made-up
time-to-accuracy launch, and one tiny run end to end through the command (loopback, no shaping)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from gradientflow.bench.cluster import can_emulate
from gradientflow.bench.quality import QualityOptions, plan_jobs
from gradientflow.bench.quality_lr import lr_factor
from gradientflow.bench.quality_recipes import parse_recipe
from gradientflow.bench.quality_report import is_sparse_step, markdown, plot, summarize, time_to_target
from gradientflow.bench.quality_spec import Job
from gradientflow.cli import main
from gradientflow.exchange.selection import dense_from, density_at
from gradientflow.option_values import auto_chunk_size

CLI = [sys.executable, "-m", "gradientflow.cli"]


@pytest.mark.parametrize(
    "target, expected",
    [
        (1.75, 15.0),  # between (10, 2.0) and (20, 1.5): 10 + 0.25 / 0.5 * 10
        (2.0, 10.0),  # exactly the second point
        (3.5, 0.0),  # the first point is already below
        (1.0, 30.0),  # the last point
        (0.5, None),  # never reached
    ],
)
def test_time_to_target_interpolates_linearly(target, expected):
    assert time_to_target([0, 10, 20, 30], [3.0, 2.0, 1.5, 1.0], target) == expected


def test_time_to_target_first_crossing_and_nan():
    # not monotone: the first crossing counts, 0 + (3 - 1.5) / (3 - 1) * 10
    assert time_to_target([0, 10, 20, 30], [3.0, 1.0, 2.5, 0.5], 1.5) == 7.5
    # a NaN point before the crossing: no line through it, the crossing point's own time
    assert time_to_target([0, 10, 20], [3.0, math.nan, 1.0], 2.0) == 20.0
    assert time_to_target([0, 10], [math.nan, math.nan], 2.0) is None
    with pytest.raises(ValueError):
        time_to_target([0, 1], [1.0], 1.0)


@pytest.mark.parametrize(
    "stats, sparse",
    [
        ({}, False),  # torch DDP
        ({"payload_bytes": 10.0}, False),  # gradientflow dense
        ({"warmup": 1, "selected_chunks": 10, "n_chunks": 10}, False),  # dense warm-up
        ({"warmup": 0}, True),
        ({"warmup": 0, "selected_chunks": 5, "n_chunks": 50}, True),
        ({"warmup": 0, "selected_chunks": 50, "n_chunks": 50}, False),  # a ramp that reached every chunk
        ({"selected_chunks": 3, "n_chunks": 10}, True),
    ],
)
def test_is_sparse_step(stats, sparse):
    assert is_sparse_step(stats) is sparse


def test_lr_factor_warmup_then_cosine_to_floor():
    # 6 steps, 1 warm-up step: cosine over steps 1..5 (span 4)
    assert [round(lr_factor(s, 6, 1), 6) for s in range(6)] == [
        1.0,
        1.0,
        round(0.1 + 0.45 * (1 + 0.5**0.5), 6),
        0.55,
        round(0.1 + 0.45 * (1 - 0.5**0.5), 6),
        0.1,
    ]
    assert [lr_factor(s, 10, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_plan_jobs():
    jobs, tta = plan_jobs(QualityOptions(recipes=["gf-recommended", "ddp-sgd"], bandwidth="none"))
    assert [j.name for j in jobs] == ["transformer", "digits"] and tta == []
    assert jobs[0].recipes == ["ddp", "gf-recommended", "ddp-sgd"]  # the oracle is always added
    assert jobs[1].recipes == ["ddp", "gf-recommended"]  # ddp-sgd would be ddp again on digits
    assert jobs[0].eval_every == 20 and jobs[0].paper_warmup_steps == 20
    jobs, tta = plan_jobs(QualityOptions(workloads=["transformer"], tta_size=(64, 1), bandwidth="1gbit"))
    assert [t.name for t in tta] == ["tta"]
    # AdamW: compression="auto" (quantised) against torch's own ways to send less, on the clock
    # and gf-auto given 20% more (faster) steps: its own time to DDP's final loss
    assert tta[0].recipes == [
        "ddp",
        "gf-auto",
        "gf-auto:steps=1.2",
        "gf-fp16-dense",
        "ddp-fp16-hook",
        "ddp-powersgd",
        "ddp-postlocal",
    ]
    assert (tta[0].d_model, tta[0].n_layers) == (64, 1)
    # digits' time to accuracy trains the communication-bound digits_wide with the user's SGD momentum
    (t,) = plan_jobs(QualityOptions(workloads=["digits"]))[1]
    assert (t.name, t.workload, t.model, t.recipes, t.lr) == (
        "tta_digits",
        "digits",
        "digits_wide",
        ["ddp", "gf-recommended", "gf-auto"],  # auto with SGD momentum: CSC
        0.05,
    )
    # --tta-recipes replaces the clock's recipes (ddp stays first, named once)
    (t,) = plan_jobs(QualityOptions(workloads=["digits"], tta_recipes=["gf-auto:compression=q2nw20", "ddp"]))[1]
    assert t.recipes == ["ddp", "gf-auto:compression=q2nw20"]
    # --quality-on-link: the quality jobs go behind the link, and no time-to-accuracy jobs run
    jobs, tta = plan_jobs(QualityOptions(workloads=["transformer"], bandwidth="1gbit", quality_on_link=True))
    assert [j.name for j in jobs] == ["transformer"] and tta == []


@pytest.mark.skipif(not can_emulate()[0], reason="cannot emulate a cluster")
def test_quality_on_link_lets_auto_measure_a_slow_link(tmp_path):
    """The quality transformer behind a 50 Mbit/s link: "auto" with AdamW on 2 ranks finds it slow and sends 2 bits
    (20 ns a gradient saved there against a codec a few ns slower), which the table says; nothing is left behind."""
    from gradientflow.bench.cluster import leftovers

    prefix = f"gql{os.getpid() % 100000}"
    args = ["bench", "--quality", "--workload", "tiny_transformer", "--recipes", "ddp", "gf-auto", "--steps", "30"]
    args += ["--bandwidth", "50mbit", "--quality-on-link", "--netns-prefix", prefix, "--timeout", "150"]
    proc = subprocess.run([*CLI, *args, "--out", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["tta"] == []
    rows = {r["recipe"]: r for r in res["workloads"]["transformer"]["rows"]}
    assert rows["gf-auto"]["picked"].startswith("AdamW -> 2bit-precond (2 bits"), rows["gf-auto"]["picked"]
    assert '- gf-auto: `"auto"` picked AdamW -> 2bit-precond' in (tmp_path / "table.md").read_text()
    assert leftovers(prefix) == []


def test_recipe_variants_change_wrapper_options_and_are_validated_up_front():
    assert parse_recipe("gf-paper") == ("gf-paper", {})
    assert parse_recipe("gf-auto:steps=1.2") == ("gf-auto", {"steps": 1.2})  # the bench's own option
    assert parse_recipe("gf-recommended:warmup_steps=300, dense_1d=False,csc_scope=global") == (
        "gf-recommended",
        {"warmup_steps": 300, "dense_1d": False, "csc_scope": "global"},
    )
    for bad, says in [
        ("gf-x", "unknown recipe 'gf-x'"),
        ("ddp:density=0.1", "only gradientflow's recipes (gf-*, fsdp-*)"),
        ("hsdp:sync_every=30", "hsdp is torch's FSDP2 / HSDP"),
        # fully_shard's own validation: with sync_every only the outer exchange crosses, so no per-step recipe
        ("fsdp-3bit:sync_every=30", "compression='3bit' cannot apply"),
        ("gf-paper:foo=1", "'foo=1' is not OPTION=VALUE"),
        ("gf-paper:density", "is not OPTION=VALUE"),
        ("gf-paper:density=2", "density must be None (dense) or a number in (0, 1]"),
        ("gf-auto:steps=0", "steps must be a factor > 0"),
        ("gf-auto:steps=True", "steps must be a factor > 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_recipe(bad)
    # fully_shard's variants: its fewer syncs beside torch's HSDP in one launch
    assert parse_recipe("fsdp-none:sync_every=30,outer_lr=0.7,outer_compression='topk-2bit'") == (
        "fsdp-none",
        {"sync_every": 30, "outer_lr": 0.7, "outer_compression": "topk-2bit"},
    )
    assert parse_recipe("fsdp-none:sync_every=30,steps=1.5")[1] == {"sync_every": 30, "steps": 1.5}
    with pytest.raises(SystemExit) as exc:  # the command refuses it before any rank starts
        main(["bench", "--quality", "--recipes", "gf-recommended:density=2"])
    assert exc.value.code == 2
    # variants follow the plain recipes, on every workload their recipe applies to
    jobs, _ = plan_jobs(
        QualityOptions(recipes=["gf-paper:momentum=0.5", "gf-recommended", "gf-paper:momentum=0.5"], bandwidth="none")
    )
    assert [j.recipes for j in jobs] == [["ddp", "gf-recommended", "gf-paper:momentum=0.5"]] * 2
    jobs, _ = plan_jobs(QualityOptions(workloads=["transformer"], recipes=["hsdp", "fsdp-none:sync_every=30"]))
    assert jobs[0].recipes == ["ddp", "hsdp", "fsdp-none:sync_every=30"]


def _run(recipe, step_s, losses, stats):
    evals = [{"step": 2 * i, "val_loss": v, "val_acc": None, "train_loss": None} for i, v in enumerate(losses)]
    return {
        "recipe": recipe,
        "options": {"optimizer": "AdamW"},
        "status": "ok",
        "error": None,
        "step_s": step_s,
        "stats": stats,
        "evals": evals,
    }


def test_tta_report_on_a_made_up_launch(tmp_path):
    job = Job(
        name="tta",
        workload="transformer",
        steps=4,
        batch_size=2,
        eval_every=2,
        recipes=["ddp", "gf-recommended"],
        lr=1e-3,
        paper_lr=0.3,
        paper_warmup_steps=1,
    )
    gf_stats = [{"payload_bytes": 100.0, "warmup": 0.0, "selected_chunks": 1.0, "n_chunks": 10.0}] * 4
    raw = {
        "world_size": 2,
        "seconds": 1.0,
        "jobs": [
            {
                "job": asdict(job),
                "n_params": 1000,
                "probe_s": [0.1, 0.1],
                "runs": [
                    _run("ddp", [0.2] * 4, [4.0, 3.0, 2.0], [{}] * 4),
                    _run("gf-recommended", [0.1] * 4, [4.0, 2.5, 1.5], gf_stats),
                ],
            }
        ],
    }
    s = summarize({"tta": raw}, QualityOptions(), seconds=1.0, tta_skipped=None)
    (t,) = s["tta"]
    rows = {r["recipe"]: r for r in t["rows"]}
    assert t["target_val_loss"] == 2.0
    assert rows["ddp"]["curve"]["wall_s"] == pytest.approx([0.0, 0.4, 0.8])
    assert rows["ddp"]["time_to_target_s"] == pytest.approx(0.8)
    assert rows["gf-recommended"]["time_to_target_s"] == pytest.approx(0.3)  # 0.2 + 0.5 / 1.0 * 0.2
    assert t["speedup"] == pytest.approx(0.8 / 0.3)
    assert t["ddp_comm_share"] == pytest.approx(0.5)  # 1 - 0.1 s compute / 0.2 s step
    assert rows["ddp"]["bytes_per_step"] == 4000 and rows["gf-recommended"]["bytes_per_step"] == 100
    assert rows["gf-recommended"]["sparse_share"] == 1.0 and rows["ddp"]["sparse_share"] == 0.0
    assert t["common_val_loss"] == 2.0 and t["speedup_common"] == pytest.approx(0.8 / 0.3)
    assert "| gf-recommended | 1.500 | 0.3 | 2.67 | 0.3 | 2.67 |" in markdown(s)
    assert [p.name for p in plot(s, tmp_path)] == ["tta.png"]


def test_quality_rejects_other_workloads(capsys):
    assert main(["bench", "--quality", "--workload", "resnet50"]) == 2
    assert "--quality trains" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quality", "--transformer-size", "128"])
    assert exc.value.code == 2


def test_quality_end_to_end_tiny(tmp_path):
    variant = "gf-recommended:warmup_steps=0"  # an ablation: the same recipe without the density ramp
    longer = "gf-fp16-dense:steps=1.5"  # 18 steps, its schedule stretched: evaluated every 4 and at its last
    trained = ["gf-recommended", "gf-density-0.3", "gf-paper", "gf-fp16-dense", "ddp-sgd", variant, longer]
    args = [
        "bench",
        "--quality",
        "--steps",
        "12",
        "--eval-every",
        "4",
        "--transformer-size",
        "32x1",
        "--bandwidth",
        "none",
        "--timeout",
        "150",
        "--out",
        str(tmp_path),
        "--recipes",
        *trained,
    ]
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "transformer step 12/18, validation loss: ddp " in proc.stderr  # progress reaches the terminal
    res = json.loads((tmp_path / "results.json").read_text())
    for key in ("command", "date", "options", "library_defaults", "workloads", "tta", "seconds"):
        assert key in res
    assert res["tta"] == [] and res["world_size"] == 2
    assert set(res["workloads"]) == {"transformer", "digits"}
    expected = {
        "transformer": {"ddp", *trained},
        "digits": {"ddp", *trained} - {"ddp-sgd"},  # ddp-sgd would be ddp again on digits
    }
    for name, w in res["workloads"].items():
        rows = {r["recipe"]: r for r in w["rows"]}
        assert set(rows) == expected[name]
        ddp = rows["ddp"]
        assert ddp["ratio_to_ddp"] == 1.0 and ddp["bytes_source"] == "computed"
        assert ddp["bytes_per_step"] == 4 * w["n_params"]
        for r in rows.values():
            assert r["status"] == "ok" and r["steps"] == (18 if r["recipe"] == longer else 12)
            assert r["curve"]["step"] == ([0, 4, 8, 12, 16, 18] if r["recipe"] == longer else [0, 4, 8, 12])
            assert all(math.isfinite(v) and v > 0 for v in r["curve"]["val_loss"]), r["curve"]
            assert math.isfinite(r["ratio_to_ddp"]) and r["ratio_to_ddp"] > 0
            assert r["curve"]["wall_s"][0] == 0 and r["curve"]["wall_s"] == sorted(r["curve"]["wall_s"])
            if r["recipe"].startswith("gf-"):
                assert r["bytes_source"] == "measured" and 0 < r["bytes_per_step"] < ddp["bytes_per_step"]
        assert rows["gf-fp16-dense"]["bytes_per_step"] == ddp["bytes_per_step"] / 2
        # The ramp's first steps are dense while a sparse step would be no fewer bytes (tiny models
        # get small chunks: fp16 and 16-element chunks, density >= 0.875, the first 6 steps).
        chunk = auto_chunk_size(w["n_params"])
        dense_steps = sum(density_at(t, 0.1, 100) >= dense_from(chunk, 2) for t in range(12))
        assert rows["gf-recommended"]["sparse_share"] == pytest.approx(1 - dense_steps / 12)
        assert 0 < dense_steps < 12 and rows["gf-fp16-dense"]["sparse_share"] == 0
        # density 0.3 sends more than 0.1 (both still ramping down from dense after 12 of 100 steps)
        assert rows["gf-recommended"]["bytes_per_step"] < rows["gf-density-0.3"]["bytes_per_step"]
        # the variant reached the wrapper: no ramp, so every step sends 10% of the chunks
        assert rows[variant]["options"]["warmup_steps"] == 0 and rows[variant]["sparse_share"] == 1.0
        assert rows[variant]["bytes_per_step"] < rows["gf-recommended"]["bytes_per_step"]
        # gf-paper's dense warm-up: max(1, 12 // 20) = 1 step of 12
        assert rows["gf-paper"]["sparse_share"] == pytest.approx(11 / 12)
        if w["metric"] == "val_acc":
            assert all(0 <= r["final_val_acc"] <= 1 for r in rows.values())
        assert (tmp_path / f"quality_{name}.png").stat().st_size > 0
    table = (tmp_path / "table.md").read_text()
    assert "| gf-recommended |" in table and f"| {variant} |" in table and "ratio to ddp" in table


def test_second_half_says_whether_the_gap_to_ddp_grows():
    from gradientflow.bench.quality_report import GAP_SLACK, second_half

    steps = [0, 10, 20, 30, 40]
    ddp = {"step": steps, "val_loss": [4.0, 2.0, 1.0, 1.0, 1.0], "val_acc": [0.5, 0.8, 0.9, 0.9, 0.9]}
    # midpoint: step 20 (half of 40); ratios after it 1.010, 1.012, 1.020: worse by 0.010 > 0.005
    grows = {"step": steps, "val_loss": [4.0, 2.0, 1.01, 1.012, 1.02], "val_acc": ddp["val_acc"]}
    got = second_half(grows, ddp, "val_loss")
    assert got["ratio_mid"] == pytest.approx(1.01) and got["ratio_worst_second_half"] == pytest.approx(1.02)
    assert got["gap_grows"] and GAP_SLACK == 0.005
    holds = {**grows, "val_loss": [4.0, 2.0, 1.01, 1.014, 1.008]}  # 1.014 - 1.010 = 0.004: within the slack
    assert not second_half(holds, ddp, "val_loss")["gap_grows"]
    # accuracy: a ratio falling after the midpoint is the growing gap (0.9/0.9 -> 0.85/0.9)
    acc = {**grows, "val_acc": [0.5, 0.8, 0.9, 0.9, 0.85]}
    got = second_half(acc, ddp, "val_acc")
    assert got["ratio_mid"] == 1.0 and got["ratio_worst_second_half"] == pytest.approx(0.85 / 0.9) and got["gap_grows"]
    assert second_half(grows, {**ddp, "step": [0, 10, 20, 30, 41]}, "val_loss") == {}  # not the same validations


def test_the_sgd_transformer_trains_every_recipe_with_sgd_momentum(tmp_path):
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn

    from gradientflow.bench.quality_recipes import build_recipe

    jobs, _ = plan_jobs(QualityOptions(workloads=["transformer"], transformer_optimizer="sgd", bandwidth="none"))
    (job,) = jobs
    assert job.optimizer == "sgd" and "ddp-sgd" not in job.recipes  # it would be ddp again
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        for recipe in ("ddp", "gf-auto"):
            _, opt, options = build_recipe(recipe, nn.Linear(3, 2), job)
            assert type(opt) is torch.optim.SGD and opt.defaults["lr"] == 0.3 and opt.defaults["momentum"] == 0.9
            assert options["optimizer"] == "SGD(lr=0.3, momentum=0.9)"
    finally:
        dist.destroy_process_group()


def test_the_adamw_digits_jobs_train_every_recipe_with_adamw(tmp_path):
    """--digits-optimizer adamw: small_cnn and digits_wide (the time-to-accuracy net) trained with AdamW by every
    recipe, the compute-only probe included; gf-paper keeps the paper's SGD."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn

    from gradientflow.bench.quality import DIGITS_ADAMW_LR
    from gradientflow.bench.quality_data import WorkloadData
    from gradientflow.bench.quality_recipes import build_recipe
    from gradientflow.bench.quality_worker import _Probe

    jobs, tta = plan_jobs(QualityOptions(workloads=["digits"], digits_optimizer="adamw", bandwidth="100mbit"))
    assert [j.model for j in (*jobs, *tta)] == ["small_cnn", "digits_wide"]
    assert all(j.optimizer == "adamw" and j.lr == DIGITS_ADAMW_LR == 3e-4 for j in (*jobs, *tta))
    (sgd,) = plan_jobs(QualityOptions(workloads=["digits"], bandwidth="none"))[0]
    assert sgd.optimizer == "sgd" and sgd.lr == 0.05  # the default is unchanged
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        for recipe in ("ddp", "gf-auto"):
            _, opt, options = build_recipe(recipe, nn.Linear(3, 2), jobs[0])
            assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == 3e-4
            assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.1
            assert options["optimizer"] == "AdamW(lr=0.0003, betas=(0.9, 0.95), weight_decay=0.1)"
        _, opt, _ = build_recipe("gf-paper", nn.Linear(3, 2), jobs[0])
        assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.0
        _, opt, _ = build_recipe("ddp", nn.Linear(3, 2), sgd)
        assert type(opt) is torch.optim.SGD and opt.defaults["lr"] == 0.05 and opt.defaults["momentum"] == 0.9
        probe = _Probe(WorkloadData(jobs[0], 0, 0, 1), jobs[0])
        assert type(probe.opt) is torch.optim.AdamW
    finally:
        dist.destroy_process_group()


def test_the_stdlib_corpus_holds_out_whole_files_and_outlasts_a_long_run():
    """The standard library's sources: validation is every 20th file (whole files no step trains on), the split is
    the same every time, and a 4,000-step run of 4 ranks x 16 windows x 64 bytes sees less than the training text
    (the help topics it replaces are seen ~40 times by such a run)."""
    import sysconfig
    from pathlib import Path

    from gradientflow.bench.data import pydoc_topics_corpus, stdlib_sources

    train, val = stdlib_sources()
    assert (train, val) == stdlib_sources()  # deterministic
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    held = [f.read_bytes() for f in files[::20]]
    assert val == b"\n".join(held)
    assert len(train) + len(val) == sum(f.stat().st_size for f in files) + len(files) - 2  # one b"\n" between files
    seen = 4000 * 4 * 16 * 64
    assert len(train) > seen
    assert len(pydoc_topics_corpus()[0]) * 30 < seen  # the corpus it replaces for such runs
    with pytest.raises(ValueError, match="val_every"):
        stdlib_sources(val_every=1)


def test_the_stdlib_corpus_trains_the_transformer_as_bytes():
    from gradientflow.bench.quality_data import WorkloadData, corpus_ids

    (job,) = plan_jobs(QualityOptions(workloads=["transformer"], bandwidth="none", corpus="stdlib"))[0]
    assert job.corpus == "stdlib"
    data = WorkloadData(job, 0, 0, 1)
    assert data.vocab_size == 256 and data.train_ids.dtype == torch.uint8  # 1 byte a token held, not 8
    x, y = next(data.batches())
    assert x.dtype == y.dtype == torch.long and x.shape == (job.batch_size, job.seq_len)
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-byte targets
    assert data.val_x.dtype == torch.long and data.val_x.max() < 256
    model = data.build_model()
    assert model(x).shape == (job.batch_size, job.seq_len, 256)
    with pytest.raises(ValueError, match="corpus must be one of"):
        corpus_ids("wikitext")
