"""Report of ``gradientflow bench --quality``: per recipe final quality, ratio to torch DDP, bytes sent
and share of sparse steps; time to accuracy; ``results.json``, ``table.md`` and PNG plots."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np

from gradientflow.bench.link_bytes import link_summary
from gradientflow.bench.quality_plot import plot
from gradientflow.bench.report_tables import link_table
from gradientflow.bench.sharded import FSDP_MODES, FSDP_PREFIX, OVERLAP

RECIPE_WHAT = {
    "ddp": "torch DDP, dense fp32 (the oracle)",
    "gf-recommended": "gradientflow fp16 + CSC density 0.1, library defaults otherwise, the user's optimizer",
    "gf-density-0.3": "gradientflow fp16 + CSC density 0.3 (3x the bytes of 0.1), the user's optimizer",
    "gf-paper": "gradientflow fp16 + CSC 0.1 + momentum correction 0.9, plain SGD, dense warm-up",
    "gf-fp16-dense": "gradientflow fp16 wire, dense, the user's optimizer",
    "ddp-sgd": "torch DDP, dense fp32, gf-paper's SGD with momentum 0.9 in the optimizer (gf-paper's oracle)",
    "gf-auto": 'gradientflow compression="auto" (AdamW: quantised ring + error feedback, 3 bits, or 2 where a '
    '2-rank link is slow; SGD: CSC 0.3 with 3-bit chunks, "cscq")',
    "ddp-fp16-hook": "torch DDP + fp16_compress_hook, the user's optimizer",
    "ddp-powersgd": "torch DDP + PowerSGD hook (rank 4, error feedback, 10 dense steps), the user's optimizer",
    "ddp-postlocal": "torch post-local SGD: PostLocalSGDOptimizer + PeriodicModelAverager (every 8 steps after 10)",
    "hsdp": "torch FSDP2's HSDP on the mesh (nodes, ranks per node), its shards all-reduced between nodes in fp32",
    "hsdp-bf16": "torch FSDP2's HSDP, MixedPrecisionPolicy(reduce_dtype=torch.bfloat16): bf16 between nodes",
    **{
        mode: f'gradientflow.fsdp.fully_shard, compression="{mode.removeprefix(FSDP_PREFIX).removesuffix(OVERLAP)}" '
        + ("between nodes, overlap=True" if mode.endswith(OVERLAP) else "between nodes")
        for mode in FSDP_MODES
    },
    "torchft-diloco": "torchft 0.2.0 DiLoCo: the user's optimizer inside, fp32 pseudo-gradients averaged every "
    "sync_every steps (default 100), outer SGD(0.7, Nesterov 0.9)",
    "torchft-diloco-quantized": "torchft 0.2.0 DiLoCo with should_quantize=True (fp8 rows + fp32 scales)",
}
DEFINITIONS = {
    "ratio": "final metric / the ddp recipe's final metric in the same run: validation loss for the transformer "
    "(above 1 = worse), validation accuracy for digits (below 1 = worse)",
    "half": "the ratio to ddp at the validation nearest half the steps → the worst ratio at any later validation; "
    "'grows': worse than at ½ by more than 0.005 (the gap to ddp grows over the second half)",
    "sent": "bytes one rank hands to allreduce per step, mean over all steps (gradientflow: measured, "
    "comm_stats()['payload_bytes'], CSC scores included; torch DDP: computed, 4 bytes per gradient, c; FSDP2 / "
    "HSDP rows: the rank's shard between nodes, torch's computed from its reduce dtype)",
    "sparse": "share of steps on which CSC sent fewer than all chunks (dense warm-up steps and dense recipes: 0)",
    "tta": "time to X s: training wall clock until the validation loss first reaches X (linear between "
    "validation points); X = ddp's final validation loss, then the worst final loss of the recipes (a loss "
    "every recipe reached); ddp / this = how many times faster than ddp",
    "exposed": "exposed comm ms: gradientflow's comm_stats()['exposed_seconds'], the time the end of backward "
    "waited on communication, median over steps (— for torch DDP, which does not report it)",
    "time": "training wall clock: the sum of every step's time (forward, backward with its communication, "
    "optimizer), slowest rank per step; validation is outside the clock. The recipes run step by step in turn, so "
    "an exchange a recipe leaves in flight across its steps (sync_delay > 0) crosses the link during the other "
    "recipes' steps: its wire time and link bytes land partly on theirs (time it beside ddp alone)",
}


def time_to_target(times: list[float], losses: list[float], target: float) -> float | None:
    """First time the piecewise-linear curve through ``(times[i], losses[i])`` reaches ``losses <= target``.

    None when no point reaches it.  A first point already at or below the target gives ``times[0]``.
    """
    if len(times) != len(losses):
        raise ValueError(f"times and losses differ in length: {len(times)} vs {len(losses)}")
    for i, (t, loss) in enumerate(zip(times, losses)):
        if not loss <= target:  # also skips NaN
            continue
        if i == 0 or not np.isfinite(losses[i - 1]):
            return float(t)
        t0, l0 = times[i - 1], losses[i - 1]
        return float(t0 + (l0 - target) / (l0 - loss) * (t - t0))
    return None


def is_sparse_step(stats: dict[str, float]) -> bool:
    """Whether a step's ``comm_stats()`` shows a sparse CSC step: not a dense warm-up step, and (where the
    library says how many chunks it selected) fewer than all chunks selected."""
    if stats.get("warmup", 0) or "warmup" not in stats and "selected_chunks" not in stats:
        return False
    if "selected_chunks" in stats and "n_chunks" in stats:
        return stats["selected_chunks"] < stats["n_chunks"]
    return True


def _library_defaults() -> dict[str, Any]:
    """The defaults a recipe that does not name an option runs with, as of this run: the per-step ones of
    ``GradientFlowConfig`` and the outer loop's (``sync_every > 1``), which have changed before (2026-12-02: from
    DiLoCo's fp32 Nesterov step to averaging through 3 bits), so that a record says which ones its rows used."""
    from gradientflow import GradientFlowConfig
    from gradientflow.outer_options import OUTER_DEFAULTS

    outer = {k: OUTER_DEFAULTS[k] for k in ("outer_lr", "outer_momentum", "outer_compression")}
    return outer | {
        f.name: f.default
        for f in fields(GradientFlowConfig)
        if f.name
        in (
            "fusion_threshold_mb",
            "comm_dtype",
            "algorithm",
            "chunk_size",
            "warmup_steps",
            "momentum",
            "dense_1d",
            "csc_scope",
        )
        or f.name.startswith(("density", "ramp", "warmup"))
    }


