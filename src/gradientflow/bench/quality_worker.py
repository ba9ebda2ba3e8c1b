"""The worker of ``gradientflow bench --quality``: ``python -m gradientflow.bench.quality_worker SPEC.json``,
started by torchrun on every rank.  Trains each job's recipes interleaved step by step (a barrier before
each step, so noise hits every recipe alike; the slowest rank's time counts), evaluates them outside the
clock, and rank 0 writes the raw results named in the spec.  See :mod:`gradientflow.bench.quality`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gradientflow.bench import sharded
from gradientflow.bench.link_bytes import LINK_ENV, LinkCounter, close_window, node_of_rank, open_window, per_node
from gradientflow.bench.quality_data import WorkloadData, cross_entropy, evaluate
from gradientflow.bench.quality_lr import lr_schedule
from gradientflow.bench.quality_peers import TORCH_PEERS, torch_peer_bytes
from gradientflow.bench.quality_recipes import build_recipe
from gradientflow.bench.quality_spec import Job, QualitySpec
from gradientflow.bench.runner import MARK, exit_measured, timing_allocator

logger = logging.getLogger(__name__)


def _elapsed(t0: float, device: torch.device) -> float:
    """Seconds since ``t0`` once the device's queued work is done (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _comm_record(wrapped: nn.Module, recipe: str = "ddp", step: int = 0) -> dict[str, float]:
    if getattr(wrapped, "_gf_fsdp", None) is not None:  # gradientflow.fsdp: what this rank handed between nodes
        return {"payload_bytes": sharded.stats(wrapped)["payload_bytes"]}
    if recipe in sharded.HSDP_MODES:  # torch's HSDP: its shard in the reduce dtype
        n = sum(p.numel() for p in wrapped.parameters())
        return {"payload_bytes": sharded.hsdp_wire_bytes(recipe, n, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))}
    peer_bytes = getattr(wrapped, "payload_bytes", None)  # torchft's DiLoCo: computed, torchft reports none
    if peer_bytes is not None:
        return {"payload_bytes": peer_bytes(step)}
    comm_stats = getattr(wrapped, "comm_stats", None)  # gradientflow's wrapper; torch DDP has none
    if comm_stats is None:
        if recipe not in TORCH_PEERS:
            return {}  # torch DDP: the report computes 4 bytes per gradient
        shapes = [tuple(p.shape) for p in wrapped.parameters() if p.requires_grad]
        return {"payload_bytes": torch_peer_bytes(recipe, shapes, step)}
    s = comm_stats()
    keys = ("payload_bytes", "exposed_seconds", "warmup", "selected_chunks", "n_chunks")
    record = {k: float(s[k]) for k in keys if k in s}
    return record  # sync_every > 1: payload_bytes is this step's outer syncs' bytes (comm_stats counts them so)


def _picked(wrapped: nn.Module) -> str | None:
    """What ``compression="auto"`` picked and why (``comm_stats()["compression_auto"]``), else None."""
    comm_stats = getattr(wrapped, "comm_stats", None)
    return comm_stats().get("compression_auto") if comm_stats is not None else None


@dataclass
class _Run:
    recipe: str
    wrapped: nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    batches: Any
    options: dict[str, Any]
    steps: int
    step_s: list[float] = field(default_factory=list)
    stats: list[dict[str, float]] = field(default_factory=list)
    link: list[list[int]] = field(default_factory=list)  # per step [tx, rx] of the node's link (its local rank 0)
    evals: list[dict[str, Any]] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    status: str = "ok"
    error: str | None = None


