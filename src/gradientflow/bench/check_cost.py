"""What the fault options cost per step: ``python -m gradientflow.bench.check_cost``.

Builds one wrapped model per variant on every rank (same seed, default options otherwise):
baseline (everything off), the baseline again (its difference to the first is the noise floor),
``check_consistency=True``, ``check_finite=True``, ``trace_path`` set
but outside ``trace_steps`` (tracing "off"), and tracing every timed step.  Then:

1. ``--warmup`` untimed steps of every variant (the pool re-layout of step 0 among them);
2. ``--steps`` rounds; each round times one step of every variant after a barrier, starting
   at a different variant each round, so noise and order effects on a shared machine hit all
   variants alike;
3. per step the slowest rank's time counts; the table gives the median, p10-p90, and the median
   of the per-round *paired* difference to the baseline (the robust figure on a noisy machine);
4. the step check of ``check_consistency`` timed alone, back to back.

Ranks are spawned here on one machine (Gloo over loopback, one torch thread each); every
collective and the whole run carry timeouts.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

VARIANTS: dict[str, dict[str, Any]] = {
    "baseline (all off)": {},
    "baseline again (noise control)": {},
    "check_consistency=True": {"check_consistency": True},
    "check_finite=True": {"check_finite": True},
    "trace_path set, step outside trace_steps": {"trace_steps": (10**9, 10**9 + 1)},
    "tracing every step": {"trace_steps": (0, 10**9)},
}


def _worker(rank: int, world: int, store_path: str, args: dict[str, Any], results: Any) -> None:
    from gradientflow import DistributedDataParallel
    from gradientflow.bench.models import build_model, synthetic_batch

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        x, y = synthetic_batch(args["workload"], args["batch_size"], seed=rank)
        models: dict[str, Any] = {}
        for name, opts in VARIANTS.items():
            if "trace_steps" in opts:
                opts = {**opts, "trace_path": os.path.join(args["tmp"], f"trace-{len(models)}-{{rank}}.json")}
            torch.manual_seed(0)
            model = DistributedDataParallel(build_model(args["workload"]), timeout=60, **opts)
            models[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
        names = list(models)

        def step(name: str) -> float:
            model, opt = models[name]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            return time.perf_counter() - t0

        for _ in range(args["warmup"]):
            for name in names:
                step(name)
        times: dict[str, Any] = {n: [] for n in names}  # and "_check_us", a float
        for r in range(args["steps"]):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]  # 2. rotate the order every round
                times[name].append(step(name))
        times["_check_us"] = _check_latency_us(models[names[0]][0])
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, times)
        results.put((rank, "ok", gathered))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 — reported by the parent
        results.put((rank, "error", traceback.format_exc()))


def _check_latency_us(model: Any, repeats: int = 5, n: int = 200) -> float:
    """4. The step check alone: µs per ``StepCheck.check`` back to back (median of ``repeats`` means).

    The step-time differences above drown in a shared machine's noise; this is the figure the
    check adds to a step at most (when ranks arrive together; skew it absorbs is waited for later anyway).
    """
    from gradientflow.diagnostics.watchdog import Watchdog
    from gradientflow.engine.consistency import StepCheck
    from gradientflow.engine.pool import plan_layout

    params = [p for p in model.parameters() if p.requires_grad]
    layout = plan_layout(
        [p.numel() for p in params],
        [(p.dtype, p.device) for p in params],
        list(reversed(range(len(params)))),
        25 * 2**20,
    )
    assert dist.group.WORLD is not None  # the caller initialised it
    check = StepCheck(Watchdog(dist.group.WORLD, timedelta(seconds=60)), torch.device("cpu"))
    means = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            check.check(layout)
        means.append(1e6 * (time.perf_counter() - t0) / n)
    return statistics.median(means)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def run(args: dict[str, Any]) -> dict[str, Any]:
    """Spawn the ranks, collect per-step times; return {variant: {median_ms, p10, p90, paired_pct}}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        args = {**args, "tmp": tmp}
        procs = [
            ctx.Process(target=_worker, args=(r, args["nproc"], os.path.join(tmp, "store"), args, results), daemon=True)
            for r in range(args["nproc"])
        ]
        for p in procs:
            p.start()
        try:
            rank, status, value = results.get(timeout=args["timeout"])
        except queue.Empty:
            raise TimeoutError(f"check_cost: no result within {args['timeout']} s") from None
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        if status != "ok":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
    names = list(VARIANTS)
    # 3. the slowest rank of each step counts
    per_step = {n: [max(r[n][i] for r in value) for i in range(len(value[0][n]))] for n in names}
    base = per_step[names[0]]
    table: dict[str, Any] = {"_check_us": max(r["_check_us"] for r in value)}
    for n in names:
        t = per_step[n]
        paired = [100 * (a - b) / b for a, b in zip(t, base)]
        table[n] = {
            "median_ms": 1e3 * statistics.median(t),
            "p10_ms": 1e3 * _pct(t, 0.1),
            "p90_ms": 1e3 * _pct(t, 0.9),
            "paired_median_pct": statistics.median(paired),
            "step_s": t,
        }
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradientflow.bench.check_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="resnet50", help="model of gradientflow.bench.models (default resnet50)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step (default 8)")
    p.add_argument("--steps", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before the run is abandoned (1200)")
    p.add_argument("--out", default=None, help="also write the per-step times as JSON here")
    a = p.parse_args(argv)
    table = run(
        {
            "workload": a.workload,
            "nproc": a.nproc,
            "batch_size": a.batch_size,
            "steps": a.steps,
            "warmup": a.warmup,
            "timeout": a.timeout,
        }
    )
    print(
        f"{a.workload}, {a.nproc} ranks (Gloo, loopback, 1 thread each), batch {a.batch_size}/rank, "
        f"{a.steps} rounds after {a.warmup} warm-up rounds; slowest rank per step\n"
    )
    print("| variant | step ms, median (p10–p90) | vs baseline, median of paired differences |")
    print("|---|---|---|")
    for name, row in table.items():
        if name.startswith("_"):
            continue
        print(
            f"| {name} | {row['median_ms']:.0f} ({row['p10_ms']:.0f}–{row['p90_ms']:.0f}) | "
            f"{row['paired_median_pct']:+.1f}% |"
        )
    base_ms = table["baseline (all off)"]["median_ms"]
    print(
        f"\ncheck_consistency's step check alone: {table['_check_us']:.0f} µs per step back to back "
        f"(slowest rank) = {100 * table['_check_us'] / 1e3 / base_ms:.2f}% of the baseline's median step"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
