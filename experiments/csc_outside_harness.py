"""CSC's step over compute as an outside harness sees it: glibc's default allocator, ``.grad = None``.

Issue 28, item 4.  Two ranks on 127.0.0.1 (Gloo, one torch thread each), ResNet-50 at batch 8 of
32x32 (``gradientflow.bench.models``), per step: ``zero_grad(set_to_none=True)``, forward, loss,
backward; nothing else.  No ``mallopt``, no ``MALLOC_*`` variable: what a user's script gets.

Modes, each in its own pair of processes (one model per process, as in a user's script), launched
in turn and repeated ``--repeats`` times (``compute, gf, gf@base, ddp, compute, gf, ...``), so slow
phases of a shared machine fall on every mode alike:

- ``compute``: the bare model, no synchronisation (each rank alone; both run at once, so the CPU is
  shared as in the other modes);
- ``gf``: ``gradientflow.DistributedDataParallel(model, compression="csc", warmup_steps=0)`` from
  this working tree (fp16 wire, density 0.1; no warm-up ramp, so every timed step is sparse);
- ``gf@base``: the same from ``--baseline`` (a commit, exported with ``git archive``), to compare
  a change with what it replaced in one launch;
- ``ddp``: torch DDP, for reference.

Per step (rank 0): wall time, the training thread's CPU time, minor page faults of the process
(``getrusage``).  Writes ``results.json`` and ``table.md`` (medians over steps, then over repeats).

    python experiments/csc_outside_harness.py --baseline 7ed3309 --out benchmarks/topk_fp16_outside_harness
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(mode: str, steps: int, warmup: int, out: str, device: str = "cpu") -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_* in the environment)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gradientflow.bench.models import build_model, synthetic_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    dev = torch.device(device)
    model = build_model("resnet50").to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if mode.startswith("gf"):
        import gradientflow as gf

        model = gf.DistributedDataParallel(model, compression="csc", warmup_steps=0)
    elif mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    x, y = (t.to(dev) for t in synthetic_batch("resnet50", 8, seed=rank))
    params = list(model.parameters())
    rows = []
    for step in range(warmup + steps):
        for p in params:
            p.grad = None
        ru0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        sync()  # a GPU step ends when its kernels have
        t1, c1, ru1 = time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_SELF)
        if step >= warmup:
            rows.append(
                {"wall_ms": 1e3 * (t1 - t0), "cpu_ms": 1e3 * (c1 - c0), "minflt": ru1.ru_minflt - ru0.ru_minflt}
            )
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _launch(
    mode: str, src: Path, steps: int, warmup: int, tmp: Path, timeout: float, device: str
) -> list[dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's defaults
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", PYTHONPATH=str(src))
    env.update(OMP_NUM_THREADS="1")
    out = tmp / f"{mode}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, __file__, "--worker", mode, "--steps", str(steps), "--warmup", str(warmup)]
    cmd += ["--device", device]
    procs = [subprocess.Popen([*cmd, "--result", str(out)], env={**env, "RANK": str(r)}) for r in range(2)]
    try:
        for p in procs:
            if p.wait(timeout=timeout) != 0:
                raise RuntimeError(f"{mode}: a rank exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return list(json.loads(out.read_text()))


def _median(rows: list[dict[str, float]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", help="a commit whose src/ runs as mode gf@base (omit: no gf@base)")
    ap.add_argument("--modes", nargs="+", default=["compute", "gf", "gf@base", "ddp"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/topk_fp16_outside_harness"))
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: both ranks on GPU 0, Gloo through the host")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.result, args.device)
        return
    modes = [m for m in args.modes if m != "gf@base" or args.baseline]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = tmp / "base"
        if args.baseline:
            base.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", args.baseline, "src"], check=True, capture_output=True
            )
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        srcs = {m: (base / "src" if m == "gf@base" else REPO / "src") for m in modes}
        started = datetime.now(timezone.utc)
        load = [os.getloadavg()[0]]
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            for m in modes:
                rows = _launch(m, srcs[m], args.steps, args.warmup, tmp, args.timeout, args.device)
                summary = {k: _median(rows, k) for k in ("wall_ms", "cpu_ms", "minflt")}
                runs[m].append({**summary, "load1": os.getloadavg()[0], "steps": rows})  # type: ignore[dict-item]
                print(f"repeat {rep} {m:8s} " + " ".join(f"{k} {v:.1f}" for k, v in summary.items()), flush=True)
        load.append(os.getloadavg()[0])
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {
        "started": started.isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "commit": head.stdout.strip(),
        "baseline": args.baseline,
        "device": args.device,
        "load1_start_end": load,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    comp = statistics.median(r["wall_ms"] for r in runs["compute"]) if "compute" in runs else None
    lines = [
        f"`{result['command']}` ({result['started']}, commit {result['commit']}, 1-min load average "
        f"{load[0]:.2f} -> {load[1]:.2f}); ResNet-50 batch 8 of 32x32, 2 ranks on loopback"
        + (", both on one GPU (Gloo through the host)" if args.device != "cpu" else "")
        + ", fwd+bwd with "
        "`.grad = None`, glibc default thresholds. Medians over steps, then over repeats (per repeat in brackets).",
        "",
        "| mode | step ms | over compute ms | thread CPU ms | minor faults / step |",
        "|---|---|---|---|---|",
    ]
    for m, rs in runs.items():
        wall = [r["wall_ms"] for r in rs]
        w = statistics.median(wall)
        over = f"{w - comp:+.1f}" if comp is not None and m != "compute" else ""
        per = ", ".join(f"{v:.0f}" for v in wall)
        cpu = statistics.median(r["cpu_ms"] for r in rs)
        flt = ", ".join(f"{r['minflt']:.0f}" for r in rs)
        lines.append(f"| {m} | {w:.1f} ({per}) | {over} | {cpu:.1f} | {flt} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
