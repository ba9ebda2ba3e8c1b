"""Turn the bench's raw per-step times into statistics, a markdown table, JSON and a PNG plot."""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradientflow.bench.link_bytes import link_summary
from gradientflow.bench.mode_names import DENSE_FP32
from gradientflow.bench.report_tables import markdown, plot, readme_tables, step_table_row
from gradientflow.diagnostics.stats import PHASES

SPEEDUP_DEF = (
    "speedup = N x t_1rank / t_Nrank (the paper's metric), where t_1rank is the median step time of the "
    "'compute' mode measured in the same launch: the same model and batch per rank with no communication "
    "at all, i.e. what one rank alone takes per step on this machine. Ideal = N."
)
MEMORY_DEF = (
    "+mem = peak resident set (RSS, sampled every 2 ms) while the mode was built and ran its warm-up steps, "
    "minus the RSS just before; i.e. the memory this mode adds to a rank: parameters, gradients, optimizer "
    "state, communication buffers and activations. Max over ranks. Add base_rss_mb for a whole-process figure. "
    "With --device cuda: the peak of torch.cuda.max_memory_allocated over the same span, minus the allocated "
    "memory just before (GPU memory; the host RSS is then not shown)."
)
WIRE_DEF = (
    "wire = bytes one rank hands to allreduce per step (gradientflow: measured, comm_stats()['payload_bytes']; "
    "DDP modes: computed from the parameter sizes and the hook's dtype/compression rule, marked c). "
    "A ring allreduce puts 2(N-1)/N times this on each rank's link."
)
SHARE_DEF = (
    "compute / own CPU / comm = shares of the median step: the compute mode's median step (what the model "
    "itself costs); own CPU = the same mode's median step alone (the mode rebuilt on a one-rank process group "
    "of each rank: every pass over the gradients runs, ours and autograd's accumulation into the pool, and no "
    "collective has anyone to wait for; timed in a launch of their own, interleaved with a compute mode of "
    "that launch) minus that compute mode's: what the mode costs a step apart from the network; comm = the "
    "rest (the wire, waiting on the slower rank, the CPU the network and the collectives' threads take). "
    "'—' where a mode has no alone twin (--no-alone)."
)
ALONE_DEF = (
    "alone = that median step alone, its p10–p90 in brackets: the fastest this mode can be on this machine "
    "with an infinitely fast network."
)
CPU_DEF = (
    "thread CPU = CPU time charged to the training thread per step (time.thread_time(); on CPU it runs forward, "
    "backward with every gradient hook and the optimizer), median, slowest rank per step; in brackets the "
    "difference to the compute mode's: the CPU a mode adds to the training thread, gradientflow's own work "
    "and autograd's accumulation included. Gloo's threads are not in it; interrupts are: on a kernel without "
    "IRQ time accounting the network processing that lands while the thread runs is charged to it, so on an "
    "emulated link the bracket also holds part of the network's cost."
)
NOISY_REFERENCE = 1.10
"""A compute reference whose median step is more than 10% above its own p10 sat in a slow phase of
the machine (another process, a busy core) for much of the run: every speedup divides by it, so an
inflated reference inflates them all, and the report says so.  The launches behind the README's
tables stay within 1.08 (each ``results.json`` records its ``reference_warnings``)."""
LINK_DEF = (
    "link tx / rx = bytes the node's link interface sent / received per timed step, read from the kernel's "
    "counters (/sys/class/net/<link>/statistics/{tx,rx}_bytes in the node's namespace) after the barrier "
    "before the step and after a barrier after it: frames with their headers, TCP's ACKs and that barrier "
    "included, setup and the other modes' steps not; median over steps. Traffic between the ranks of one node "
    "stays on the node's loopback and is not in it. engine = comm_stats()['payload_bytes'] summed over the "
    "node's ranks (and 'inter_node_bytes' where the engine reports it; — where not), medians; torch DDP's "
    "modes have no engine count."
)
EXPOSED_DEF = (
    "exposed = communication time not hidden behind backward (gradientflow: measured, comm_stats()"
    "['exposed_seconds']; others: median step time minus the compute mode's, marked d)."
)