GAP_SLACK = 0.005
"""How far the ratio to DDP may move the wrong way after the run's midpoint before the gap counts as growing."""


def second_half(curve: dict[str, list[float]], ddp: dict[str, list[float]] | None, metric: str) -> dict[str, Any]:
    """Whether a recipe's gap to DDP grows over the second half of the run: the ratio to DDP's metric at each
    validation from the midpoint on, against the ratio at the midpoint (the validation nearest half the
    steps).  ``gap_grows``: some later ratio is worse than the midpoint's by more than :data:`GAP_SLACK`
    (loss: higher; accuracy: lower).  Empty without a DDP curve on the same steps."""
    if not ddp or ddp["step"] != curve["step"] or len(curve["step"]) < 3:
        return {}
    ratios = [a / b if b else float("nan") for a, b in zip(curve[metric], ddp[metric])]
    half = curve["step"][-1] / 2
    mid = min(range(len(ratios)), key=lambda i: abs(curve["step"][i] - half))
    later = ratios[mid:]
    worse = max if metric == "val_loss" else min
    worst = worse(later)
    grows = worst > ratios[mid] + GAP_SLACK if metric == "val_loss" else worst < ratios[mid] - GAP_SLACK
    return {"ratio_curve": ratios, "ratio_mid": ratios[mid], "ratio_worst_second_half": worst, "gap_grows": grows}


