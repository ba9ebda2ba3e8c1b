"""The fixed per-step cost on small models: gradientflow's defaults beside torch DDP, on loopback.

    python experiments/step_overhead.py --out benchmarks/step_overhead

1. Two Gloo ranks on 127.0.0.1 (spawned here, one thread each), per model: a torch DDP and a
   gradientflow (defaults) wrapper of two copies of the same MLP, SGD momentum, batch 32.
2. After ``--warmup`` untimed steps each, the wrappers take ``--rounds`` x ``--steps`` timed steps
   (zero_grad, forward, cross-entropy, backward, step) in turn, one step each, first one then the
   other, so that a busy machine (other jobs, frequency changes) hits both alike.  A step's time
   is rank 0's wall time (the allreduce waits for rank 1, so it includes the slower rank).
3. The figure per model is the median step time of each wrapper and their ratio; rank 0 writes
   ``results.json`` and ``table.md`` to ``--out``.  ``--profile`` adds a cProfile of
   gradientflow's steps (rank 0) to the output, the measurement behind the fixes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# name -> layer widths; parameter counts in the table are computed, not assumed
MODELS = {"mlp-6.5K": [64, 64, 32, 10], "mlp-1M": [512, 1024, 512, 10]}
BATCH = 32


def mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def _worker(rank: int, world: int, store_path: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from gradientflow import DistributedDataParallel as GF

    try:
        results = {}
        profile_text = {}
        for name, widths in [(k, v) for k, v in MODELS.items() if k in args.models]:
            torch.manual_seed(0)
            base = mlp(widths)
            wrapped: dict[str, torch.nn.Module] = {
                "torch-ddp": torch.nn.parallel.DistributedDataParallel(mlp(widths)),
                "gradientflow": GF(mlp(widths)),
            }
            for w in wrapped.values():
                inner = w.module
                assert isinstance(inner, torch.nn.Module)
                inner.load_state_dict(base.state_dict())
            opts = {k: torch.optim.SGD(w.parameters(), lr=0.01, momentum=0.9) for k, w in wrapped.items()}
            g = torch.Generator().manual_seed(rank)
            x, y = torch.randn(BATCH, widths[0], generator=g), torch.randint(0, widths[-1], (BATCH,), generator=g)
            times: dict[str, list[float]] = {k: [] for k in wrapped}
            order = list(wrapped)
            for k in order:
                _steps(wrapped[k], opts[k], x, y, args.warmup)
            for r in range(args.rounds * args.steps):  # step by step, alternately: a busy machine hits both alike
                for k in order if r % 2 == 0 else reversed(order):
                    times[k] += _steps(wrapped[k], opts[k], x, y, 1)
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                _steps(wrapped["gradientflow"], opts["gradientflow"], x, y, args.steps)
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
                profile_text[name] = s.getvalue()
            med = {k: statistics.median(v) for k, v in times.items()}
            p10 = {k: statistics.quantiles(v, n=10)[0] for k, v in times.items()}
            results[name] = {
                "params": sum(p.numel() for p in base.parameters()),
                "median_step_ms": {k: 1e3 * v for k, v in med.items()},
                "ratio": med["gradientflow"] / med["torch-ddp"],
                # the fastest tenth: less of the other jobs' noise on a shared machine
                "p10_step_ms": {k: 1e3 * v for k, v in p10.items()},
                "p10_ratio": p10["gradientflow"] / p10["torch-ddp"],
                "steps_timed": len(times["torch-ddp"]),
            }
        queue.put((rank, results, profile_text))
    finally:
        dist.destroy_process_group()


def combine(launches: list[dict]) -> dict:
    """Per model, the median over launches (fresh process pairs) of each figure, and every launch's ratio:
    on a shared 2-core machine one launch's ratio moves by a few percent from the next."""
    out = {}
    for name in launches[0]:
        runs = [launch[name] for launch in launches]
        out[name] = {
            "params": runs[0]["params"],
            "median_step_ms": {
                k: statistics.median(r["median_step_ms"][k] for r in runs) for k in runs[0]["median_step_ms"]
            },
            "ratio": statistics.median(r["ratio"] for r in runs),
            "p10_ratio": statistics.median(r["p10_ratio"] for r in runs),
            "launch_ratios": [r["ratio"] for r in runs],
            "launches": runs,
        }
    return out


def table(results: dict) -> str:
    lines = [
        "| model | parameters | torch DDP step (ms, median) | gradientflow defaults (ms, median) | ratio "
        "| ratio of the 10th percentiles | ratio per launch |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        ms = r["median_step_ms"]
        per = ", ".join(f"{x:.3f}" for x in r.get("launch_ratios", [r["ratio"]]))
        lines.append(
            f"| {name} | {r['params']:,} | {ms['torch-ddp']:.3f} | {ms['gradientflow']:.3f} | {r['ratio']:.3f}x "
            f"| {r['p10_ratio']:.3f}x | {per} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=50, help="timed steps per wrapper per round")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps of each wrapper first")
    p.add_argument("--profile", action="store_true", help="also cProfile gradientflow's steps on rank 0")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument(
        "--launches", type=int, default=1, help="fresh pairs of ranks, one after another; the table gives medians"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    launches, profiles = [], {}
    for _ in range(args.launches):
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            procs = [ctx.Process(target=_worker, args=(r, 2, store, args, queue), daemon=True) for r in range(2)]
            for proc in procs:
                proc.start()
            got = dict((rank, (res, prof)) for rank, res, prof in (queue.get(timeout=900) for _ in procs))
            for proc in procs:
                proc.join(timeout=30)
        launches.append(got[0][0])
        profiles = got[0][1]
    results = combine(launches)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_after": os.getloadavg(),
        "command": "python experiments/step_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "launches": args.launches,
    }
    text = table(results)
    print(text)
    for name, prof in profiles.items():
        print(f"--- cProfile, gradientflow, {name} ---\n{prof}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        (args.out / "table.md").write_text(f"{text}\n\n{json.dumps(meta)}\n")


if __name__ == "__main__":
    main()
