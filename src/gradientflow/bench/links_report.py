"""The link-profile matrix: the bound, the efficiency and where the rest of the step went.

Per profile and mode (one bench run on that profile, its link measured first):

* ``t_bound = max(t_compute, wire / bulk_Bps)``: the step can be no shorter than the model's own
  step with no synchronisation at all (the ``compute`` mode of the same launch) nor than the time the
  step's wire bytes take at the link's measured bulk throughput.
* ``efficiency = t_bound / t_step`` (median step): 1 = at the bound.
* where the rest went, from the bench's own measurements: ``own CPU`` = the mode's step alone (one-rank
  group, no network) minus the compute mode of that launch; ``exposed`` = communication not hidden
  behind backward (gradientflow: measured; torch modes: step - compute); ``messages`` = collectives per
  step x the measured cost of one small collective (gradientflow modes; torch's bucket count is not
  reported by DDP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradientflow.bench.mode_names import canonical_matrix, canonical_name, canonical_summary
from gradientflow.bench.report_tables import step_table_row
from gradientflow.diagnostics.extras import can_plot

TARGET = 0.85
HEADLINE = "gf-topk-fp16"  # compression="topk-fp16": comm_dtype="fp16", density=0.1
BOUND_DEF = (
    "t_bound = max(compute: the model's step with no synchronisation, same launch; wire: wire bytes per step / the "
    "link's measured bulk throughput (one 32 MB fp32 allreduce, median of 5)); efficiency = t_bound / median step. "
    "own CPU = the mode alone on a one-rank group minus compute (marked p: without alone twins, gradientflow's "
    "own phases: score, select, pack, unpack, zero, check); exposed = communication not hidden behind backward; "
    "msgs = collectives per step x one small collective's measured cost (median of 30)."
)


def efficiency_rows(summary: dict[str, Any], link: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per timed mode of ``summary`` (not the θ sweep, not the alone twins): bound and efficiency."""
    summary = canonical_summary(summary)
    out = []
    chosen = {
        canonical_name(v["name"]): v["schedule"]
        for launch in summary.get("launches", [])
        for v in launch["variants"]
        if v.get("schedule")
    }
    for r in summary["rows"]:
        if not step_table_row(r) or r.get("status") != "ok" or r.get("median_s") is None:
            continue
        comp = r.get("ref_compute_s")
        wire = r.get("wire_bytes") or 0.0
        t_wire = wire / link["bulk_Bps"]
        bound = max(comp or 0.0, t_wire)
        rec: dict[str, Any] = {
            "mode": r["name"],
            "step_s": r["median_s"],
            "p10_s": r["p10_s"],
            "p90_s": r["p90_s"],
            "compute_s": comp,
            "wire_bytes": wire,
            "wire_s": t_wire,
            "bound_s": bound,
            "bound_by": "wire" if t_wire > (comp or 0.0) else "compute",
            "efficiency": bound / r["median_s"],
            "speedup": r.get("speedup"),
            "exposed_s": r.get("exposed_s"),
            "own_cpu_s": None,
            "collectives": r.get("collectives"),
            "messages_s": None,
            "schedule": chosen.get(r["name"]),  # schedule="auto": θ, scope and why
        }
        if r.get("alone_s") is not None and r.get("alone_ref_compute_s") is not None:
            rec["own_cpu_s"] = r["alone_s"] - r["alone_ref_compute_s"]
        elif r.get("own_cpu_s") is not None:  # no alone twin (--no-alone): gradientflow's phases, traced
            rec["own_cpu_s"], rec["own_cpu_source"] = r["own_cpu_s"], "phases"
        if rec["collectives"] is not None:
            rec["messages_s"] = rec["collectives"] * link["small_s"]
        out.append(rec)
    return out


def matrix(
    results: list[dict[str, Any]],
    *,
    command: str | None,
    started: str,
    finished: str,
    load: tuple[float, float] | None = None,
    cpus: int = 0,
) -> dict[str, Any]:
    """The matrix: per profile its link, its efficiency rows (or its error), the run's command and dates."""
    profiles = []
    for s in results:
        p: dict[str, Any] = {"profile": s["profile"], "error": s.get("error")}
        if not p["error"]:
            o = s["options"]
            p.update(
                network=s["network"],
                link=s["link"],
                workload=o["workload"],
                nproc=s["world_size"],
                batch_size=o["batch_size"],
                steps=o["steps"],
                rows=s["efficiency"],
                reference_warnings=s["reference_warnings"],
            )
        profiles.append(p)
    return {
        "command": command,
        "started": started,
        "finished": finished,
        "load": load,  # 1-minute load average at the start and the end of the run
        "cpus": cpus,
        "definition": BOUND_DEF,
        "target": TARGET,
        "profiles": profiles,
    }


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}"


def _ms1(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f}"


def _gbit(bps: float | None) -> str:
    return "—" if bps is None else f"{8 * bps / 1e9:.3f}"


def _own(r: dict[str, Any]) -> str:
    return _ms(r["own_cpu_s"]) + (" p" if r.get("own_cpu_source") == "phases" else "")


