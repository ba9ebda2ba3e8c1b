"""Nodes of several ranks: the emulated cluster launched as a user launches machines, and its link counters.

Each node is a network namespace running one ``torchrun --nproc-per-node K`` with a c10d rendezvous
across nodes.  What these tests hold the bench to: the ranks of a node reach each other without
touching the node's link (an allreduce inside a node moves ~0 bytes on its counters, one across nodes
moves what a ring must), ``gradientflow bench --nproc-per-node 2`` runs end to end and reports the
kernel's bytes per node beside the engine's, a failing rank leaves nothing behind, and a mode's
``@topology`` reaches the wrapper as its keyword.  The parts that need root, ``ip`` and ``tc`` are
skipped (with the reason) elsewhere; the plumbing is tested everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradientflow.bench import cluster as gfc
from gradientflow.bench.cluster import EmulatedCluster, can_emulate, leftovers
from gradientflow.bench.link_bytes import LINK_ENV, LinkCounter, link_summary, per_node
from gradientflow.bench.report_tables import link_table
from gradientflow.bench.runner_launch import c10d_torchrun_argv, launch_workers
from gradientflow.bench.runner_spec import BenchSpec, Variant, plan_variants, split_mode, topology_kwargs
from gradientflow.cli import main

CAN, WHY = can_emulate()
needs_netns = pytest.mark.skipif(not CAN, reason=f"cannot emulate a cluster: {WHY}")
PREFIX = f"gfk{os.getpid() % 100000}"  # our own: never touches a concurrent run's cluster
SRC = str(Path(gfc.__file__).resolve().parents[2])
MB4 = 1 << 20  # floats: 4 MiB of fp32

# Every rank: allreduce 4 MiB among the ranks of its node, then among one rank per node, the node's
# link counters read around each; local rank 0 writes what its node's link carried.
INTRA_INTER = rf"""
import datetime, json, os, sys, torch, torch.distributed as dist
from gradientflow.bench.link_bytes import LinkCounter, node_of_rank
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
nodes = [None] * dist.get_world_size()
dist.all_gather_object(nodes, node_of_rank())
groups = {{n: dist.new_group([r for r, m in enumerate(nodes) if m == n]) for n in sorted(set(nodes))}}
firsts = [min(r for r, m in enumerate(nodes) if m == n) for n in sorted(set(nodes))]
across = dist.new_group(firsts)
link = LinkCounter.from_env()
def moved(group, member):
    dist.barrier(); before = link.read()
    if member:
        dist.all_reduce(torch.ones({MB4}), group=group)
    dist.barrier(); after = link.read()
    return [b - a for a, b in zip(before, after)]
intra = moved(groups[node_of_rank()], True)
inter = moved(across, rank in firsts)
if local == 0:
    out = {{"node": node_of_rank(), "ranks_on_node": nodes.count(node_of_rank()), "intra": intra, "inter": inter,
           "gloo_if": os.environ.get("GLOO_SOCKET_IFNAME")}}
    with open(os.path.join(sys.argv[1], f"node{{node_of_rank()}}.json"), "w") as f:
        json.dump(out, f)
dist.barrier()
dist.destroy_process_group()
"""
# One rank fails after the rendezvous while the others wait for it in a collective.
FAILING_RANK = r"""
import datetime, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
if dist.get_rank() == 3:
    sys.exit(3)
dist.all_reduce(torch.ones(4))
"""

# Every rank says where torchrun put it: its node (the launcher's), its local world, its global rank.
WHERE = r"""
import datetime, json, os, sys, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
got = [None] * dist.get_world_size()
dist.all_gather_object(got, [os.environ["GF_BENCH_NODE"], os.environ["LOCAL_WORLD_SIZE"], dist.get_rank()])
if dist.get_rank() == 0:
    open(os.path.join(sys.argv[1], "where.json"), "w").write(json.dumps(got))
