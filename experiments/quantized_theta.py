"""θ for the quantised recipe: step time of the AdamW transformer on an emulated 1 Gbit/s link.

The quantised recipe sends 0.1 of the pool's bytes, so a pool that fits one 25 MB bucket (the bench's
3.2M transformer: 12.9 MB) goes out in one message after backward: nothing overlaps.  This times
torch DDP, the model without communication and ``compression="quantized"`` at several
``fusion_threshold_mb`` side by side, step by step interleaved in one launch (medians):

    python experiments/quantized_theta.py --theta 25 4 2 1 --steps 30 --out benchmarks/theta_3bit

``--compression quantized q2npw20`` times each named quantiser at each θ (``--warm 25``: medians after the
2-bit recipe's 20 steps at 3 bits).

Needs root (network namespaces, ``tc``); the namespaces (prefix ``gq``) are deleted on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def worker(
    rank: int,
    world: int,
    thetas: list[float],
    steps: int,
    batch: int,
    size: str,
    out: str,
    device: str,
    compressions: list[str],
    warm: int,
) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import gradientflow as gf
    from gradientflow.bench.models import build_model, synthetic_batch

    if device == "cpu":
        torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    d, layers = (int(v) for v in size.split("x"))
    models: dict[str, torch.nn.Module] = {}
    short = {"quantized": "q3"}
    recipes = {f"{short.get(c, c)} θ={t:g}": (c, t) for c in compressions for t in thetas}
    for name in ["compute", "ddp", *recipes]:
        torch.manual_seed(0)
        net = build_model("tiny_transformer", d_model=d, n_layers=layers).to(device)
        if name == "compute":
            models[name] = net
        elif name == "ddp":
            models[name] = torch.nn.parallel.DistributedDataParallel(net)
        else:
            compression, theta = recipes[name]
            models[name] = gf.DistributedDataParallel(net, compression=compression, fusion_threshold_mb=theta)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    exposed: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}  # the training thread's CPU time per step
    for step in range(steps):
        x, y = synthetic_batch("tiny_transformer", batch, 1000 * step + rank, device)
        for name, model in models.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            opts[name].zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opts[name].step()
            if device != "cpu":
                torch.cuda.synchronize()
            t = torch.tensor([time.perf_counter() - t0])
            cpu[name].append(time.thread_time() - c0)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step
            times[name].append(float(t))
            if hasattr(model, "comm_stats"):
                exposed[name].append(model.comm_stats().get("exposed_seconds", 0.0))
    if rank == 0:
        res = {
            k: {
                "step_ms": 1e3 * statistics.median(v[warm:]),
                "exposed_ms": 1e3 * statistics.median(exposed[k][warm:]) if exposed[k] else None,
                "thread_cpu_ms": 1e3 * statistics.median(cpu[k][warm:]),
            }
            for k, v in times.items()
        }
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.json").write_text(json.dumps(res, indent=1))
        ddp = res["ddp"]["step_ms"]
        lines = ["| mode | step ms | / ddp | exposed ms | training thread CPU ms |", "|---|---|---|---|---|"]
        for k, r in res.items():
            e = "—" if r["exposed_ms"] is None else f"{r['exposed_ms']:.1f}"
            lines.append(f"| {k} | {r['step_ms']:.1f} | {r['step_ms'] / ddp:.2f} | {e} | {r['thread_cpu_ms']:.1f} |")
        print("\n".join(lines))
        (Path(out) / "table.md").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--theta", type=float, nargs="+", default=[25.0, 4.0, 2.0, 1.0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", default="256x4")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: both ranks on one GPU over Gloo")
    ap.add_argument("--compression", nargs="+", default=["quantized"], help="compression= of each timed recipe")
    ap.add_argument("--warm", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--out", default="benchmarks/theta_3bit")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        worker(
            args.rank,
            2,
            args.theta,
            args.steps,
            args.batch,
            args.size,
            args.out,
            args.device,
            args.compression,
            args.warm,
        )
        return
    from gradientflow.bench.cluster import EmulatedCluster

    with EmulatedCluster(nodes=2, rate=args.rate, prefix="gq") as c:
        env = {"MASTER_ADDR": c.master_addr, "MASTER_PORT": "29655"}
        argv = [sys.executable, __file__, *sys.argv[1:]]
        procs = [c.popen(r, [*argv, "--rank", str(r)], env=env) for r in range(2)]
        rcs = [p.wait(timeout=1800) for p in procs]
    if any(rcs):
        raise SystemExit(f"ranks exited with {rcs}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