def markdown(m: dict[str, Any]) -> str:
    """The matrix table (efficiency and speedup per mode and profile), then one detail table per profile (modes by
    the recipe table's names, also those of an older ``matrix.json``)."""
    m = canonical_matrix(m)
    ok = [p for p in m["profiles"] if not p["error"]]
    modes = list(dict.fromkeys(r["mode"] for p in ok for r in p["rows"] if r["mode"] != "compute"))
    lines = [
        f"`{m['command']}`" if m["command"] else "",
        "",
        f"Run {m['started']} – {m['finished']}"
        + (
            f", load average {m['load'][0]:.1f} / {m['load'][1]:.1f} (start / end) on {m['cpus']} CPUs"
            if m.get("load")
            else ""
        )
        + ". Cells: efficiency = t_bound / step (speedup over one rank).",
        "",
        "| mode | " + " | ".join(p["profile"]["name"] for p in m["profiles"]) + " |",
        "|---|" + "---|" * len(m["profiles"]),
    ]
    for mode in modes:
        cells = []
        for p in m["profiles"]:
            r = next((r for r in p.get("rows", []) if r["mode"] == mode), None)
            if r is None:
                cells.append("failed" if p["error"] else "—")
                continue
            cell = f"{r['efficiency']:.2f}" + (f" ({r['speedup']:.2f}x)" if r.get("speedup") else "")
            cells.append(f"**{cell}**" if mode == HEADLINE else cell)
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| profile | network | model, ranks | bulk Gbit/s | bulk while computing Gbit/s "
        "| small collective ms | behind a bulk one ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in m["profiles"]:
        if p["error"]:
            lines.append(f"| {p['profile']['name']} | failed: {p['error'][:200]} | | | | | |")
            continue
        link = p["link"]
        lines.append(
            f"| {p['profile']['name']} | {p['network']} | {p['workload']} b{p['batch_size']}, {p['nproc']} "
            f"| {8 * link['bulk_Bps'] / 1e9:.3f} | {_gbit(link.get('busy_bulk_Bps'))} "
            f"| {1e3 * link['small_s']:.2f} | {_ms1(link.get('loaded_small_s'))} |"
        )
    for p in ok:
        lines += [
            "",
            f"**{p['profile']['name']}** ({p['network']}; {p['workload']}, {p['nproc']} ranks, medians of "
            f"{p['steps']} steps):",
            "",
            "| mode | step ms (p10–p90) | bound ms (by) | efficiency | speedup | own CPU ms | exposed ms "
            "| collectives x small = msgs ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in p["rows"]:
            msgs = "—" if r["messages_s"] is None else f"{r['collectives']:.0f} x = {_ms(r['messages_s'])}"
            speed = "—" if r.get("speedup") is None else f"{r['speedup']:.2f}"
            lines.append(
                f"| {r['mode']} | {_ms(r['step_s'])} ({_ms(r['p10_s'])}–{_ms(r['p90_s'])}) "
                f"| {_ms(r['bound_s'])} ({r['bound_by']}) | {r['efficiency']:.2f} | {speed} | {_own(r)} "
                f"| {_ms(r['exposed_s'])} | {msgs} |"
            )
        lines += [f"- {r['mode']}: {r['schedule']['reason']}" for r in p["rows"] if r.get("schedule")]
        lines += [f"- warning: {w}" for w in p["reference_warnings"]]
    lines += ["", f"- {m['definition']}"]
    return "\n".join(lines).strip() + "\n"


def plot(m: dict[str, Any], path: Path) -> bool:
    """Grouped bars: efficiency per mode, one group per profile, the target as a line; False (and a
    line saying so) without matplotlib."""
    if not can_plot():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = canonical_matrix(m)
    ok = [p for p in m["profiles"] if not p["error"]]
    modes = list(dict.fromkeys(r["mode"] for p in ok for r in p["rows"] if r["mode"] != "compute"))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(ok) + 2), 4.8))
    width = 0.8 / max(1, len(modes))
    cmap = plt.get_cmap("tab10")
    for j, mode in enumerate(modes):
        xs, ys = [], []
        for i, p in enumerate(ok):
            r = next((r for r in p["rows"] if r["mode"] == mode), None)
            if r is not None:
                xs.append(i + (j - (len(modes) - 1) / 2) * width)
                ys.append(r["efficiency"])
        ax.bar(xs, ys, width, label=mode, color=cmap(j % 10), edgecolor="black" if mode == HEADLINE else None)
    ax.axhline(m["target"], color="red", linestyle="--", linewidth=1, label=f"target {m['target']}")
    ax.set_xticks(range(len(ok)), [p["profile"]["name"] for p in ok])
    ax.set_ylabel("efficiency = t_bound / step")
    top = max([r["efficiency"] for p in ok for r in p["rows"]] + [1.0])
    ax.set_ylim(0, top + 0.1)  # above 1: the compute reference of that launch was slow (see its warnings)
    ax.set_title(f"efficiency per link profile ({m['started']})", fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
