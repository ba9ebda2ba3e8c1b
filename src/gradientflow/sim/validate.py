"""The cost model against ``gradientflow bench`` on this machine, mode by mode.

    python -m gradientflow.sim.validate --alpha-beta benchmarks/sim_validation/alpha_beta.json \\
        --bench benchmarks/sim_validation/bench_resnet50_1gbit/results.json --out benchmarks/sim_validation
    # nodes of several ranks: also the intra-node fit (measure --loopback)
    python -m gradientflow.sim.validate --bench B/results.json --loopback-fit L/alpha_beta.json --out OUT

1. α and B: measured by :mod:`gradientflow.sim.measure` on the same emulated cluster (Gloo's
   native allreduce, which the bench uses by default).
2. Compute: the model timed here with ``--profile``'s code (forward, backward with every
   gradient's ready time, update; one thread, the bench's batch and input), and the time of the
   engine's own local passes over the pool (the CPU work a GPU cost model would not have).  A second
   prediction scales those compute times to the bench's own 'compute' mode (same launch, two
   ranks sharing the cores; the passes slowed by the same factor), since a profile taken alone
   misses that contention.
3. Each bench mode as the model sees it, on the launch's layout (``results.json``'s ``nodes`` x
   ``nproc_per_node``; with nodes of several ranks the intra-node α and B measured on loopback,
   ``measure --loopback``): gf-none and ddp are fused fp32 exchanges overlapped with backward at the
   bench's θ; gf-fp16 is ``lazy``; ddp-fp16 the same with DDP's buckets; gf-topk-fp16 is ``csc`` at the
   bench's density and chunk size; gf-auto is "topk-3bit" with SGD and "3bit" with AdamW.  A
   gradientflow mode is two-level on nodes of several ranks (the engine's plan), ``@flat`` one
   exchange over every rank; torch DDP's modes are flat.
4. Write ``validation.json`` and ``validation.md``: measured median step vs predicted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
from pathlib import Path

from gradientflow.bench.mode_names import canonical_mode, canonical_summary
from gradientflow.bench.models import WORKLOADS, build_model
from gradientflow.bench.report import step_table_row
from gradientflow.bench.runner import CSC_DENSITY
from gradientflow.policy.auto_choice import SGD_RECIPE, recipe_options

from .config import SimConfig
from .model_profile import ModelProfile, measured_profile
from .planner import DDP, DDP_FP16
from .recipes import per_step_rows, recipe_technique
from .schedule import TECHNIQUES, THREE_BIT, TOPK_3BIT, Iteration, Technique, simulate

MODE_TECHNIQUE: dict[str, Technique] = {
    "compute": TECHNIQUES["lazy"],  # evaluated at 1 GPU: no communication
    "ddp": DDP,
    "ddp-fp16": DDP_FP16,
    # every recipe of the table as the bench's gf-<recipe> mode (bench.runner_spec.RECIPE_MODES): gf-none a fused
    # fp32 exchange as ddp's, gf-fp16 and gf-bf16 "lazy", gf-topk-fp16 "csc" at its density, gf-topk-3bit and the
    # quantised rows their codes; the slice scope hides most of top-k's score exchange under backward, the model
    # charges the global scope's (exposed after backward): conservative for it
    **{f"gf-{r.name}": recipe_technique(r) for r in per_step_rows() if r.mechanism != "auto"},
    "gf-topk-fp16:csc_scope=global": TECHNIQUES["csc"],
}
AUTO_TECHNIQUE: dict[str, Technique] = {"sgd": TOPK_3BIT, "adamw": THREE_BIT}
"""``gf-auto`` (``compression="auto"``): ``"topk-3bit"`` with SGD (at density 0.5 beyond a pair of ranks, as the engine:
:func:`mode_plan`), ``"3bit"`` with AdamW (the bench's --optimizer)."""

TORCH_MODES = ("ddp", "ddp-fp16", "ddp-powersgd")  # torch DDP: flat rings whatever the layout


def bench_layout(bench: dict) -> tuple[int, int]:
    """(nodes, ranks per node) of a bench's ``results.json``: its ``nodes`` and ``nproc_per_node`` (the
    emulated cluster's layout; a results.json from before they were recorded: one rank per node)."""
    n = int(bench["world_size"])
    per_node = int(bench.get("nproc_per_node") or 1)
    nodes = int(bench.get("nodes") or n // per_node)
    if per_node < 1 or nodes < 1 or nodes * per_node != n:
        raise ValueError(
            f"results.json: {nodes} nodes x {per_node} ranks per node is not its world size {n}; "
            "a bench run with --nproc-per-node K records nodes = NPROC / K"
        )
    return nodes, per_node


def mode_plan(mode: str, optimizer: str, layout: tuple[int, int]) -> tuple[Technique, bool] | None:
    """(technique, flat?) the model runs for a bench mode on nodes x ranks-per-node ``layout``; ``None``
    for a mode it does not model (PowerSGD).  A gradientflow mode ending in ``@flat`` is the engine's
    ``topology="flat"``; ``@auto``, ``@MxG`` matching the launch's layout, or no suffix: the layout
    torchrun gives (two-level with more than one node of more than one rank); torch DDP is flat."""
    base, _, topo = canonical_mode(mode).partition("@")
    tech = AUTO_TECHNIQUE.get(optimizer) if base == "gf-auto" else MODE_TECHNIQUE.get(base)
    if tech is None:
        return None
    nodes, per_node = layout
    if topo not in ("", "flat", "auto", f"{nodes}x{per_node}"):
        raise ValueError(f"mode {mode!r}: the model knows the launch's layout {nodes}x{per_node}, flat and auto")
    if (
        base == "gf-auto" and tech.density is not None
    ):  # "topk-3bit" as "auto" sets it on this many ranks (the engine's)
        density = recipe_options(SGD_RECIPE, nodes * per_node).get("density", tech.density)
        tech = dataclasses.replace(tech, density=density)
    return tech, topo == "flat" or base in TORCH_MODES


def _profile_job(job: tuple[str, int, int, int]) -> ModelProfile:
    workload, batch, steps, threads = job
    return measured_profile(
        workload, lambda: build_model(workload), WORKLOADS[workload].input_shape, batch, steps=steps, threads=threads
    )


def profile_like_the_bench(workload: str, batch: int, steps: int, threads: int, copies: int) -> ModelProfile:
    """``--profile``'s measurement, in ``copies`` processes at once as the bench's ranks run on this
    machine (they share its cores and memory bandwidth); the slowest copy's profile counts."""
    if copies <= 1:
        return _profile_job((workload, batch, steps, threads))
    with multiprocessing.get_context("spawn").Pool(copies) as pool:
        profs = pool.map(_profile_job, [(workload, batch, steps, threads)] * copies)
    return max(profs, key=lambda p: sum(p.times or ()))


def bench_config(bench: dict, fit: dict, intra_fit: dict | None, t1: float) -> SimConfig:
    """The cluster of a bench's ``results.json`` as the model sees it: α and B of its link (``fit``,
    measured by :mod:`.measure`), its layout (:func:`bench_layout`) and, with more than one rank per
    node, α and B inside a node (``intra_fit``: measured on loopback, ``measure --loopback``)."""
    opts = bench["options"]
    nodes, per_node = bench_layout(bench)
    two_level = nodes > 1 and per_node > 1
    if two_level and intra_fit is None:
        raise ValueError(
            f"the bench ran {nodes} nodes x {per_node} ranks: give the intra-node α and B "
            "(python -m gradientflow.sim.measure --loopback, then --loopback-fit FILE)"
        )
    return SimConfig(
        bandwidth=fit["bandwidth_Bps"],
        latency=fit["alpha_s"],
        batch=opts["batch_size"],
        gpu_images_per_s=opts["batch_size"] / t1,
        gpus_per_node=per_node if two_level else 1,
        intra_bandwidth=intra_fit["bandwidth_Bps"] if two_level and intra_fit else None,
        intra_latency=intra_fit["alpha_s"] if two_level and intra_fit else 0.0,
        theta_mb=opts["fusion_mb"],
        density=CSC_DENSITY,
        chunk_size=bench["chunk_size"],
    )


def predict(
    bench: dict, fit: dict, steps: int = 5, copies: int = 1, intra_fit: dict | None = None
) -> tuple[dict[str, tuple[Iteration, Iteration, Iteration]], dict]:
    """Steps 2-3: per bench mode, the prediction from the profile and from the bench's compute time."""
    opts = bench["options"]
    workload = opts["workload"]
    prof = profile_like_the_bench(workload, opts["batch_size"], steps, bench.get("threads_per_rank") or 1, copies)
    t1 = sum(prof.times or ())
    cfg = bench_config(bench, fit, intra_fit, t1)
    ref = next(r["median_s"] for r in bench["rows"] if r["mode"] == "compute")
    # The bench's ranks share this machine's cores and memory bandwidth, a lone profile does not:
    # the second prediction slows every local CPU cost (compute and passes) by the one factor the
    # bench itself measured, its compute mode over the profile (no communication in either).
    scaled = dataclasses.replace(
        prof,
        times=tuple(t * ref / t1 for t in prof.times or ()),
        local_s={k: v * ref / t1 for k, v in (prof.local_s or {}).items()},
    )
    out = predict_rows(bench, prof, scaled, cfg)
    ranks = bench["world_size"] * (bench.get("threads_per_rank") or 1)
    cpus = (bench.get("host") or {}).get("cpus") or os.cpu_count() or 1
    assumptions = {
        **cfg.as_dict(),
        "ranks_threads": ranks,
        "cpus": cpus,
        # the rule, fixed before any comparison: ranks outnumbering the cores leave Gloo's threads and
        # the kernel's network stack no core during backward, so the model's prediction is the third
        # (communication after backward); otherwise the second (overlapped, as the engine schedules it)
        "oversubscribed": ranks > cpus,
        "layout": "{}x{}".format(*bench_layout(bench)),
        "measured_forward_backward_update_s": list(prof.times or ()),
        "copies": copies,
        "loadavg_1min_at_profile": os.getloadavg()[0],
        "bench_compute_s": ref,
        "contention_factor": ref / t1,
        "local_passes_s": prof.local_s,
    }
    return out, assumptions


def predict_rows(
    bench: dict, prof: ModelProfile, scaled: ModelProfile, cfg: SimConfig
) -> dict[str, tuple[Iteration, Iteration, Iteration]]:
    """Every row of the bench the model knows: (from ``prof``, from ``scaled``, from ``scaled`` with
    no overlap) iterations.  The third serialises communication after backward: where the ranks
    outnumber the cores (4 single-threaded ranks on 2 here), backward leaves no core to Gloo's threads
    and the kernel's network stack, and the engine's own ``exposed_seconds`` shows how much of the
    link's work waited for backward's end (docs/cost-model.md)."""
    layout = bench_layout(bench)
    optimizer = bench["options"].get("optimizer") or "sgd"
    out = {}
    for row in bench["rows"]:
        planned = mode_plan(row["mode"], optimizer, layout)
        if planned is not None and step_table_row(row) and row["status"] == "ok":
            tech, flat = planned
            gpus = 1 if row["mode"] == "compute" else bench["world_size"]
            out[row["name"]] = (
                simulate(prof, cfg, gpus, row["mode"], tech, flat=flat),
                simulate(scaled, cfg, gpus, row["mode"], tech, flat=flat),
                simulate(scaled, cfg, gpus, row["mode"], dataclasses.replace(tech, overlap=False), flat=flat),
            )
    return out


def table(
    bench: dict, preds: dict[str, tuple[Iteration, Iteration, Iteration]], oversubscribed: bool = False
) -> tuple[str, list[dict]]:
    """Step 4's rows: measured vs predicted step time (both compute sources, and the bench's compute
    without overlap) and speedup, per mode."""
    rows = []
    lines = [
        "| mode | measured step ms (p10–p90) | predicted ms, profiled compute | difference | "
        "predicted ms, bench's compute | difference | the same, no overlap | difference | "
        "measured speedup | predicted speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bench["rows"]:
        if r["name"] not in preds:
            continue
        p, q, z = preds[r["name"]]
        dp, dq, dz = ((x.iteration_s - r["median_s"]) / r["median_s"] for x in (p, q, z))
        rows.append(
            {
                "mode": r["name"],
                "measured_s": r["median_s"],
                "predicted_s": p.iteration_s,
                "difference": dp,
                "predicted_bench_compute_s": q.iteration_s,
                "difference_bench_compute": dq,
                "predicted_no_overlap_s": z.iteration_s,
                "difference_no_overlap": dz,
                # the model's prediction for this machine: no overlap where ranks outnumber the cores
                "predicted_model_s": (z if oversubscribed else q).iteration_s,
                "difference_model": dz if oversubscribed else dq,
                "measured_exposed_s": r.get("exposed_s"),
                "predicted_exposed_s": q.exposed_s,
                "measured_speedup": r["speedup"],
                "predicted_speedup": q.speedup,
            }
        )
        lines.append(
            f"| {r['name']} | {r['median_s'] * 1e3:.0f} ({r['p10_s'] * 1e3:.0f}–{r['p90_s'] * 1e3:.0f}) | "
            f"{p.iteration_s * 1e3:.0f} | {dp:+.0%} | {q.iteration_s * 1e3:.0f} | {dq:+.0%} | "
            f"{z.iteration_s * 1e3:.0f} | {dz:+.0%} | {r['speedup']:.2f} | "
            f"{'—' if r['mode'] == 'compute' else f'{q.speedup:.2f}'} |"
        )
    return "\n".join(lines) + "\n", rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alpha-beta", default="benchmarks/sim_validation/alpha_beta.json")
    p.add_argument("--bench", default="benchmarks/sim_validation/bench_resnet50_1gbit/results.json")
    p.add_argument(
        "--loopback-fit",
        help="α and B inside a node (python -m gradientflow.sim.measure --loopback's alpha_beta.json); "
        "needed for a bench of nodes of several ranks",
    )
    p.add_argument("--algorithm", default="native", help="whose α/B fit to use (the bench's --algorithm)")
    p.add_argument("--steps", type=int, default=5, help="profiled local steps")
    p.add_argument(
        "--copies",
        type=int,
        default=1,
        help="profile in this many processes at once, as the bench's "
        "ranks share this machine (default 1: the model alone)",
    )
    p.add_argument("--out", default="benchmarks/sim_validation")
    args = p.parse_args(argv)
    bench = canonical_summary(
        json.loads(Path(args.bench).read_text())
    )  # an older bench's modes as the table names them
    fit = json.loads(Path(args.alpha_beta).read_text())["fits"][args.algorithm]
    intra = json.loads(Path(args.loopback_fit).read_text())["fits"][args.algorithm] if args.loopback_fit else None
    copies = args.copies
    try:
        preds, assumptions = predict(bench, fit, args.steps, copies, intra)
    except ValueError as exc:
        print(f"gradientflow.sim.validate: {exc}", file=sys.stderr)
        return 2
    md, rows = table(bench, preds, assumptions["oversubscribed"])
    a = assumptions
    head = (
        f"`python -m gradientflow.sim.validate {' '.join(argv)}`\n\n"
        f"Bench: `{bench.get('command') or '(not recorded)'}`. "
        f"Model inputs, all measured here: α = {a['latency'] * 1e6:.0f} µs, "
        f"B = {a['bandwidth'] * 8 / 1e9:.3f} Gbit/s ({args.alpha_beta}); layout {a['layout']} "
        + (
            f"(inside a node: α = {a['intra_latency'] * 1e6:.0f} µs, B = {a['intra_bandwidth'] * 8 / 1e9:.2f} Gbit/s, "
            f"{args.loopback_fit}); "
            if a["gpus_per_node"] > 1
            else "; "
        )
        + "forward/backward/update = "
        + "/".join(f"{t * 1e3:.0f}" for t in a["measured_forward_backward_update_s"])
        + f" ms (profiled, 1 thread, {a['copies']} copies at once, "
        f"load average {a['loadavg_1min_at_profile']:.1f}; "
        f"the bench's compute mode: {a['bench_compute_s'] * 1e3:.0f} ms); "
        "local passes (the engine's own calls, timed here): "
        + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in a["local_passes_s"].items())
        + f". {a['ranks_threads']} rank threads on {a['cpus']} cores: the model's prediction is "
        + ("'no overlap' (ranks outnumber the cores)" if a["oversubscribed"] else "the bench's compute column")
        + ".\n\n"
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "validation.md").write_text(head + md)
    (Path(args.out) / "validation.json").write_text(
        json.dumps(
            {
                "command": "python -m gradientflow.sim.validate " + " ".join(argv),
                "assumptions": assumptions,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(head + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