def _summarize_job(raw: dict[str, Any]) -> dict[str, Any]:
    job, n = raw["job"], raw["n_params"]
    metric = "val_acc" if job["workload"] == "digits" else "val_loss"
    rows = []
    for run in raw["runs"]:
        wall = np.concatenate([[0.0], np.cumsum(run["step_s"])]) if run["step_s"] else np.zeros(1)
        evals = run["evals"]
        curve = {
            "step": [e["step"] for e in evals],
            "val_loss": [e["val_loss"] for e in evals],
            "val_acc": [e["val_acc"] for e in evals],
            "train_loss": [e["train_loss"] for e in evals],
            "wall_s": [float(wall[min(e["step"], len(wall) - 1)]) for e in evals],
        }
        payload = [s["payload_bytes"] for s in run["stats"] if "payload_bytes" in s]
        exposed = [s["exposed_seconds"] for s in run["stats"] if "exposed_seconds" in s]
        chunks = [s["n_chunks"] for s in run["stats"] if "n_chunks" in s]
        rows.append(
            {
                "recipe": run["recipe"],
                "what": _what(run["recipe"]),
                "options": run["options"],
                "status": run["status"],
                "error": run["error"],
                "steps": len(run["step_s"]),
                "final_val_loss": evals[-1]["val_loss"] if evals else None,
                "final_val_acc": evals[-1]["val_acc"] if evals else None,
                "bytes_per_step": float(np.mean(payload)) if payload else 4.0 * n,
                "bytes_source": "measured" if payload and run["recipe"].startswith(("gf-", "fsdp-")) else "computed",
                "sparse_share": float(np.mean([is_sparse_step(s) for s in run["stats"]])) if run["stats"] else 0.0,
                "n_chunks": int(max(chunks)) if chunks else None,
                "median_step_s": float(np.median(run["step_s"])) if run["step_s"] else None,
                "median_exposed_s": float(np.median(exposed)) if exposed else None,
                "train_s": float(wall[-1]),
                "picked": run.get("picked"),  # compression="auto": what it picked and why
                "curve": curve,
                **link_summary(run.get("nodes")),  # the kernel's bytes on each node's link (emulated cluster)
            }
        )
    by = {r["recipe"]: r for r in rows}
    for r in rows:
        for ref, key in (("ddp", "ratio_to_ddp"), ("ddp-sgd", "ratio_to_ddp_sgd")):
            base = by.get(ref, {}).get(f"final_{metric}")
            mine = r[f"final_{metric}"]
            r[key] = mine / base if base and mine is not None else None
        r.update(second_half(r["curve"], by.get("ddp", {}).get("curve"), metric))
    return {
        "name": raw["job"]["name"],
        "job": job,
        "n_params": n,
        "metric": metric,
        "probe_s": raw["probe_s"],
        "compute_step_s": float(np.median(raw["probe_s"])) if raw["probe_s"] else None,
        "rows": rows,
    }


def _summarize_tta(job: dict[str, Any], bandwidth: str) -> dict[str, Any]:
    by = {r["recipe"]: r for r in job["rows"]}
    target = by["ddp"]["final_val_loss"]
    # should a recipe end above ddp's final loss: the loss every recipe reached still gives a speed ratio
    common = max(r["final_val_loss"] for r in job["rows"])
    for r in job["rows"]:
        c = r["curve"]
        r["time_to_target_s"] = time_to_target(c["wall_s"], c["val_loss"], target)
        r["time_to_common_s"] = time_to_target(c["wall_s"], c["val_loss"], common)
    ddp_t = by["ddp"]["time_to_target_s"]
    gf_t = by.get("gf-recommended", {}).get("time_to_target_s")
    comp, ddp_step = job["compute_step_s"], by["ddp"]["median_step_s"]
    ddp_c, gf_c = by["ddp"]["time_to_common_s"], by.get("gf-recommended", {}).get("time_to_common_s")
    return {
        **job,
        "bandwidth": bandwidth,
        "target_val_loss": target,
        "common_val_loss": common,
        "speedup": ddp_t / gf_t if ddp_t and gf_t else None,
        "speedup_common": ddp_c / gf_c if ddp_c and gf_c else None,
        "ddp_comm_share": 1 - comp / ddp_step if comp and ddp_step else None,
    }