dist.destroy_process_group()
"""


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
    return [int(p) for p in out.split()]


def _with_module(tmp_path: Path, name: str, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``name`` importable by the ranks (the launcher hands its environment to torchrun and them)."""
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), SRC, os.environ.get("PYTHONPATH", "")]))


# ---- plumbing (no root) --------------------------------------------------------------------------
def test_a_mode_carries_its_topology_to_the_wrapper_as_a_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    import gradientflow as gf
    from gradientflow.bench.runner_worker import _build

    assert split_mode("gf-fp16@flat") == ("gf-fp16", "flat") and split_mode("ddp") == ("ddp", None)
    assert topology_kwargs("gf-topk-fp16@2x4") == {"topology": "2x4"}
    assert topology_kwargs("gf-fp16") == {} and topology_kwargs("gf-auto@auto") == {"topology": "auto"}
    for bad, says in (
        ("ddp@flat", "only gradientflow modes"),
        ("gf-fp16@3y2", "topology must be .auto."),
        ("gf-x", "unknown"),
    ):
        with pytest.raises(ValueError, match=says):
            split_mode(bad)
    seen: list[dict[str, Any]] = []

    def fake(model: torch.nn.Module, **kw: Any) -> torch.nn.Module:  # records what the bench passes
        seen.append(kw)
        return model

    monkeypatch.setattr(gf, "DistributedDataParallel", fake)
    spec = BenchSpec("small_cnn", 2, 1, 0, [], "unused", optimizer="adamw")
    for mode in (
        "gf-fp16@flat",
        "gf-fp16",
        "gf-auto@flat",
        "gf-topk-fp16:csc_scope=global,schedule=auto@2x2",
        "gf-topk-3bit@2x2",
    ):
        _, opt, _ = _build(Variant(mode, mode, 25.0), spec, 1024, torch.device("cpu"))
        assert isinstance(opt, torch.optim.AdamW)
    assert [kw.get("topology") for kw in seen] == ["flat", None, "flat", "2x2", "2x2"]
    # every gradientflow mode is a recipe of the table with options (runner_spec.gf_recipe)
    assert seen[0]["compression"] == "fp16" and seen[2]["compression"] == "auto" and "warmup_steps" not in seen[2]
    assert (seen[3]["compression"], seen[3]["schedule"]) == ("topk-fp16", "auto")
    # gf-topk-3bit: timed on sparse steps (no ramp) at the bench's chunk size, as the other top-k modes
    assert (seen[4]["compression"], seen[4]["warmup_steps"], seen[4]["chunk_size"]) == ("topk-3bit", 0, 1024)
    # a schedule="auto" mode keeps its own θ with a suffix too; the flat twin is its own row
    names = [
        (v.name, v.theta_mb)
        for v in plan_variants(["gf-topk-fp16:csc_scope=global,schedule=auto@flat", "gf-fp16@flat"], 25.0, [], False)
    ]
    assert names == [
        ("compute", None),
        ("gf-topk-fp16:csc_scope=global,schedule=auto@flat", None),
        ("gf-fp16@flat", 25.0),
    ]


def test_quality_recipes_take_a_topology() -> None:
    from gradientflow.bench.quality_recipes import parse_recipe

    assert parse_recipe("gf-auto:topology=flat") == ("gf-auto", {"topology": "flat"})
    assert parse_recipe("gf-auto:topology=2x2") == ("gf-auto", {"topology": "2x2"})
    with pytest.raises(ValueError, match="topology must be 'auto'"):
        parse_recipe("gf-auto:topology=sideways")


@pytest.mark.parametrize(
    "args, says",
    [
        (["--nproc", "3", "--nproc-per-node", "2"], "not a multiple of --nproc-per-node 2"),
        (["--quality", "--nproc", "5", "--nproc-per-node", "2"], "not a multiple of --nproc-per-node 2"),
        (["--nproc", "4", "--nproc-per-node", "2", "--links", "all"], "drop --nproc-per-node or --links"),
        (["--modes", "ddp@flat"], "only gradientflow modes"),
        (["--nproc-per-node", "0"], "--nproc-per-node"),
    ],
)
def test_bench_refuses_a_layout_it_cannot_run(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["bench", *args])  # refused before anything runs
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    assert code == 2
    assert says in capsys.readouterr().err


