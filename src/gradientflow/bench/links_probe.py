"""Measure a link before benchmarking on it: bulk throughput and the cost of one small collective.

Worker (``python -m gradientflow.bench.links_probe SPEC.json`` under torchrun, one rank per node):
after two warm-up rounds, ``repeats`` rounds of one ``bulk_mb`` MB fp32 allreduce and ``small_repeats``
one-element allreduces, each after a barrier; the slowest rank's time counts (a collective is done
when every rank is).  Rank 0 writes the medians and every sample to ``out_path``.

* ``bulk_Bps`` = bulk bytes / median bulk time: bytes *handed to allreduce* per second, the unit the
  bench's wire column is in, so wire bytes / ``bulk_Bps`` is how long a step's traffic takes on this
  link (a ring puts 2(N-1)/N of it on each rank's port; that factor is inside the measurement).
* ``small_s`` = median time of a one-element allreduce: the per-message cost (latency, Gloo's
  rendezvous, the scheduler), paid once per collective whatever its size.
* ``loaded_small_s`` = the same one-element allreduce on a second group while a ``bulk_mb / 4`` MB
  allreduce is in flight: the per-message cost behind the shaper's queue (CSC's score exchanges
  run on a group of their own while chunks are on the wire).
* ``busy_bulk_Bps`` = the bulk allreduce again while a thread in every rank keeps one core busy with
  matrix products (as a training step does): an emulated network runs on the CPUs the ranks train
  on, so where its per-frame work is large (a small tbf bucket segments every GSO packet) the link
  is slower while the model computes than idle.  Reported beside ``bulk_Bps``; the bound keeps
  ``bulk_Bps``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

BULK_MB = 32.0  # 32 MB: the probe; at 1 Gbit/s ~0.27 s, long against one token bucket (<= 1.25 MB)


def _timed(fn: Any, dist: Any) -> float:
    """Seconds of ``fn()`` on the slowest rank, started together after a barrier."""
    import torch

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed_on(fn: Any, dist: Any, group: Any) -> float:
    """Seconds of ``fn()`` on the slowest rank (no barrier: the caller has started a collective)."""
    import torch

    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _while_busy(measure: Any, repeats: int) -> list[float]:
    """``repeats`` samples of ``measure()`` while a thread keeps this rank's core busy with matmuls."""
    import torch

    stop = threading.Event()

    def burn() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():  # ~1 ms a product, outside the GIL: the probe's own thread still runs
            torch.mm(a, a)

    worker = threading.Thread(target=burn, name="busy-core", daemon=True)
    worker.start()
    try:
        time.sleep(0.2)
        return [measure() for _ in range(repeats)]
    finally:
        stop.set()
        worker.join()


def probe_main(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    from gradientflow.comm.collectives import as_member

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(spec.get("pg_timeout_s", 60))))
    n = int(spec["bulk_mb"] * 2**20 // 4)
    bulk, small = torch.ones(n), torch.ones(1)
    for _ in range(2):  # connections, buffers, the bucket's first fill
        dist.all_reduce(bulk)
        dist.all_reduce(small)
    bulk_s = [_timed(lambda: dist.all_reduce(bulk), dist) for _ in range(int(spec["repeats"]))]
    small_s = [_timed(lambda: dist.all_reduce(small), dist) for _ in range(int(spec["small_repeats"]))]
    # the same small collective on a second group while a bulk one is in flight: what CSC's score
    # exchange (its control group) pays when it queues behind chunks in the shaper's FIFO
    everyone = list(range(dist.get_world_size()))
    control = as_member(dist.new_group(everyone), everyone)
    loaded = bulk[: n // 4]
    loaded_s = []
    for _ in range(int(spec.get("loaded_repeats", 5))):
        dist.barrier()
        work = dist.all_reduce(loaded, async_op=True)
        time.sleep(0.002)  # let the bulk fill the queue first
        loaded_s.append(_timed_on(lambda: dist.all_reduce(small, group=control), dist, control))
        work.wait()
    busy_s = _while_busy(lambda: _timed(lambda: dist.all_reduce(bulk), dist), int(spec.get("busy_repeats", 3)))
    if dist.get_rank() == 0:
        out = {
            "world_size": dist.get_world_size(),
            "bulk_bytes": 4 * n,
            "bulk_s": statistics.median(bulk_s),
            "bulk_samples_s": bulk_s,
            "small_s": statistics.median(small_s),
            "small_samples_s": small_s,
            "loaded_small_s": statistics.median(loaded_s),
            "loaded_small_samples_s": loaded_s,
            "busy_bulk_s": statistics.median(busy_s),
            "busy_bulk_samples_s": busy_s,
        }
        out["bulk_Bps"] = 4 * n / statistics.median(bulk_s)
        out["busy_bulk_Bps"] = 4 * n / statistics.median(busy_s)
        Path(spec["out_path"]).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def measure_link(
    cluster: Any,
    nproc: int,
    out: Path,
    *,
    bulk_mb: float = BULK_MB,
    repeats: int = 5,
    small_repeats: int = 30,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run the probe on ``nproc`` ranks (one per node of ``cluster``, or loopback if None); its results.

    Raises RuntimeError with the launch's reason if any rank failed; everything started is stopped first.
    """
    from gradientflow.bench.runner_launch import error_from_log, launch_workers

    out.mkdir(parents=True, exist_ok=True)
    result = out / "link.json"
    result.unlink(missing_ok=True)
    spec = {
        "bulk_mb": bulk_mb,
        "repeats": repeats,
        "small_repeats": small_repeats,
        "out_path": str(result.resolve()),
        "pg_timeout_s": min(timeout_s, 120.0),
    }
    spec_path = out / "spec-link.json"
    spec_path.write_text(json.dumps(spec))
    reason, log, _ = launch_workers(
        "link", spec_path, out, nproc, cluster, timeout_s, threads=1, module="gradientflow.bench.links_probe"
    )
    if reason is not None or not result.exists():
        detail = error_from_log(log)
        raise RuntimeError(f"link probe failed: {reason or 'no results'}{': ' + detail if detail else ''} (log: {log})")
    return json.loads(result.read_text())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    probe_main(sys.argv[1])