ALONE_SUFFIX = " alone"
"""Suffix of a mode's name when it runs alone (one-rank group): the report pairs it with the mode."""


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def _row(
    v: dict[str, Any],
    ref_s: float | None,
    ref_cpu_s: float | None,
    world: int,
    batch: int,
    alone: tuple[dict[str, Any], float] | None = None,
) -> dict[str, Any]:
    """One variant's statistics; ``alone``: its alone twin's record (see ``Variant.alone``) and the
    compute reference of the twin's own launch, if the twin was timed."""
    steps = v.get("step_s") or []
    row: dict[str, Any] = {k: v.get(k) for k in ("name", "mode", "theta_mb", "sweep", "alone", "status", "error")}
    row["steps"] = len(steps)
    row["mem_added_mb"] = v.get("mem_added_mb")
    if v.get("status") != "ok" or not steps:
        return row
    row.update(link_summary(v.get("nodes")))
    med = _pct(steps, 50)
    row.update(median_s=med, p10_s=_pct(steps, 10), p90_s=_pct(steps, 90), samples_per_s=world * batch / med)
    row["ref_compute_s"] = ref_s
    if v.get("cpu_s"):
        row["thread_cpu_s"] = _pct(v["cpu_s"], 50)
        if ref_cpu_s is not None and v.get("mode") != "compute":
            row["thread_cpu_added_s"] = row["thread_cpu_s"] - ref_cpu_s
    row["speedup"] = world * ref_s / med if ref_s else None
    stats = v.get("stats") or {}
    if alone is not None:
        twin, twin_ref = alone
        row.update(
            alone_s=_pct(twin["step_s"], 50),
            alone_p10_s=_pct(twin["step_s"], 10),
            alone_p90_s=_pct(twin["step_s"], 90),
            alone_ref_compute_s=twin_ref,
        )
    if ref_s:
        row["compute_share"] = min(1.0, ref_s / med)
        if alone is not None:  # the twin over the compute mode of its own launch, both timed side by side
            own = max(0.0, row["alone_s"] - row["alone_ref_compute_s"])
            row["own_cpu_share"] = min(own / med, 1.0 - row["compute_share"])
        if v.get("mode") != "compute":
            row["comm_share"] = 1.0 - row["compute_share"] - row.get("own_cpu_share", 0.0)
    phases = {p: stats[f"phase_{p}_s"] for p in PHASES if f"phase_{p}_s" in stats}
    if phases:
        row["phases_ms"] = {p: 1e3 * _pct(xs, 50) for p, xs in phases.items()}
        own = [sum(phases[p][i] for p in phases if p != "wire_wait") for i in range(len(steps))]
        row["own_cpu_s"] = _pct(own, 50)
        row["host_syncs"] = _pct(stats["host_syncs"], 50) if "host_syncs" in stats else None
    if stats.get("payload_bytes"):
        row["wire_bytes"], row["wire_source"] = _pct(stats["payload_bytes"], 50), "measured"
        row["exposed_s"], row["exposed_source"] = _pct(stats["exposed_seconds"], 50), "measured"
        row["collectives"] = _pct(stats["collectives"], 50)
    else:
        row["wire_bytes"], row["wire_source"] = v.get("computed_wire_bytes"), "computed"
        if v.get("mode") == "compute":
            row["exposed_s"], row["exposed_source"] = 0.0, "none"
        elif ref_s is not None:
            row["exposed_s"], row["exposed_source"] = max(0.0, med - ref_s), "derived"
    return row


def _compute_variant(launch: dict[str, Any]) -> dict[str, Any] | None:
    """A launch's compute mode (the reference its speedups divide by), if it timed any steps."""
    return next((v for v in launch["variants"] if v["mode"] == "compute" and v.get("step_s")), None)