def summarize(launches: dict[str, Any], opts: Any, seconds: float, tta_skipped: str | None) -> dict[str, Any]:
    """Everything ``results.json`` holds (see :data:`DEFINITIONS`)."""
    quality = launches.get("quality", {})
    workloads = {j["job"]["name"]: _summarize_job(j) for j in quality.get("jobs", [])}
    tta = [_summarize_tta(_summarize_job(j), opts.bandwidth) for j in launches.get("tta", {}).get("jobs", [])]
    argv = sys.argv[1:] if sys.argv[0].endswith(("gradientflow", "cli.py")) else None
    return {
        "command": " ".join(["gradientflow", *argv]) if argv is not None else None,
        "date": datetime.date.today().isoformat(),
        "options": asdict(opts),
        "world_size": quality.get("world_size") or (launches.get("tta") or {}).get("world_size"),
        "threads_per_rank": opts.threads,
        "library_defaults": _library_defaults(),
        "host": {"machine": platform.machine(), "python": platform.python_version(), "torch": _torch_version()},
        "definitions": DEFINITIONS,
        "seconds": seconds,
        "launch_seconds": {k: v["seconds"] for k, v in launches.items()},
        "workloads": workloads,
        "tta": tta,
        "tta_skipped": tta_skipped,
    }


def _torch_version() -> str:
    import torch

    return torch.__version__


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _times(x: float | None, k: float) -> float | None:
    return None if x is None else x * k


def _optimizer(w: dict[str, Any]) -> str:
    """The oracle's optimizer as the worker built it (``SGD(lr=0.05, momentum=0.9)``), from its run record."""
    ddp = next((r for r in w["rows"] if r["recipe"] == "ddp"), None)
    return ddp["options"].get("optimizer", "the job's optimizer") if ddp else "the job's optimizer"


_CORPUS_WORDS = {
    "help-topics": "characters of pydoc_data.topics",
    "stdlib": "bytes of the standard library's sources (every 20th file held out)",
}


def _describe(w: dict[str, Any], world: int, head: str | None = None, layout: str = "") -> str:
    """One line on what was trained, led by ``head`` (default: the job's name in bold)."""
    j = w["job"]
    if j["workload"] == "transformer":
        what = (
            f"TinyTransformer d_model {j['d_model']} x {j['n_layers']} layers ({w['n_params']:,} parameters), "
            f"{_CORPUS_WORDS[j.get('corpus', 'help-topics')]}, batch {j['batch_size']} x {j['seq_len']} tokens/rank"
        )
    else:
        what = (
            f"{j.get('model', 'small_cnn')} ({w['n_params']:,} parameters) on scikit-learn digits, "
            f"batch {j['batch_size']}/rank, {_optimizer(w)}"
        )
    head = head or f"**{w['name']}**"
    return (
        f"{head}: {what}, {world} ranks{layout}, {j['steps']} steps, LR warm-up {j['lr_warmup_frac']:.0%} "
        f"then cosine to 10%, validated every {j['eval_every']} steps"
    )


