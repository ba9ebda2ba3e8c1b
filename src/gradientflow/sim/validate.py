"""The cost model against ``gradientflow bench`` on this machine, mode by mode.

    python -m gradientflow.sim.validate --alpha-beta benchmarks/sim_validation/alpha_beta.json \\
        --bench benchmarks/sim_validation/bench_resnet50_1gbit/results.json --out benchmarks/sim_validation

1. α and B: measured by :mod:`gradientflow.sim.measure` on the same emulated cluster (Gloo's
   native allreduce, which the bench uses by default).
2. Compute: the model timed here with ``--profile``'s code (forward, backward with every
   gradient's ready time, update; one thread, the bench's batch and input), and the time of the
   engine's own local passes over the pool (the CPU work a GPU cost model would not have).  A second
   prediction scales those compute times to the bench's own 'compute' mode (same launch, two
   ranks sharing the cores; the passes slowed by the same factor), since a profile taken alone
   misses that contention.
3. Each bench mode as the model sees it: gf-fp32 and ddp are fused fp32 ring allreduce
   overlapped with backward at the bench's θ; gf-fp16 is ``lazy``; ddp-fp16 the same with DDP's
   buckets; gf-fp16-csc is ``csc`` at the bench's density and chunk size.
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

from gradientflow.bench.models import WORKLOADS, build_model
from gradientflow.bench.report import step_table_row
from gradientflow.bench.runner import CSC_DENSITY

from .config import SimConfig
from .model_profile import ModelProfile, measured_profile
from .planner import DDP, DDP_FP16
from .schedule import TECHNIQUES, Iteration, Technique, simulate

MODE_TECHNIQUE: dict[str, Technique] = {
    "compute": TECHNIQUES["lazy"],  # evaluated at 1 GPU: no communication
    "gf-fp32": DDP,
    "ddp": DDP,
    "gf-fp16": TECHNIQUES["lazy"],
    "ddp-fp16": DDP_FP16,
    "gf-fp16-csc": TECHNIQUES["csc"],
}


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


def predict(
    bench: dict, fit: dict, steps: int = 5, copies: int = 1
) -> tuple[dict[str, tuple[Iteration, Iteration]], dict]:
    """Steps 2-3: per bench mode, the prediction from the profile and from the bench's compute time."""
    opts = bench["options"]
    workload = opts["workload"]
    prof = profile_like_the_bench(workload, opts["batch_size"], steps, bench.get("threads_per_rank") or 1, copies)
    t1 = sum(prof.times or ())
    cfg = SimConfig(
        bandwidth=fit["bandwidth_Bps"],
        latency=fit["alpha_s"],
        batch=opts["batch_size"],
        gpu_images_per_s=opts["batch_size"] / t1,
        theta_mb=opts["fusion_mb"],
        density=CSC_DENSITY,
        chunk_size=bench["chunk_size"],
    )
    n = bench["world_size"]
    ref = next(r["median_s"] for r in bench["rows"] if r["mode"] == "compute")
    # The bench's ranks share this machine's cores and memory bandwidth, a lone profile does not:
    # the second prediction slows every local CPU cost (compute and passes) by the one factor the
    # bench itself measured, its compute mode over the profile (no communication in either).
    scaled = dataclasses.replace(
        prof,
        times=tuple(t * ref / t1 for t in prof.times or ()),
        local_s={k: v * ref / t1 for k, v in (prof.local_s or {}).items()},
    )
    out = {}
    for row in bench["rows"]:
        tech = MODE_TECHNIQUE.get(row["mode"])
        if tech is not None and step_table_row(row) and row["status"] == "ok":
            gpus = 1 if row["mode"] == "compute" else n
            out[row["name"]] = (
                simulate(prof, cfg, gpus, row["mode"], tech),
                simulate(scaled, cfg, gpus, row["mode"], tech),
            )
    assumptions = {
        **cfg.as_dict(),
        "measured_forward_backward_update_s": list(prof.times or ()),
        "copies": copies,
        "loadavg_1min_at_profile": os.getloadavg()[0],
        "bench_compute_s": ref,
        "contention_factor": ref / t1,
        "local_passes_s": prof.local_s,
    }
    return out, assumptions


def table(bench: dict, preds: dict[str, tuple[Iteration, Iteration]]) -> tuple[str, list[dict]]:
    """Step 4's rows: measured vs predicted step time (both compute sources) and speedup, per mode."""
    rows = []
    lines = [
        "| mode | measured step ms (p10–p90) | predicted ms, profiled compute | difference | "
        "predicted ms, bench's compute | difference | measured speedup | predicted speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in bench["rows"]:
        if r["name"] not in preds:
            continue
        p, q = preds[r["name"]]
        dp, dq = ((x.iteration_s - r["median_s"]) / r["median_s"] for x in (p, q))
        rows.append(
            {
                "mode": r["name"],
                "measured_s": r["median_s"],
                "predicted_s": p.iteration_s,
                "difference": dp,
                "predicted_bench_compute_s": q.iteration_s,
                "difference_bench_compute": dq,
                "measured_speedup": r["speedup"],
                "predicted_speedup": q.speedup,
            }
        )
        lines.append(
            f"| {r['name']} | {r['median_s'] * 1e3:.0f} ({r['p10_s'] * 1e3:.0f}–{r['p90_s'] * 1e3:.0f}) | "
            f"{p.iteration_s * 1e3:.0f} | {dp:+.0%} | {q.iteration_s * 1e3:.0f} | {dq:+.0%} | "
            f"{r['speedup']:.2f} | {'—' if r['mode'] == 'compute' else f'{q.speedup:.2f}'} |"
        )
    return "\n".join(lines) + "\n", rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alpha-beta", default="benchmarks/sim_validation/alpha_beta.json")
    p.add_argument("--bench", default="benchmarks/sim_validation/bench_resnet50_1gbit/results.json")
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
    bench = json.loads(Path(args.bench).read_text())
    fit = json.loads(Path(args.alpha_beta).read_text())["fits"][args.algorithm]
    copies = args.copies
    preds, assumptions = predict(bench, fit, args.steps, copies)
    md, rows = table(bench, preds)
    a = assumptions
    head = (
        f"`python -m gradientflow.sim.validate {' '.join(argv)}`\n\n"
        f"Bench: `{bench['command']}`. Model inputs, all measured here: α = {a['latency'] * 1e6:.0f} µs, "
        f"B = {a['bandwidth'] * 8 / 1e9:.3f} Gbit/s ({args.alpha_beta}); forward/backward/update = "
        + "/".join(f"{t * 1e3:.0f}" for t in a["measured_forward_backward_update_s"])
        + f" ms (profiled, 1 thread, {a['copies']} copies at once, "
        f"load average {a['loadavg_1min_at_profile']:.1f}; "
        f"the bench's compute mode: {a['bench_compute_s'] * 1e3:.0f} ms); "
        "local passes (the engine's own calls, timed here): "
        + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in a["local_passes_s"].items())
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