def test_c10d_launch_is_the_users_command_line() -> None:
    argv = c10d_torchrun_argv(
        nnodes=2,
        nproc_per_node=4,
        endpoint="169.254.77.2:29500",
        rdzv_id="job",
        local_addr="169.254.77.6",
        hosts_store=False,
        args=["spec.json"],
    )
    line = " ".join(argv)
    assert "-m torch.distributed.run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d" in line
    assert "--rdzv-endpoint 169.254.77.2:29500 --rdzv-id job --rdzv-conf is_host=0 --local-addr 169.254.77.6" in line
    with pytest.raises(ValueError, match="multiple"):
        launch_workers("x", Path("spec.json"), Path("."), 3, None, 10, 1, nproc_per_node=2)


def test_nodes_on_loopback_are_torchruns_joined_by_c10d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --bandwidth none --nproc 4 --nproc-per-node 2: two torchruns of two ranks, one world of four
    _with_module(tmp_path, "gf_where", WHERE, monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    reason, log, _ = launch_workers(
        "lo", out, tmp_path, 4, None, timeout=90, threads=1, module="gf_where", nproc_per_node=2
    )
    assert reason is None, log.read_text()[-3000:]
    got = json.loads((out / "where.json").read_text())
    assert sorted(rank for _, _, rank in got) == [0, 1, 2, 3]
    assert all(local == "2" for _, local, _ in got)
    assert sorted(node for node, _, _ in got) == ["0", "0", "1", "1"]
    assert got[0][0] == got[1][0] and got[2][0] == got[3][0]  # a node's ranks are next to each other


def test_link_counters_and_their_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stats = tmp_path / "veth0" / "statistics"
    stats.mkdir(parents=True)
    (stats / "tx_bytes").write_text("1000\n")
    (stats / "rx_bytes").write_text("250\n")
    assert LinkCounter("veth0", root=tmp_path).read() == (1000, 250)
    with pytest.raises(ValueError, match="no interface"):
        LinkCounter("eth9", root=tmp_path)
    monkeypatch.delenv(LINK_ENV, raising=False)
    assert LinkCounter.from_env() is None  # loopback: no link to count
    # two nodes of two ranks; node 1's local rank 0 is rank 3 (c10d hands out node ranks by arrival)
    st = [{"payload_bytes": 100.0}, {"payload_bytes": 100.0}]
    ranks = [
        {"link": [[10, 20], [30, 40]], "stats": st},
        {"link": [], "stats": st},
        {"link": [], "stats": st},
        {"link": [[50, 60], [70, 80]], "stats": [{"payload_bytes": 300.0, "inter_node_bytes": 5.0}] * 2},
    ]
    nodes = per_node(ranks, [0, 0, 1, 1], 2)
    assert nodes[0] == {
        "node": 0,
        "ranks": 2,
        "tx_bytes": [10, 30],
        "rx_bytes": [20, 40],
        "payload_bytes": [200.0, 200.0],
        "inter_node_bytes": None,  # not every rank reports it: the column stays empty
    }
    assert nodes[1]["payload_bytes"] == [400.0, 400.0] and nodes[1]["tx_bytes"] == [50, 70]
    both = per_node([ranks[3], ranks[3]], [1, 1], 2)  # every rank of the node reports it: summed
    assert both[0]["inter_node_bytes"] == [10.0, 10.0]
    s = link_summary(nodes)
    assert (s["link_tx_bytes"], s["link_rx_bytes"], s["node_payload_bytes"]) == (60.0, 70.0, 400.0)
    assert s["node_inter_node_bytes"] is None and link_summary(None) == {}
    row = {"name": "gf-none", "mode": "gf-none", "status": "ok", **s}
    table = "\n".join(link_table({"rows": [row]}))
    assert "| gf-none | 1 | 2 | 0.00 | 0.00 | 0.00 | — |" in table
    assert link_table({"rows": [{"name": "ddp", "mode": "ddp", "status": "ok"}]}) == []  # loopback: no table


def test_quality_reports_each_nodes_link_from_its_ranks() -> None:
    from gradientflow.bench.quality_worker import _merge

    def rank(node: int, link: list[list[int]]) -> dict[str, Any]:
        run = {"step_s": [0.1, 0.2], "link": link, "evals": []}
        return {
            "probe_s": [0.1],
            "node": node,
            "runs": [
                {**run, "recipe": "gf-auto", "stats": [{"payload_bytes": 5.0}] * 2},
                {**run, "recipe": "ddp-fp16-hook", "stats": [{"payload_bytes": 7.0}] * 2},  # computed, not ours
            ],
        }

    merged = _merge([rank(0, [[10, 20], [11, 21]]), rank(0, []), rank(1, [[30, 40], [31, 41]]), rank(1, [])])
    gf, hook = merged["runs"]
    assert [n["tx_bytes"] for n in gf["nodes"]] == [[10, 11], [30, 31]] and "link" not in gf
    assert gf["nodes"][0]["payload_bytes"] == [10.0, 10.0]  # the engine's, summed over the node's two ranks
    assert hook["nodes"][0]["payload_bytes"] is None and hook["nodes"][1]["rx_bytes"] == [40, 41]
    on_loopback = _merge([rank(0, []), rank(0, [])])
    assert "nodes" not in on_loopback["runs"][0]


# ---- on an emulated cluster (root) --------------------------------------------------------------------
@needs_netns
def test_a_nodes_ranks_talk_over_its_loopback_and_only_between_nodes_over_its_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _with_module(tmp_path, "gf_intra_inter", INTRA_INTER, monkeypatch)
    out = tmp_path / "out"  # the ranks' argument (where the launcher puts the spec's path): they write here
    out.mkdir()
    prefix = PREFIX + "t"
    with EmulatedCluster(nodes=2, rate="1gbit", prefix=prefix) as c:
        reason, log, _ = launch_workers(
            "nodes", out, tmp_path, 4, c, timeout=90, threads=1, module="gf_intra_inter", nproc_per_node=2
        )
        assert reason is None, log.read_text()[-3000:]
        assert all(not _netns_pids(ns) for ns in c.namespaces)
    assert leftovers(prefix) == []
    got = [json.loads((out / f"node{i}.json").read_text()) for i in range(2)]
    nbytes = 4 * MB4
    for node in got:
        assert node["ranks_on_node"] == 2 and node["gloo_if"] == c.ifnames[node["node"]]
        # 4 MiB allreduced between the two ranks of a node: only barriers' bytes cross the link
        assert sum(node["intra"]) < 64 << 10, node
        # 4 MiB between one rank per node: a two-rank allreduce sends (and receives) the whole tensor once
        tx, rx = node["inter"]
        assert 0.95 * nbytes < tx < 1.25 * nbytes and 0.95 * nbytes < rx < 1.25 * nbytes, node


@needs_netns
def test_a_failing_rank_on_a_node_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _with_module(tmp_path, "gf_failing_node_rank", FAILING_RANK, monkeypatch)
    (tmp_path / "spec.json").write_text("{}")
    prefix = PREFIX + "f"
    with EmulatedCluster(nodes=2, rate="1gbit", prefix=prefix) as c:
        reason, log, _ = launch_workers(
            "fail",
            tmp_path / "spec.json",
            tmp_path,
            4,
            c,
            timeout=90,
            threads=1,
            module="gf_failing_node_rank",
            nproc_per_node=2,
        )
        assert reason is not None and "exited with code" in reason, log.read_text()[-3000:]
        assert all(not _netns_pids(ns) for ns in c.namespaces)  # every rank is gone, not just the launchers
    assert leftovers(prefix) == []


@needs_netns
@pytest.mark.parametrize("nproc, per_node", [(4, 2), (2, 1)], ids=["2x2", "2x1"])
def test_bench_reports_the_bytes_on_each_nodes_link(nproc: int, per_node: int, tmp_path: Path) -> None:
    prefix = PREFIX + "b"
    cmd = [
        sys.executable, "-m", "gradientflow.cli", "bench", "--workload", "small_cnn", "--nproc", str(nproc),
        "--nproc-per-node", str(per_node), "--bandwidth", "1gbit", "--steps", "2", "--warmup", "1",
        "--modes", "gf-none", "gf-none@flat", "--no-alone", "--netns-prefix", prefix, "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftovers(prefix) == []
    res = json.loads((tmp_path / "results.json").read_text())
    assert (res["world_size"], res["nodes"], res["nproc_per_node"]) == (nproc, 2, per_node)
    rows = {r["name"]: r for r in res["rows"]}
    grad = 4 * res["n_params"]
    # Two-level (2 x 2, torchrun's layout): each rank's half-gradient shard in a ring over the M = 2 nodes,
    # 2(M-1)/M shards, so one gradient per node's link; one rank per node (2 x 1) is flat's ring, the same.
    # Forced flat: Gloo's ring over N ranks, a node's ranks next to each other in it: each node sends on one
    # edge between nodes 2(N-1)/N gradients (1.5 at 2 x 2, 1 at 2 x 1).  Headers on top of each.
    # The engine's payload, a node's ranks summed: what they hand to the exchange between nodes, one gradient when
    # two-level (each rank its 1/G shard) and G gradients when flat (each rank the whole of its buffers).
    payloads = {"gf-none": grad, "gf-none@flat": per_node * grad}
    for mode, ring in (("gf-none", 2 * (2 - 1) / 2 * grad), ("gf-none@flat", 2 * (nproc - 1) / nproc * grad)):
        assert [n["node"] for n in rows[mode]["link_nodes"]] == [0, 1]
        for node in rows[mode]["link_nodes"]:
            assert 0.95 * ring < node["tx_bytes"] < 1.25 * ring and 0.95 * ring < node["rx_bytes"] < 1.25 * ring, (
                mode,
                node,
            )
            assert node["payload_bytes"] == pytest.approx(payloads[mode], rel=0.05)  # the engine's, ranks summed
    assert rows["compute"]["link_tx_bytes"] < 64 << 10  # no gradients: the barriers' bytes alone
    assert f"| gf-none | 1 | {per_node} |" in (tmp_path / "table.md").read_text()


def test_the_report_sets_each_mode_beside_its_flat_twin() -> None:
    from gradientflow.bench.report_tables import layout_pairs_table

    def row(name: str, step_s: float, tx: float | None) -> dict[str, Any]:
        return {"name": name, "mode": name.split("@")[0], "status": "ok", "alone": False, "sweep": False,
                "median_s": step_s, "link_tx_bytes": tx}  # fmt: skip

    mb = 2**20
    rows = [row("gf-fp16", 0.9, 50 * mb), row("gf-fp16@flat", 1.2, 75 * mb), row("ddp", 2.0, 150 * mb)]
    lines = layout_pairs_table({"rows": rows})
    # 0.9 / 1.2 = 0.75 of the step, 50 / 75 = 0.67 of the bytes; ddp has no twin and gets no row
    assert lines[-1] == "| gf-fp16 | 900 | 1200 | 0.75 | 50.00 | 75.00 | 0.67 |"
    assert sum(line.startswith("| gf-") for line in lines) == 1 and not any("| ddp" in line for line in lines)
    assert layout_pairs_table({"rows": [row("gf-fp16", 0.9, None)]}) == []  # no twin: no table
