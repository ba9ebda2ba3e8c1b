"""Turn the bench's raw per-step times into statistics, a markdown table, JSON and a PNG plot."""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
        for kind, base in (("gf", "gf-fp32"), ("ddp", "ddp")):
            named = [r for r in rows if r["name"] == f"{base} θ={theta:g}"]
            if not named and base == "gf-fp32" and theta == opts.fusion_mb:
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
        "options": asdict(opts) if is_dataclass(opts) else dict(vars(opts)),
        "network": f"emulated {opts.bandwidth} per node (tc tbf, network namespaces)" if emulated else "loopback",
        "world_size": world,
        "n_params": main.get("n_params"),
        "chunk_size": main.get("chunk_size"),
        "threads_per_rank": main.get("threads_per_rank"),
        "base_rss_mb": main.get("base_rss_mb"),
        "host": {"machine": platform.machine(), "python": platform.python_version(), "torch": _torch_version()},
        "definitions": {
            "speedup": SPEEDUP_DEF,
            "memory": MEMORY_DEF,
            "wire": WIRE_DEF,
            "exposed": EXPOSED_DEF,
            "alone": ALONE_DEF,
            "shares": SHARE_DEF,
            "thread_cpu": CPU_DEF,
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


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}"


def _step_cell(r: dict[str, Any]) -> str:
    """``median (p10–p90)`` in ms."""
    return f"{_ms(r['median_s'])} ({_ms(r['p10_s'])}–{_ms(r['p90_s'])})"


def _alone_cell(r: dict[str, Any], spread: bool = True) -> str:
    """The alone twin's median step (p10–p90), or a dash (no twin, or the compute mode itself)."""
    if r.get("alone_s") is None:
        return "—"
    return f"{_ms(r['alone_s'])} ({_ms(r['alone_p10_s'])}–{_ms(r['alone_p90_s'])})" if spread else _ms(r["alone_s"])


def step_table_row(r: dict[str, Any]) -> bool:
    """A row of the step-time tables: not a θ sweep point, not an alone twin (its figure is a column)."""
    return not r.get("sweep") and not r.get("alone")


def _mem(r: dict[str, Any]) -> str:
    """The +mem cell: MB, or a dash where the mode was not measured."""
    return "—" if r.get("mem_added_mb") is None else f"{r['mem_added_mb']:.0f}"


def _own_work_rows(rows: list[dict[str, Any]], label: Any) -> list[str]:
    """One table row per mode with phase counters: ms per phase, own CPU total, host syncs."""
    out = []
    for r in rows:
        cells = " | ".join(f"{r['phases_ms'].get(p, 0.0):.1f}" for p in PHASES)
        syncs = "—" if r.get("host_syncs") is None else f"{r['host_syncs']:.0f}"
        out.append(f"| {label(r)} | {cells} | {r['own_cpu_s'] * 1e3:.1f} | {syncs} |")
    return out


def _cpu(r: dict[str, Any]) -> str:
    """ "thread CPU ms (+ over the compute mode)"; the compute mode itself has no bracket."""
    cpu, added = r.get("thread_cpu_s"), r.get("thread_cpu_added_s")
    if cpu is None:
        return "—"
    return _ms(cpu) if added is None else f"{_ms(cpu)} ({added * 1e3:+.0f})"


def _shares(r: dict[str, Any]) -> str:
    """ "compute / own CPU / comm" in percent of the median step ('—' for what is not measured)."""
    parts = [r.get("compute_share"), r.get("own_cpu_share"), r.get("comm_share")]
    if r.get("mode") == "compute":
        parts = [1.0, None, 0.0]
    return " / ".join("—" if x is None else f"{100 * x:.0f}" for x in parts)


