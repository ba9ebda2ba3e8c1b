"""``gradientflow demo``: N local ranks train small_cnn on the shipped handwritten digits, fp16 wire + CSC.

Ranks are started by torchrun's own launcher API (``elastic_launch`` with a ``LaunchConfig``,
c10d rendezvous on 127.0.0.1), join a Gloo group, and each trains on its shard of the data.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    import gradientflow as gf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoOptions:
    """Options of ``gradientflow demo``: the library's ``compression``, ``density``, ``comm_dtype`` (``None`` /
    ``"fp32"``: the recipe's) and ``sync_every`` (H > 1: the ranks synchronised every H steps only, their
    per-step ``compression`` then ``"none"``: nothing crosses between syncs; docs/fewer-syncs.md)."""

    nproc: int = 2
    compression: str = "auto"
    steps: int = 400
    batch_size: int = 32
    density: float | None = None
    comm_dtype: str = "fp32"
    chunk_size: int = 1024
    lr: float = 0.05
    momentum: float = 0.9
    amp: bool = True
    out: str | None = None
    seed: int = 0
    sync_every: int = 1


def _evaluate(model: gf.DistributedDataParallel, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> float:
    """Accuracy over the whole test set: each rank scores its shard, the counts are summed."""
    model.eval()
    with torch.no_grad():
        pred = model.module(x[rank::world]).argmax(1)
    model.train()
    counts = torch.tensor([(pred == y[rank::world]).sum().item(), len(pred)], dtype=torch.float64)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def demo_worker(opts: DemoOptions) -> dict[str, Any] | None:
    """One rank: train, evaluate; rank 0 returns the report (other ranks return None)."""
    from tqdm import tqdm

    import gradientflow as gf
    from gradientflow.bench.data import load_digits_split, shard
    from gradientflow.bench.models import build_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.nproc))  # ranks share this machine
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        x_train, y_train, x_test, y_test = load_digits_split(seed=opts.seed)
        xs, ys = shard(x_train, y_train, rank, world)
        torch.manual_seed(opts.seed)
        model = gf.DistributedDataParallel(
            build_model("small_cnn"),
            fusion_threshold_mb=0.25,  # a few fused slices even for this 0.7 MB model, so they overlap backward
            compression=opts.compression,
            comm_dtype=opts.comm_dtype,
            density=opts.density,
            chunk_size=opts.chunk_size,
            warmup_steps=min(20, opts.steps // 10),  # top-k: a short density ramp from dense, as the paper
            # Momentum stays in the optimizer and CSC's momentum correction is off: on this model
            # (400 steps, seed 0) that reaches the dense run's 97.8%, momentum correction 95.8%.
            momentum=0.0,
            # fewer syncs: with H > 1 the replicas step on their own gradients and are averaged every H steps
            # (through 3 bits, the outer default); 1 is every step (the options above then apply)
            sync_every=opts.sync_every,
        )
        opt = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=opts.momentum)
        gen = torch.Generator().manual_seed(opts.seed * 1000 + rank)
        order = torch.randperm(len(xs), generator=gen)
        pos = 0
        bar = tqdm(range(opts.steps), desc=f"training ({world} ranks)", unit="step", disable=rank != 0)
        t0 = time.perf_counter()
        for step in bar:
            if pos + opts.batch_size > len(order):  # next epoch
                order, pos = torch.randperm(len(xs), generator=gen), 0
            idx = order[pos : pos + opts.batch_size]
            pos += opts.batch_size
            opt.zero_grad(set_to_none=True)
            # bf16 autocast: CPU supports it natively and it needs no loss scaling (fp32's exponent range)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=opts.amp):
                loss = F.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            opt.step()
            if step % 20 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
        seconds = time.perf_counter() - t0
        bar.close()
        run = model.comm_stats(total=True)  # every synchronised step since the model was wrapped
        # What crossed between nodes: payload_bytes, the per-step exchange's bytes or, with sync_every > 1, the
        # outer syncs' (comm_stats counts those there). DDP's: one dense fp32 allreduce of every gradient per step,
        # counted from the parameters.
        payload = int(run["payload_bytes"])
        ddp_bytes = opts.steps * sum(4 * p.numel() for p in model.parameters() if p.requires_grad)
        acc = _evaluate(model, x_test, y_test, rank, world)
        if rank != 0:
            return None
        return {
            "ranks": world,
            "steps": opts.steps,
            "seconds": seconds,
            "steps_per_s": opts.steps / seconds,
            "test_accuracy": acc,
            "test_samples": len(y_test),
            "final_loss": float(loss.item()),
            "payload_bytes": payload,
            "ddp_bytes": ddp_bytes,
            "outer_syncs": int(run.get("outer_syncs", 0)),
            "mode": _mode(model.config) + (", bf16 autocast" if opts.amp else ", fp32 compute"),
            "options": asdict(opts),
        }
    finally:
        dist.destroy_process_group()


def _mode(config: gf.GradientFlowConfig) -> str:
    """What ran, in the recipe table's words: ``compression="topk-3bit" (density 0.3, chunks of 1024)``."""
    out = f'compression="{config.compression}"'
    if config.sparse:
        out += f" (density {config.density:g}, chunks of {config.chunk_size})"
    elif config.mechanism == "dense":
        out += f" (comm_dtype {config.comm_dtype})"
    if config.sync_every > 1:
        out += f', sync_every={config.sync_every} (outer_compression="{config.outer_compression}")'
    return out


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Launch ``opts.nproc`` ranks with torchrun's API, train, log the report and return it."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from gradientflow.bench.runner import free_port

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=opts.nproc,
        run_id=f"gf-demo-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    logger.info(
        "gradientflow demo: %d ranks (Gloo, 127.0.0.1), small_cnn on the 8x8 handwritten digits, %d steps",
        opts.nproc,
        opts.steps,
    )
    results = elastic_launch(config, demo_worker)(opts)
    rep = results[0]
    saved = 1 - rep["payload_bytes"] / rep["ddp_bytes"] if rep["ddp_bytes"] else 0.0
    logger.info(
        "\nresult (%s):\n"
        "  test accuracy   %.1f%% of %d held-out digits (final training loss %.3f)\n"
        "  speed           %.1f steps/s (%d steps in %.1f s, %d ranks)\n"
        "  bytes sent      %.2f MB per rank, handed to %s over the run\n"
        "  DDP would send  %.2f MB (dense fp32 allreduce of every gradient) -> %.1f%% less",
        rep["mode"],
        100 * rep["test_accuracy"],
        rep["test_samples"],
        rep["final_loss"],
        rep["steps_per_s"],
        rep["steps"],
        rep["seconds"],
        rep["ranks"],
        rep["payload_bytes"] / 2**20,
        f"{rep['outer_syncs']} outer syncs" if rep["outer_syncs"] else "allreduce",
        rep["ddp_bytes"] / 2**20,
        100 * saved,
    )
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / "demo.json").write_text(json.dumps(rep, indent=1))
    return rep
