"""Timeline: trace_path/trace_steps write a Chrome trace of just the chosen steps; trace-summary reads it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import gradientflow as gf
from gradientflow.cli import main
from gradientflow.diagnostics.trace import trace_file
from gradientflow.diagnostics.trace_summary import kind_of

from _dist import run_distributed

STEPS = 5
WINDOW = (1, 3)


def _trace_worker(rank: int, world_size: int, tmp: str, options: dict) -> None:
    torch.manual_seed(0)
    model = gf.DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)),
        fusion_threshold_mb=0.01,
        trace_path=os.path.join(tmp, "run", "trace-{rank}.json"),
        trace_steps=WINDOW,
        check_consistency=True,
        **options,
    )
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        model.zero_grad()
        model(torch.randn(4, 32, generator=gen)).square().mean().backward()


@pytest.mark.parametrize(
    "options", [{}, {"density": 0.5, "chunk_size": 64, "comm_dtype": "fp16", "warmup_steps": 1}], ids=["dense", "csc"]
)
def test_trace_holds_the_chosen_steps_only(tmp_path, capsys, options: dict) -> None:
    run_distributed(_trace_worker, 2, str(tmp_path), options, timeout=90)
    for rank in range(2):
        path = tmp_path / "run" / f"trace-{rank}.json"
        doc = json.loads(path.read_text())  # parses
        events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        assert {e["args"]["step"] for e in events} == set(range(*WINDOW))
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in events)
        cats = {e["cat"] for e in events}
        assert {"forward", "backward", "launch", "final", "wait", "check", "collective"} <= cats, cats
        per_step = {s: [e["name"] for e in events if e["args"]["step"] == s] for s in range(*WINDOW)}
        for names in per_step.values():
            assert names.count("backward") == 1 and names.count("final wait") == 1, names
        colls = [e for e in events if e["cat"] == "collective"]
        if options:
            assert {"csc.select+pack", "csc.write-back"} <= {e["name"] for e in events}
            assert {kind_of(e["args"]["kind"]) for e in colls} == {"scores", "chunks"}
        else:
            assert colls and all(e["args"]["kind"].startswith("bucket ") and e["args"]["bytes"] > 0 for e in colls)
            # Every collective ends after it starts, and the comm tracks have names.
            assert {e["tid"] for e in colls} <= {m["tid"] for m in doc["traceEvents"] if m["ph"] == "M"}

    capsys.readouterr()
    assert main(["trace-summary", str(tmp_path / "run" / "trace-0.json")]) == 0
    out = capsys.readouterr().out
    assert "2 step(s) [1, 2]" in out and "final wait" in out and "backward" in out, out
    assert ("scores" in out and "chunks" in out and "csc.select+pack" in out) if options else "bucket" in out, out


def test_trace_file_names_and_bad_file(tmp_path, capsys) -> None:
    assert trace_file("out/t-{rank}.json", 3) == "out/t-3.json"
    assert trace_file("out/trace.json", 1) == "out/trace.rank1.json"
    assert trace_file("trace", 0) == "trace.rank0.json"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["trace-summary", str(bad)]) == 2  # a usage error, as argparse exits
    assert "not a Chrome trace" in capsys.readouterr().err


def _two_level_worker(rank: int, world_size: int, tmp: str, recipes: dict[str, dict]) -> None:
    for name, options in recipes.items():
        _trace_worker(rank, world_size, os.path.join(tmp, name), options)


def test_two_level_stages_are_collectives_of_the_trace(tmp_path, capsys) -> None:
    """2 nodes x 2 ranks: every bucket's three stages (the reduce-scatter and the all-gather inside the node, the
    exchange between nodes) are collective events, each on a comm track, in that order per bucket."""
    recipes = {"dense": {"comm_dtype": "fp16"}, "quantized": {"compression": "quantized"}}
    run_distributed(_two_level_worker, 4, str(tmp_path), recipes, ranks_per_node=2, timeout=240)
    stages = ("reduce-scatter", "inter-node", "all-gather")
    for name in recipes:
        for rank in range(4):
            doc = json.loads((tmp_path / name / "run" / f"trace-{rank}.json").read_text())
            colls = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "collective"]
            assert {e["args"]["step"] for e in colls} == set(range(*WINDOW))
            tracks = {m["tid"] for m in doc["traceEvents"] if m["ph"] == "M"}
            for step in range(*WINDOW):
                mine = [e for e in colls if e["args"]["step"] == step and e["args"].get("stage")]
                by_what: dict[str, list[dict]] = {}
                for e in mine:
                    by_what.setdefault(e["name"].split(" ", 1)[1], []).append(e)
                assert by_what, (name, rank, step, [e["name"] for e in colls])
                for what, events in by_what.items():
                    events.sort(key=lambda e: e["ts"])
                    assert [e["args"]["stage"] for e in events] == list(stages), (name, what, events)
                    assert [e["args"]["group"] for e in events] == ["intra", "inter", "intra"]
                    for before, after in zip(events, events[1:]):  # a stage starts once the one before ended
                        assert before["ts"] + before["dur"] <= after["ts"] + 1.0, (before, after)
                    assert all(e["args"]["bytes"] > 0 and e["tid"] in tracks for e in events)
        capsys.readouterr()
        assert main(["trace-summary", str(tmp_path / name / "run" / "trace-0.json")]) == 0
        out = capsys.readouterr().out
        assert all(stage in out for stage in stages), out