class _Probe:
    """Compute-only steps (the ddp recipe's forward, backward and optimizer, lr 0, no communication),
    spread over the run so that they see the same machine load as the training steps."""

    def __init__(self, data: WorkloadData, job: Job) -> None:
        self.model = data.build_model()
        params = self.model.parameters()
        self.opt = (
            torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), weight_decay=0.1)
            if job.optimizer == "adamw"
            else torch.optim.SGD(params, lr=0.0, momentum=0.9)
        )
        self.batches = data.batches()
        self.device = data.device
        self.times: list[float] = []
        for _ in range(2):  # untimed: first-call costs
            self.step(record=False)

    def step(self, record: bool = True) -> None:
        x, y = next(self.batches)
        dist.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        cross_entropy(self.model(x), y).backward()
        self.opt.step()
        if record:
            self.times.append(_elapsed(t0, self.device))


def run_job(job: Job, seed: int, rank: int, world: int) -> dict[str, Any]:
    """Train every recipe of ``job`` interleaved step by step; this rank's record."""
    data = WorkloadData(job, seed, rank, world)
    probe = _Probe(data, job)
    # on an emulated cluster (every rank has LINK_ENV): the kernel's count of the node's link, per step
    counted = LINK_ENV in os.environ
    link = LinkCounter.from_env() if counted and int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    runs: list[_Run] = []
    n_params = 0
    try:
        for recipe in job.recipes:
            model = data.build_model()
            n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
            wrapped, opt, options = build_recipe(recipe, model, job)
            own = replace(job, steps=max(1, round(job.steps * options.get("steps_factor", 1.0))))
            runs.append(_Run(recipe, wrapped, opt, lr_schedule(opt, own), data.batches(), options, own.steps))
        return _train(job, data, probe, runs, rank, n_params, link, counted)
    finally:  # torchft's recipes: their Manager and lighthouse, also when a rank or a later recipe failed
        for run in runs:
            close = getattr(run.wrapped, "close", None)
            if close is not None:
                close()


