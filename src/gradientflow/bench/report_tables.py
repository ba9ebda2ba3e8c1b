"""The bench's tables and plot: the markdown table, the README's form of it, and the PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradientflow.bench.mode_names import canonical_summary
from gradientflow.diagnostics.extras import can_plot
from gradientflow.diagnostics.stats import PHASES


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


def _layout(summary: dict[str, Any]) -> str:
    """`` as 2 nodes x 2`` where nodes hold several ranks; nothing for one rank per node (or old results)."""
    k = summary.get("nproc_per_node", 1)
    return f" as {summary['nodes']} nodes x {k}" if k > 1 and summary.get("nodes", 1) > 1 else ""


def _mb(x: float | None) -> str:
    return "—" if x is None else f"{x / 2**20:.2f}"


def _has_link_data(summary: dict[str, Any]) -> bool:
    return any(r.get("link_tx_bytes") is not None for r in summary["rows"])


def link_table(summary: dict[str, Any]) -> list[str]:
    """Per mode and node, the bytes the kernel counted on the node's link beside the engine's own count
    (lines to add to the markdown; none off an emulated cluster)."""
    if not _has_link_data(summary):
        return []
    lines = [
        "",
        "Bytes on each node's link per step, the kernel's count (tx / rx of the node's link interface) beside "
        "the engine's (comm_stats(), summed over the node's ranks):",
        "",
        "| mode | node | ranks | link tx MB/step | link rx MB/step | engine payload MB/step "
        "| engine inter-node MB/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        if not step_table_row(r) or r.get("status") != "ok":
            continue
        for nd in r.get("link_nodes") or []:
            lines.append(
                f"| {r['name']} | {nd['node']} | {nd['ranks']} | {_mb(nd['tx_bytes'])} | {_mb(nd['rx_bytes'])} "
                f"| {_mb(nd['payload_bytes'])} | {_mb(nd['inter_node_bytes'])} |"
            )
    return lines


def layout_pairs_table(summary: dict[str, Any]) -> list[str]:
    """Each gradientflow mode beside its ``@flat`` twin: step time and the bytes on the busiest node's link
    (the kernel's count, tx), two-level over flat (lines to add; none without such a pair)."""
    rows = {r["name"]: r for r in summary["rows"] if r.get("status") == "ok" and step_table_row(r)}
    pairs = [(name, rows[name + "@flat"]) for name in rows if not name.endswith("@flat") and name + "@flat" in rows]
    if not pairs:
        return []
    lines = [
        "",
        "Each mode as the launch's layout gives it (two-level with nodes of several ranks) against the same mode "
        "forced flat (`topology=\"flat\"`): step time and the bytes on the busiest node's link, the kernel's count:",
        "",
        "| mode | step ms | @flat step ms | step ratio | link tx MB/step | @flat link tx MB/step | bytes ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, flat in pairs:
        two = rows[name]
        tx, flat_tx = two.get("link_tx_bytes"), flat.get("link_tx_bytes")
        ratio = "—" if not tx or not flat_tx else f"{tx / flat_tx:.2f}"
        lines.append(
            f"| {name} | {_ms(two['median_s'])} | {_ms(flat['median_s'])} | {two['median_s'] / flat['median_s']:.2f} "
            f"| {_mb(tx)} | {_mb(flat_tx)} | {ratio} |"
        )
    return lines


def markdown(summary: dict[str, Any]) -> str:
    """The tables, ready to paste into the README, with what each column means (modes by the recipe table's
    names, also those of an older ``results.json``: :func:`~gradientflow.bench.mode_names.canonical_summary`)."""
    summary = canonical_summary(summary)
    o = summary["options"]
    n = summary["world_size"]
    warnings = [f"**Warning**: {w}." for w in summary.get("reference_warnings", [])]
    lines = [
        f"`{summary['command']}`" if summary["command"] else "",
        "",
        *([*warnings, ""] if warnings else []),
        f"{o['workload']} ({summary['n_params']:,} parameters), {n} ranks{_layout(summary)}"
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
    lines += link_table(summary)
    lines += layout_pairs_table(summary)
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
        *([f"- {d['link']}"] if "link" in d and _has_link_data(summary) else []),
        f"- {d['memory']} Base RSS of a rank before any model: {summary['base_rss_mb']:.0f} MB.",
    ]
    return "\n".join(lines).strip() + "\n"


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Bar chart of median step time (p10–p90 whiskers) per mode; θ sweep curves if there is one;
    False (and a line saying so) without matplotlib."""
    if not can_plot():
        return False
    summary = canonical_summary(summary)
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
    return True


MODE_LABELS = {
    "compute": "compute (no communication)",
    "gf-none": 'gradientflow `"none"` (fp32)',
    "gf-fp16": 'gradientflow `"fp16"`',
    "gf-bf16": 'gradientflow `"bf16"` (`"half"` on CPU)',
    "gf-topk-fp16:csc_scope=global": 'gradientflow `"topk-fp16"`, `csc_scope="global"`',
    "gf-topk-fp16": 'gradientflow `"topk-fp16"` (default `"slice"`)',
    "gf-none:comm_dtype=bf16,density=0.1": 'gradientflow top 10% in bf16, `"slice"` (`"half"` on CPU)',
    "gf-topk-fp16:csc_scope=global,schedule=auto": 'gradientflow `"topk-fp16"`, `schedule="auto"`',
    "ddp": "torch DDP",
    "ddp-fp16": "DDP + fp16_compress_hook",
    "ddp-powersgd": "DDP + PowerSGD hook (rank 1, one bucket; own launch)",
}
"""The README's names of the bench's modes (the recipe of each, by the table's name)."""
HEADLINE_MODE = "gf-topk-fp16"
"""What ``compression="topk-fp16"`` does on the defaults: bold in the README's tables."""


def readme_tables(summary: dict[str, Any]) -> str:
    """The README's form of the step-time and own-work tables: fewer columns than :func:`markdown`,
    plain-language mode names, the headline mode in bold.  ``readme.md`` holds it; a test checks that
    the README's tables are exactly this, made from the committed ``results.json``."""
    summary = canonical_summary(summary)

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