def markdown(summary: dict[str, Any]) -> str:
    """The tables, ready to paste into the README, with what each column means."""
    o = summary["options"]
    n = summary["world_size"]
    warnings = [f"**Warning**: {w}." for w in summary.get("reference_warnings", [])]
    lines = [
        f"`{summary['command']}`" if summary["command"] else "",
        "",
        *([*warnings, ""] if warnings else []),
        f"{o['workload']} ({summary['n_params']:,} parameters), {n} ranks"
        f"{'' if o.get('device', 'cpu') == 'cpu' else ' on ' + o['device'].upper()}, {summary['network']}, batch "
        f"{o['batch_size']}/rank, {summary['threads_per_rank']} thread(s)/rank; medians of {o['steps']} timed steps "
        f"after {o['warmup']} warm-up steps, all modes interleaved step by step in one launch "
        "(ddp-powersgd: one bucket, own launch with its own compute reference; the alone twins: a launch of "
        "their own, with its own compute reference).",
        "",
        f"| mode | θ MB | step ms median (p10–p90) | alone ms (p10–p90) | samples/s | speedup (ideal {n}) "
        "| wire MB/step | exposed comm ms | compute / own CPU / comm % | thread CPU ms (vs compute) | +mem MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        if not step_table_row(r):
            continue
        theta = "—" if r.get("theta_mb") is None else f"{r['theta_mb']:g}"
        if r["mode"].startswith("ddp") and r.get("theta_mb") is None:
            theta = "all" if r["mode"] == "ddp-powersgd" else "25"
        if r["status"] != "ok":
            err = (r.get("error") or "failed").replace("|", "/")
            lines.append(f"| {r['name']} | {theta} | failed: {err[:260]} | | | | | | | | |")
            continue
        wire = r.get("wire_bytes")
        wire_s = "—" if wire is None else f"{wire / 2**20:.2f}" + (" c" if r["wire_source"] == "computed" else "")
        exp = r.get("exposed_s")
        exp_s = "—" if exp is None else _ms(exp) + (" d" if r.get("exposed_source") == "derived" else "")
        speed = "—" if r.get("speedup") is None else f"{r['speedup']:.2f}"
        lines.append(
            f"| {r['name']} | {theta} | {_step_cell(r)} | {_alone_cell(r)} "
            f"| {r['samples_per_s']:.1f} | {speed} | {wire_s} | {exp_s} | {_shares(r)} | {_cpu(r)} "
            f"| {_mem(r)} |"
        )
    phased = [r for r in summary["rows"] if r.get("phases_ms") and step_table_row(r)]
    if phased:
        lines += [
            "",
            "Per-phase host time of gradientflow's own work (median ms per step, slowest rank; "
            "comm_stats()' phase_*_s):",
            "",
            "| mode | " + " | ".join(PHASES) + " | phases total | host syncs/step |",
            "|---|" + "---|" * (len(PHASES) + 2),
        ]
        lines += _own_work_rows(phased, lambda r: r["name"])
    if summary["sweep"]:
        by_name = {r["name"]: r for r in summary["rows"]}
        lines += [
            "",
            "θ sweep (gradientflow fusion_threshold_mb vs DDP bucket_cap_mb, same run):",
            "",
            "| θ MB | gradientflow fp32 ms (p10–p90) | collectives/step | DDP ms (p10–p90) | gf / DDP |",
            "|---|---|---|---|---|",
        ]
        for pair in summary["sweep"]:
            g, d = by_name.get(pair["gf"] or ""), by_name.get(pair["ddp"] or "")

            def cell(r: dict[str, Any] | None) -> str:
                if r is None or r["status"] != "ok":
                    return "failed" if r else "—"
                return _step_cell(r)

            ratio = (
                f"{g['median_s'] / d['median_s']:.2f}" if g and d and g.get("median_s") and d.get("median_s") else "—"
            )
            coll = f"{g['collectives']:.0f}" if g and g.get("collectives") is not None else "—"
            lines.append(f"| {pair['theta_mb']:g} | {cell(g)} | {coll} | {cell(d)} | {ratio} |")
    d = summary["definitions"]
    lines += [
        "",
        f"- {d['speedup']}",
        f"- {d['alone']}",
        f"- {d['wire']}",
        f"- {d['exposed']}",
        f"- {d['shares']}",
        f"- {d['thread_cpu']}",
        f"- {d['memory']} Base RSS of a rank before any model: {summary['base_rss_mb']:.0f} MB.",
    ]
    return "\n".join(lines).strip() + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    """Bar chart of median step time (p10–p90 whiskers) per mode; θ sweep curves if there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if step_table_row(r) and r["status"] == "ok"]
    has_sweep = bool(summary["sweep"])
    fig, axes = plt.subplots(1, 2 if has_sweep else 1, figsize=(13 if has_sweep else 8, 4.5), squeeze=False)
    ax = axes[0][0]
    med = [r["median_s"] * 1e3 for r in rows]
    err = [[m - r["p10_s"] * 1e3 for m, r in zip(med, rows)], [r["p90_s"] * 1e3 - m for m, r in zip(med, rows)]]
    colors = [
        "tab:gray" if r["mode"] == "compute" else "tab:blue" if r["mode"].startswith("gf") else "tab:orange"
        for r in rows
    ]
    ax.bar([r["name"] for r in rows], med, yerr=err, color=colors, capsize=4)
    alone = [(r["name"], r["alone_s"] * 1e3) for r in rows if r.get("alone_s") is not None]
    if alone:
        ax.scatter(
            [a for a, _ in alone],
            [b for _, b in alone],
            marker="_",
            s=400,
            color="black",
            zorder=3,
            label="the same mode alone (no network)",
        )
        ax.legend(fontsize=8)
    ax.set_ylabel("step time, ms (median, p10–p90)")
    o = summary["options"]
    ax.set_title(f"{o['workload']}, {summary['world_size']} ranks, {summary['network']}", fontsize=9)
    ax.tick_params(axis="x", rotation=30)
    if has_sweep:
        by_name = {r["name"]: r for r in summary["rows"]}
        ax2 = axes[0][1]
        for kind, label, color in (("gf", "gradientflow fp32", "tab:blue"), ("ddp", "torch DDP", "tab:orange")):
            pts = [
                (p["theta_mb"], by_name[p[kind]])
                for p in summary["sweep"]
                if p.get(kind) and by_name.get(p[kind], {}).get("status") == "ok"
            ]
            if pts:
                ax2.plot([t for t, _ in pts], [r["median_s"] * 1e3 for _, r in pts], "o-", label=label, color=color)
        ax2.set_xscale("symlog", linthresh=1)
        ax2.set_xlabel("θ = fusion threshold / bucket size, MB")
        ax2.set_ylabel("median step time, ms")
        ax2.set_title("what fusion buys (same run)", fontsize=9)
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


MODE_LABELS = {
    "compute": "compute (no communication)",
    "gf-fp32": "gradientflow fp32",
    "gf-fp16": "gradientflow fp16",
    "gf-bf16": 'gradientflow bf16 (`"half"` on CPU)',
    "gf-fp16-csc": 'gradientflow fp16 + CSC 0.1, `csc_scope="global"`',
    "gf-fp16-csc-slice": 'gradientflow fp16 + CSC 0.1 (default `"slice"`)',
    "gf-bf16-csc-slice": 'gradientflow bf16 + CSC 0.1, `"slice"` (`"half"` on CPU)',
    "ddp": "torch DDP",
    "ddp-fp16": "DDP + fp16_compress_hook",
    "ddp-powersgd": "DDP + PowerSGD hook (rank 1, one bucket; own launch)",
}
"""The README's names of the bench's modes."""
HEADLINE_MODE = "gf-fp16-csc-slice"
"""What ``comm_dtype="fp16", density=0.1`` does on the defaults: bold in the README's tables."""


def readme_tables(summary: dict[str, Any]) -> str:
    """The README's form of the step-time and own-work tables: fewer columns than :func:`markdown`,
    plain-language mode names, the headline mode in bold.  ``readme.md`` holds it; a test checks that
    the README's tables are exactly this, made from the committed ``results.json``."""

    def bold(r: dict[str, Any], text: str) -> str:
        return f"**{text}**" if r["name"] == HEADLINE_MODE else text

    def label(r: dict[str, Any]) -> str:
        return bold(r, MODE_LABELS.get(r["name"], r["name"]))

    rows = [r for r in summary["rows"] if step_table_row(r) and r["status"] == "ok"]
    out = [
        "| mode | step ms (p10–p90) | alone ms | speedup | wire MB/step | exposed ms | compute / own CPU / comm % "
        "| thread CPU ms (vs compute) | +mem MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step = bold(r, _step_cell(r))
        speed = "—" if r.get("speedup") is None else bold(r, f"{r['speedup']:.2f}")
        wire = "—" if r.get("wire_bytes") is None else f"{r['wire_bytes'] / 2**20:.2f}"
        alone = _alone_cell(r, spread=False)
        out.append(
            f"| {label(r)} | {step} | {alone} | {speed} | {wire} | {_ms(r.get('exposed_s'))} | {_shares(r)} "
            f"| {_cpu(r)} | {_mem(r)} |"
        )
    phased = [r for r in rows if r.get("phases_ms")]
    if phased:
        out += [
            "",
            "| own work, ms/step | "
            + " | ".join(p.replace("_", " ") for p in PHASES)
            + " | phases total | host syncs |",
            "|---|" + "---|" * (len(PHASES) + 2),
        ]
        out += _own_work_rows(phased, label)
    return "\n".join(out) + "\n"


def write_all(summary: dict[str, Any], out: Path) -> None:
    """``results.json``, ``table.md``, ``readme.md`` and ``bench.png`` in ``out``; the table is also printed."""
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    table = markdown(summary)
    (out / "table.md").write_text(table)
    (out / "readme.md").write_text(readme_tables(summary))
    plot(summary, out / "bench.png")
    print(table)