def _train(
    job: Job,
    data: WorkloadData,
    probe: _Probe,
    runs: list[_Run],
    rank: int,
    n_params: int,
    link: LinkCounter | None,
    counted: bool,
) -> dict[str, Any]:
    """:func:`run_job`'s training and evaluation of its recipes, once they are built."""
    from tqdm import tqdm

    probe_every = max(1, job.steps // max(1, job.probe_steps))

    def due(run: _Run, step: int) -> bool:
        """Evaluated after ``step`` steps: every ``eval_every`` steps of its own run and at its last."""
        return run.status == "ok" and step <= run.steps and (step % job.eval_every == 0 or step == run.steps)

    def eval_all(step: int) -> None:
        for run in runs:
            if due(run, step):
                loss, acc = evaluate(_trained(run), data)
                recent = run.train_losses[-job.eval_every :]
                run.evals.append(
                    {
                        "step": step,
                        "val_loss": loss,
                        "val_acc": acc,
                        "train_loss": sum(recent) / len(recent) if recent else None,
                    }
                )

    eval_all(0)
    bar = tqdm(
        range(max(r.steps for r in runs)),
        desc=f"{job.name}: {len(runs)} recipes",
        unit="step",
        disable=rank != 0,
        file=sys.stderr,
        mininterval=2.0,
    )
    for step in bar:
        if step % probe_every == 0:
            probe.step()
        for run in runs:
            if run.status != "ok" or step >= run.steps:
                continue
            x, y = next(run.batches)
            before = open_window(link, counted)
            t0 = time.perf_counter()
            try:
                run.opt.zero_grad(set_to_none=True)
                loss = cross_entropy(run.wrapped(x), y)
                loss.backward()
                run.opt.step()
            except Exception as exc:  # noqa: BLE001 — recorded per recipe; the others go on
                run.status, run.error = "error", f"{type(exc).__name__}: {exc}"
                logger.error("%s / %s failed at step %d: %s", job.name, run.recipe, step, run.error)
                continue
            run.step_s.append(_elapsed(t0, data.device))
            run.sched.step()
            run.stats.append(_comm_record(run.wrapped, run.recipe, step))
            run.train_losses.append(float(loss))  # a diverged recipe trains on: NaN shows in its evaluations
            crossed = close_window(link, counted, before)  # after every node's step (outside the clock)
            if crossed is not None:
                run.link.append(crossed)
        if any(due(r, step + 1) for r in runs):
            eval_all(step + 1)
            if rank == 0:
                losses = {r.recipe: f"{r.evals[-1]['val_loss']:.3f}" for r in runs if r.evals}
                bar.set_postfix(losses, refresh=False)
                # the launcher shows MARK lines on the user's terminal (the bar goes to the launch log)
                print(
                    f"{MARK}{job.name} step {step + 1}/{bar.total}, validation loss: "
                    + ", ".join(f"{k} {v}" for k, v in losses.items()),
                    file=sys.stderr,
                    flush=True,
                )
    bar.close()
    return {
        "job": asdict(job),
        "n_params": n_params,
        "probe_s": probe.times,
        "runs": [
            {
                "recipe": r.recipe,
                "options": r.options,
                "status": r.status,
                "error": r.error,
                "step_s": r.step_s,
                "stats": r.stats,
                "evals": r.evals,
                "link": r.link,
                "picked": _picked(r.wrapped),
                "params_sha1": _params_digest(_trained(r)),
            }
            for r in runs
        ],
    }


def _trained(run: _Run) -> nn.Module:
    """The model a run trains: a DDP wrapper's module; an FSDP model is its own (its forward all-gathers the
    shards, its parameters are this rank's shards)."""
    return run.wrapped if sharded.is_sharded(run.recipe) else cast(nn.Module, run.wrapped.module)


def _params_digest(module: nn.Module) -> str:
    """SHA-1 of the parameters' bytes (this rank's shard under FSDP): equal on two ranks exactly when their
    replicas are bit-identical, e.g. after a local-SGD recipe's last sync."""
    digest = hashlib.sha1()
    for p in module.parameters():
        t = p.detach()
        t = cast(Any, t).to_local() if hasattr(t, "to_local") else t  # a DTensor's own shard
        digest.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record, with every step's time (and the probe's) replaced by the slowest rank's."""
    out = dict(per_rank[0])
    out["probe_s"] = [max(ts) for ts in zip(*(r["probe_s"] for r in per_rank))]
    runs = []
    for i, run in enumerate(per_rank[0]["runs"]):
        run = dict(run)
        run["step_s"] = [max(ts) for ts in zip(*(r["runs"][i]["step_s"] for r in per_rank))]
        if any(r["runs"][i]["link"] for r in per_rank):  # the kernel's bytes per node (emulated cluster)
            run["nodes"] = per_node([r["runs"][i] for r in per_rank], [r["node"] for r in per_rank], len(run["step_s"]))
            if not run["recipe"].startswith(("gf-", "fsdp-")):  # torch's peers' payload is computed, not ours
                for node in run["nodes"]:
                    node["payload_bytes"] = node["inter_node_bytes"] = None
        run.pop("link", None)
        run["replica_params_sha1"] = [r["runs"][i].get("params_sha1") for r in per_rank]  # rank by rank
        run.pop("params_sha1", None)
        runs.append(run)
    out["runs"] = runs
    return out


def worker_main(spec_path: str) -> None:
    """One rank (run under torchrun): every job of the spec in turn; rank 0 writes the results."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = QualitySpec(**json.loads(Path(spec_path).read_text()))
    torch.set_num_threads(spec.threads)
    timing_allocator()  # nothing here measures memory: time in malloc's steady state
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        results = []
        for jd in spec.jobs:
            mine = {**run_job(Job(**jd), spec.seed, rank, world), "node": node_of_rank()}
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
            results.append(_merge(gathered))
        if rank == 0:
            Path(spec.out_path).write_text(
                json.dumps({"world_size": world, "threads_per_rank": spec.threads, "jobs": results})
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(sys.argv[1])
    exit_measured()