def summarize(launches: list[dict[str, Any]], opts: Any, emulated: bool) -> dict[str, Any]:
    """Statistics per variant (see the *_DEF strings), the θ sweep pairs, and the raw data."""
    main = launches[0]
    world = main["world_size"]
    rows: list[dict[str, Any]] = []
    refs: dict[str, float | None] = {}
    twins: dict[str, tuple[dict[str, Any], float]] = {}  # a mode's alone twin and its launch's reference
    for launch in launches:
        comp = _compute_variant(launch)
        ref = refs[launch["name"]] = _pct(comp["step_s"], 50) if comp else None
        if ref is not None:
            twins.update(
                {
                    v["name"].removesuffix(ALONE_SUFFIX): (v, ref)
                    for v in launch["variants"]
                    if v.get("alone") and v.get("status") == "ok" and v.get("step_s")
                }
            )
    for launch in launches:
        comp = _compute_variant(launch)
        ref = refs[launch["name"]]
        ref_cpu = _pct(comp["cpu_s"], 50) if comp and comp.get("cpu_s") else None
        for v in launch["variants"]:
            if launch["name"] != "main" and v["mode"] == "compute":
                continue  # the isolated launch's own reference; shown as ref_compute_s of its modes
            row = _row(v, ref, ref_cpu, world, opts.batch_size, None if v.get("alone") else twins.get(v["name"]))
            row["launch"] = launch["name"]
            rows.append(row)
    sweep = []
    for theta in opts.theta_sweep:
        pair = {"theta_mb": theta}
        for kind, base in (("gf", DENSE_FP32), ("ddp", "ddp")):
            named = [r for r in rows if r["name"] == f"{base} θ={theta:g}"]
            if not named and base == DENSE_FP32 and theta == opts.fusion_mb:
                named = [r for r in rows if r["name"] == base]
            if not named and base == "ddp" and theta == 25.0:
                named = [r for r in rows if r["name"] == base]
            pair[kind] = named[0]["name"] if named else None
        sweep.append(pair)
    return {
        "reference_warnings": reference_warnings(launches),
        "command": " ".join(["gradientflow", *sys.argv[1:]])
        if sys.argv[0].endswith(("gradientflow", "cli.py"))
        else None,
        "options": asdict(opts) if is_dataclass(opts) and not isinstance(opts, type) else dict(vars(opts)),
        "network": f"emulated {opts.bandwidth} per node (tc tbf, network namespaces)" if emulated else "loopback",
        "world_size": world,
        "nodes": main.get("nodes", world),
        "nproc_per_node": world // max(1, main.get("nodes", world)),
        "n_params": main.get("n_params"),
        "chunk_size": main.get("chunk_size"),
        "threads_per_rank": main.get("threads_per_rank"),
        "base_rss_mb": main.get("base_rss_mb"),
        "host": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "torch": _torch_version(),
            "cpus": os.cpu_count(),  # the cores every rank and the emulated network shared (sim.validate)
            "loadavg_1min": os.getloadavg()[0],  # at the report: what else was running
        },
        "definitions": {
            "speedup": SPEEDUP_DEF,
            "memory": MEMORY_DEF,
            "wire": WIRE_DEF,
            "exposed": EXPOSED_DEF,
            "alone": ALONE_DEF,
            "shares": SHARE_DEF,
            "thread_cpu": CPU_DEF,
            "link": LINK_DEF,
        },
        "rows": rows,
        "sweep": sweep,
        "launches": launches,
    }


def reference_warnings(launches: list[dict[str, Any]]) -> list[str]:
    """One line per launch whose compute reference was noisy (median > ``NOISY_REFERENCE`` x p10)."""
    out = []
    for launch in launches:
        comp = _compute_variant(launch)
        if comp is None:
            continue
        med, p10 = _pct(comp["step_s"], 50), _pct(comp["step_s"], 10)
        if med > NOISY_REFERENCE * p10:
            out.append(
                f"launch '{launch['name']}': the compute reference was noisy (median {med * 1e3:.0f} ms, p10 "
                f"{p10 * 1e3:.0f} ms, +{(med / p10 - 1) * 100:.0f}%): the speedups are relative to it and may be "
                "inflated; re-run with nothing else running"
            )
    return out


def _torch_version() -> str:
    import torch

    return torch.__version__


def write_all(summary: dict[str, Any], out: Path) -> None:
    """``results.json``, ``table.md``, ``readme.md`` and ``bench.png`` in ``out``; the table is also printed."""
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    table = markdown(summary)
    (out / "table.md").write_text(table)
    (out / "readme.md").write_text(readme_tables(summary))
    plot(summary, out / "bench.png")
    print(table)


__all__ = [
    "ALONE_SUFFIX",
    "markdown",
    "plot",
    "readme_tables",
    "reference_warnings",
    "step_table_row",
    "summarize",
    "write_all",
]
