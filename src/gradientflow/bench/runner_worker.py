"""The bench's worker, one per rank (``python -m gradientflow.bench.runner SPEC.json`` under torchrun).

Builds one model per *variant* (mode x bucket size θ), all from the same seed, then runs ``steps``
rounds; each round times one step of every variant in turn, after a barrier, so noise on a shared
2-core machine hits all variants alike.  Rank 0 gathers the per-step times (the slowest rank of each
step counts) and writes them to the JSON file named in the spec.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradientflow.bench import sharded
from gradientflow.bench.bench_memory import PeakRss, rss_mb, timing_allocator
from gradientflow.bench.link_bytes import LinkCounter, close_window, node_of_rank, open_window, per_node
from gradientflow.bench.runner_spec import (
    DDP_DEFAULT_BUCKET_MB,
    MARK,
    POWERSGD_BUCKET_MB,
    POWERSGD_RANK,
    BenchSpec,
    Variant,
    gf_recipe,
    make_batch,
    make_model,
    process_group_backend,
    rank_device,
    split_mode,
    topology_kwargs,
)
from gradientflow.comm.collectives import as_member
from gradientflow.diagnostics.stats import PHASES
from gradientflow.option_values import auto_chunk_size, lookup, mechanism_of

logger = logging.getLogger(__name__)


def powersgd_wire_bytes(params: Sequence[torch.Tensor], rank: int = POWERSGD_RANK, min_rate: float = 2.0) -> int:
    """Bytes torch's ``powerSGD_hook`` hands to allreduce per step, from its own rule.

    Each gradient is viewed as (shape[0], -1); it is compressed to P (n x r) and Q (m x r) when
    n*m > (n+m)*r*min_compression_rate, else allreduced as is; all in fp32.
    """
    total = 0
    for p in params:
        n = p.shape[0] if p.dim() > 0 else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, rank)
        total += (n + m) * r if n * m > (n + m) * r * min_rate else n * m
    return 4 * total


def _build(
    v: Variant, spec: BenchSpec, chunk_size: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, int | None]:
    """Model + wrapper + optimizer of one variant (its collectives on ``group``, None = the default
    one); also the computed wire bytes (None = measured)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import gradientflow as gf

    torch.manual_seed(0)
    model = make_model(spec.workload, spec.transformer_size).to(device)
    ids: list[int | torch.device] | None = None if device.type == "cpu" else [device.index]
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    momentum = 0.9
    wire: int | None = None
    mode = split_mode(v.mode)[0]
    if mode == "compute":
        wrapped: nn.Module = model
        wire = 0
    elif sharded.is_sharded(mode):  # FSDP2 / HSDP on the launch's mesh (nodes x ranks per node)
        wrapped = sharded.shard(model, mode)
        if mode in sharded.HSDP_MODES:
            wire = sharded.hsdp_wire_bytes(mode, n, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    elif mode.startswith("gf-"):
        # a recipe of the table and the mode's options (runner_spec.gf_recipe); the top-k recipes' sparse steps
        # are timed (no density ramp: the bench's own warm-up steps are dense-free) at the bench's chunk size;
        # "auto" from its first optimizer step (the warm-up steps cover the switch)
        recipe, options = gf_recipe(mode)
        mechanism = mechanism_of(lookup(recipe).name, options.get("density"))
        timing: dict[str, Any] = {}
        if mechanism in ("dense", "topk"):
            timing["algorithm"] = spec.algorithm
        if mechanism in ("topk", "topk-quantized"):
            timing.update(chunk_size=chunk_size, warmup_steps=0)
        wrapped = gf.DistributedDataParallel(
            model,
            device_ids=ids,
            process_group=group,
            fusion_threshold_mb=v.theta_mb,
            compression=recipe,
            **{**timing, **options},  # an option the mode names (gf-<recipe>:OPTION=VALUE) over the bench's
            **topology_kwargs(v.mode),  # mode@flat: the engine's layout forced (a TypeError before it has one)
        )  # CSC keeps the optimizer's momentum (the recommended recipe): no momentum correction
    else:
        cap = v.theta_mb if v.theta_mb is not None else DDP_DEFAULT_BUCKET_MB
        if mode == "ddp-powersgd":
            cap = POWERSGD_BUCKET_MB
        torch_ddp = wrapped = TorchDDP(model, device_ids=ids, bucket_cap_mb=cap, process_group=group)
        wire = 4 * n
        if mode == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            # the hook's state is its process group (None: the default one)
            torch_ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
            wire = 2 * n
        elif mode == "ddp-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            # start_powerSGD_iter=2 is the earliest torch allows; the bench's warm-up covers it
            state = psgd.PowerSGDState(
                process_group=group, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2
            )
            torch_ddp.register_comm_hook(state, psgd.powerSGD_hook)
            wire = powersgd_wire_bytes(params)
    opt: torch.optim.Optimizer
    if spec.optimizer == "adamw":  # the transformer's optimizer in bench --quality (docs/results/adamw.md)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        opt = torch.optim.SGD(wrapped.parameters(), lr=spec.lr, momentum=momentum)
    return wrapped, opt, wire


def _loss(out: Any, y: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy on the built-in workloads; for a user's model (no labels, ``y`` None) the mean
    square of every floating-point tensor it returns (in tuples, lists, dicts): a synthetic objective
    that reaches every parameter the output depends on, which is all a timing needs."""
    if y is not None:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    leaves: list[torch.Tensor] = []

    def collect(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.is_floating_point():
                leaves.append(o.float().square().mean())
        elif isinstance(o, dict):
            for v in o.values():
                collect(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v)

    collect(out)
    if not leaves:
        raise ValueError(f"the model returned no floating-point tensor to train on ({type(out).__name__})")
    return torch.stack(leaves).sum()


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor | None) -> None:
    opt.zero_grad(set_to_none=True)
    _loss(model(x), y).backward()
    opt.step()
    if x.is_cuda:  # a step ends when the GPU has run it, not when it was queued
        torch.cuda.synchronize(x.device)


def _build_and_warm(
    rec: dict[str, Any],
    v: Variant,
    spec: BenchSpec,
    chunk: int,
    device: torch.device,
    alone: dist.ProcessGroup | None,
    x: torch.Tensor,
    y: torch.Tensor | None,
) -> None:
    """Build ``v``'s model and optimizer into ``rec["_obj"]`` and run its warm-up steps, recording the memory
    they added.  Only ``rec`` holds the model afterwards (freed before the exit, while the group exists)."""
    before = rss_mb()
    if device.type == "cuda":  # on a GPU the memory a mode adds is device memory, not host RSS
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) / 2**20
    # on a GPU the memory a mode adds is the device's (below): no RSS sampler thread there
    with PeakRss() if device.type == "cpu" else contextlib.nullcontext() as peak:
        model, opt, rec["computed_wire_bytes"] = _build(v, spec, chunk, device, alone)
        sched = getattr(model, "schedule", None)  # schedule="auto": what it chose, and why
        if sched is not None:
            rec["schedule"] = {"theta_mb": sched.fusion_threshold_mb, "scope": sched.csc_scope}
            rec["schedule"]["reason"] = sched.reason
        for _ in range(spec.warmup):
            _step(model, opt, x, y)
    if device.type == "cuda":
        top = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        assert peak is not None  # the RSS sampler runs on CPU
        top = peak.peak
    rec["mem_added_mb"] = top - before
    rec["_obj"] = (model, opt)


STAT_KEYS = ("payload_bytes", "exposed_seconds", "comm_seconds", "collectives", "host_syncs")


def _stats_of(model: nn.Module) -> dict[str, float]:
    """The counters the report uses, with every ``phase_*_s`` (0 for phases a step did not run)."""
    if getattr(model, "_gf_fsdp", None) is not None:  # gradientflow.fsdp's root
        return sharded.stats(model)
    comm_stats = getattr(model, "comm_stats", None)  # gradientflow's wrapper (torch DDP has none)
    if comm_stats is None:
        return {}
    s = comm_stats()
    out = {k: float(s[k]) for k in STAT_KEYS}
    if "inter_node_bytes" in s:  # the two-level engine's count of what it sent between nodes
        out["inter_node_bytes"] = float(s["inter_node_bytes"])
    out.update({f"phase_{p}_s": 0.0 for p in PHASES})
    out.update({k: float(v) for k, v in s.items() if k.startswith("phase_")})
    return out


def worker_main(spec_path: str) -> None:
    """One rank of the bench (run under torchrun): time every variant, rank 0 writes the results."""
    spec = BenchSpec(**json.loads(Path(spec_path).read_text()))
    torch.set_num_threads(spec.threads)
    device = rank_device(spec.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = process_group_backend(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), spec.emulated)
    dist.init_process_group(backend, timeout=timedelta(seconds=spec.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda msg: print(MARK + msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    say(f"{world} ranks on {device.type} ({backend})")
    # the kernel's count of this node's link, read by one rank per node (they share the link)
    link = LinkCounter.from_env() if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    x, y = make_batch(spec, rank)
    x, y = x.to(device), (None if y is None else y.to(device))
    probe = make_model(spec.workload, spec.transformer_size).to(device)
    n_params = sum(p.numel() for p in probe.parameters())
    chunk = spec.chunk_size or auto_chunk_size(n_params)
    # one untimed local step first, so one-off costs (kernels, autograd threads) are not charged to a mode
    _loss(probe(x), y).backward()
    del probe
    base_rss = rss_mb()
    # every rank creates every group (new_group's contract); each keeps the one holding only itself
    # every rank takes part in creating every group; each keeps its own
    groups = [dist.new_group([r]) for r in range(world)] if any(vd.get("alone") for vd in spec.variants) else None
    alone = as_member(groups[rank], [rank]) if groups is not None else None
    runs: list[dict[str, Any]] = []
    for vd in spec.variants:
        v = Variant(**vd)
        rec: dict[str, Any] = {
            **vd,
            "status": "ok",
            "error": None,
            "step_s": [],
            "cpu_s": [],
            "stats": [],
            "computed_wire_bytes": None,
            "mem_added_mb": None,
            "link": [],
        }
        try:
            _build_and_warm(rec, v, spec, chunk, device, alone if v.alone else None, x, y)
        except Exception as exc:  # noqa: BLE001 — recorded per mode; the other modes go on
            rec["status"], rec["error"] = "error", f"{type(exc).__name__}: {exc}"
            say(f"{v.name}: {rec['error']}")
        runs.append(rec)
        say(f"built {v.name} (+{rec['mem_added_mb'] or 0:.0f} MB after {spec.warmup} warm-up steps)")
    timing_allocator()
    for rec in runs:  # one untimed round in that allocator: the heap grows once, here
        if rec["status"] == "ok":
            dist.barrier()
            _step(rec["_obj"][0], rec["_obj"][1], x, y)
    say(f"timing {spec.steps} rounds of {sum(r['status'] == 'ok' for r in runs)} variants")
    for step in range(spec.steps):
        for rec in runs:
            if rec["status"] != "ok":
                continue
            counters = open_window(link, spec.emulated)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                _step(rec["_obj"][0], rec["_obj"][1], x, y)
            except Exception as exc:  # noqa: BLE001
                rec["status"], rec["error"] = "error", f"{type(exc).__name__}: {exc}"
                say(f"{rec['name']}: {rec['error']}")
                continue
            cpu = time.thread_time() - c0  # read first: the CPU interval lies inside the wall interval
            rec["step_s"].append(time.perf_counter() - t0)
            crossed = close_window(link, spec.emulated, counters)  # after every node's step (off the clock)
            if crossed is not None:
                rec["link"].append(crossed)
            rec["cpu_s"].append(cpu)  # this thread runs forward, backward (on CPU) and the optimizer
            rec["stats"].append(_stats_of(rec["_obj"][0]))
        say(f"round {step + 1}/{spec.steps} done")
    # Free every model while the process group still exists: a wrapper destroyed after
    # destroy_process_group (torch DDP with the PowerSGD hook) can hang the exit (1 in ~5 launches).
    for rec in runs:
        rec.pop("_obj", None)
    gc.collect()
    maxrss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    mine = {"runs": runs, "base_rss_mb": base_rss, "maxrss_mb": maxrss_mb, "node": node_of_rank()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(spec.out_path).write_text(json.dumps(_merge(gathered, spec, n_params, chunk, world)))
    dist.barrier()
    dist.destroy_process_group()


def _merge(per_rank: list[dict[str, Any]], spec: BenchSpec, n_params: int, chunk: int, world: int) -> dict[str, Any]:
    """One record per variant: per step the slowest rank's time; stats per step, max over ranks."""
    variants = []
    for i, rec in enumerate(per_rank[0]["runs"]):
        ranks = [r["runs"][i] for r in per_rank]
        n = min(len(r["step_s"]) for r in ranks)
        out = {k: v for k, v in rec.items() if k not in ("step_s", "cpu_s", "stats", "link")}
        errors = [r["error"] for r in ranks if r["error"]]
        out["status"] = "error" if errors else "ok"
        out["error"] = errors[0] if errors else None
        out["step_s"] = [max(r["step_s"][s] for r in ranks) for s in range(n)]
        out["cpu_s"] = [max(r["cpu_s"][s] for r in ranks) for s in range(n)]
        keys = ranks[0]["stats"][0].keys() if n and ranks[0]["stats"] else []
        out["stats"] = {k: [max(r["stats"][s].get(k, 0.0) for r in ranks) for s in range(n)] for k in keys}
        out["mem_added_mb"] = max((r["mem_added_mb"] or 0.0) for r in ranks)
        out["nodes"] = per_node(ranks, [r["node"] for r in per_rank], n)  # kernel link bytes, engine's per node
        variants.append(out)
    return {
        "world_size": world,
        "nodes": len({r["node"] for r in per_rank}),
        "n_params": n_params,
        "chunk_size": chunk,
        "threads_per_rank": spec.threads,
        "base_rss_mb": max(r["base_rss_mb"] for r in per_rank),
        "maxrss_mb": [r["maxrss_mb"] for r in per_rank],
        "variants": variants,
    }


def exit_measured() -> None:
    """End a bench worker whose results are written and whose process group is destroyed, skipping the
    interpreter's finalisation.

    torch DDP with a comm hook (the PowerSGD peer) can leave a Gloo work whose tensor Gloo's own thread
    frees while the interpreter finalises; the process then aborts ("terminate called without an active
    exception": 1 launch of CI's bench test, 2026-11-25) although every figure was measured and written.
    gradientflow's wrapper ends its groups at exit itself (``wrapper/shutdown.py``); the peers it is
    timed against do not, so the worker ends here, its files and streams flushed.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