def markdown(summary: dict[str, Any]) -> str:
    """The tables, ready to paste into the README, with what each column means."""
    world = summary["world_size"]
    k = summary["options"].get("nproc_per_node", 1)
    layout = f" as {world // k} nodes x {k}" if k > 1 and world else ""  # one torchrun per node (c10d)
    lines = [
        f"`{summary['command']}` ({summary['date']}, {summary['seconds']:.0f} s)"
        if summary["command"]
        else f"({summary['date']}, {summary['seconds']:.0f} s)",
        "",
    ]
    for w in summary["workloads"].values():
        digits = w["metric"] == "val_acc"
        lines += [
            _describe(w, world, layout=layout),
            "",
            "| recipe | optimizer | "
            + ("final val accuracy | ratio to ddp | final val loss" if digits else "final val loss | ratio to ddp")
            + " | 2nd half: ratio at ½ → worst | MB sent/step | sparse steps |",
            "|---|---|---|---|---|---|---|" + ("---|" if digits else ""),
        ]
        for r in w["rows"]:
            mb = _f(r["bytes_per_step"] / 1e6, ".3f") + (" c" if r["bytes_source"] == "computed" else "")
            if r["status"] != "ok":
                mb += f" ({r['status']}: {(r['error'] or '')[:120]})"
            ratio = _f(r["ratio_to_ddp"], ".3f")
            if r.get("ratio_to_ddp_sgd") is not None and r["recipe"] == "gf-paper":
                ratio += f" ({r['ratio_to_ddp_sgd']:.3f} to ddp-sgd)"
            q = (
                f"{_f(_times(r['final_val_acc'], 100), '.1f')}% | {ratio} | {_f(r['final_val_loss'], '.3f')}"
                if digits
                else f"{_f(r['final_val_loss'], '.3f')} | {ratio}"
            )
            half = (
                f"{r['ratio_mid']:.3f} → {r['ratio_worst_second_half']:.3f}" + (" grows" if r["gap_grows"] else "")
                if "ratio_mid" in r
                else "—"
            )
            lines.append(
                f"| {r['recipe']} | {r['options']['optimizer']} | {q} | {half} | {mb} | {r['sparse_share']:.0%} |"
            )
        lines += ["", *_picks(w["rows"])]
    for t in summary["tta"]:
        head = f"**time to accuracy ({t['name']})**, emulated {t['bandwidth']} per node"
        lines += [
            _describe(t, world, head, layout)
            + f"; target = ddp's final validation loss {t['target_val_loss']:.3f}. Compute alone (ddp's step "
            f"without communication, median of {len(t['probe_s'])} spread over the run): "
            f"{_f(_times(t['compute_step_s'], 1e3), '.0f')} ms, so communication and its overheads are "
            f"{_f(_times(t['ddp_comm_share'], 100), '.0f')}% of a dense DDP step.",
            "",
            f"| recipe | final val loss | time to {t['target_val_loss']:.3f} s | ddp / this "
            f"| time to {t['common_val_loss']:.3f} s | ddp / this | median step ms | exposed comm ms "
            "| training s | MB sent/step | sparse steps |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        ddp_row = next(r for r in t["rows"] if r["recipe"] == "ddp")
        for r in t["rows"]:
            cells = []
            for key in ("time_to_target_s", "time_to_common_s"):
                tt, base = r[key], ddp_row[key]
                cells.append(
                    f"{_f(tt, '.1f') if tt is not None else 'not reached'} | "
                    f"{_f(base / tt if base and tt else None, '.2f')}"
                )
            lines.append(
                f"| {r['recipe']} | {_f(r['final_val_loss'], '.3f')} | {' | '.join(cells)} | "
                f"{_f(_times(r['median_step_s'], 1e3), '.0f')} | "
                f"{_f(_times(r['median_exposed_s'], 1e3), '.0f')} | {r['train_s']:.1f} | "
                f"{r['bytes_per_step'] / 1e6:.3f}{' c' if r['bytes_source'] == 'computed' else ''} | "
                f"{r['sparse_share']:.0%} |"
            )
        lines += [*link_table({"rows": [{**r, "name": r["recipe"]} for r in t["rows"]]}), "", *_picks(t["rows"])]
    if not summary["tta"] and summary.get("tta_skipped"):
        lines += [f"Time to accuracy not run: {summary['tta_skipped']}.", ""]
    d = summary["definitions"]
    lines += [f"- ratio: {d['ratio']}", f"- 2nd half: {d['half']}", f"- MB sent/step: {d['sent']}"]
    lines += [f"- sparse steps: {d['sparse']}"]
    if summary["tta"]:
        lines += [f"- {d['tta']}", f"- time: {d['time']}", f"- {d['exposed']}"]
    defaults = ", ".join(f"{k}={v!r}" for k, v in summary["library_defaults"].items())
    lines.append(f"- library defaults at run time: {defaults}")
    return "\n".join(lines).strip() + "\n"


def _picks(rows: list[dict[str, Any]]) -> list[str]:
    """One line per ``compression="auto"`` run: what it picked and why (a table's note)."""
    picks = [f'- {r["recipe"]}: `"auto"` picked {r["picked"]}' for r in rows if r.get("picked")]
    return [*picks, ""] if picks else []


def _what(recipe: str) -> str:
    base, _, changed = recipe.partition(":")
    return RECIPE_WHAT.get(base, "") + (f"; variant with {changed}" if changed else "")


def write_all(summary: dict[str, Any], out: Path) -> None:
    """``results.json``, ``table.md`` and the plots in ``out``; the table is also printed."""
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    table = markdown(summary)
    (out / "table.md").write_text(table)
    plot(summary, out)
    print(table)
