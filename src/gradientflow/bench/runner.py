"""``gradientflow bench``: every mode side by side in one launch of the ranks, and the launches.

Worker (``python -m gradientflow.bench.runner SPEC.json``, started by torchrun on every rank):
builds one model per *variant* (mode x bucket size θ), all from the same seed, then runs
``steps`` rounds; each round times one step of every variant in turn, after a barrier, so
noise on a shared 2-core machine hits all variants alike.  Rank 0 gathers the per-step times
(the slowest rank of each step counts) and writes them to the JSON file named in the spec.

Orchestration (:func:`run_bench`): one torchrun on loopback, or one torchrun per node of an
:class:`~gradientflow.bench.cluster.EmulatedCluster` (``nproc_per_node`` ranks each, a c10d rendezvous
across nodes when more than one; on an emulated cluster every step also reads the kernel's byte
counters of each node's link, :mod:`gradientflow.bench.link_bytes`).  DDP's PowerSGD hook runs with one bucket
(see :data:`POWERSGD_BUCKET_MB`) and still gets its own launch, with its own ``compute``
reference and a short timeout; a failure there is recorded in the JSON and the other modes are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gradientflow.bench import report
from gradientflow.bench.bench_memory import timing_allocator
from gradientflow.bench.report import ALONE_SUFFIX
from gradientflow.bench.runner_launch import error_from_log, free_port, launch_workers, stop, torchrun_argv, wait_all
from gradientflow.bench.runner_spec import (
    CSC_DENSITY,
    DDP_DEFAULT_BUCKET_MB,
    ISOLATED,
    MARK,
    MODES,
    POWERSGD_BUCKET_MB,
    POWERSGD_RANK,
    BenchOptions,
    BenchSpec,
    Variant,
    make_batch,
    make_model,
    plan_variants,
    process_group_backend,
    rank_device,
)
from gradientflow.bench.runner_worker import (
    _build,
    _loss,
    _step,
    exit_measured,
    powersgd_wire_bytes,
    worker_main,
)

__all__ = [
    "ALONE_SUFFIX",
    "CSC_DENSITY",
    "DDP_DEFAULT_BUCKET_MB",
    "ISOLATED",
    "MARK",
    "MODES",
    "POWERSGD_BUCKET_MB",
    "POWERSGD_RANK",
    "BenchOptions",
    "BenchSpec",
    "Variant",
    "_build",
    "_loss",
    "_step",
    "error_from_log",
    "free_port",
    "launch_workers",
    "make_batch",
    "make_model",
    "plan_variants",
    "powersgd_wire_bytes",
    "process_group_backend",
    "rank_device",
    "run_bench",
    "stop",
    "timing_allocator",
    "torchrun_argv",
    "wait_all",
    "worker_main",
]

logger = logging.getLogger(__name__)


def _launch(
    name: str, variants: list[Variant], opts: BenchOptions, out: Path, cluster: Any, timeout: float
) -> tuple[dict[str, Any] | None, str | None, float]:
    """Run one torchrun launch of ``variants``; returns (merged results or None, error, seconds)."""
    threads = opts.threads or max(1, (os.cpu_count() or 1) // opts.nproc)  # ranks share this machine
    raw_path = out / f"raw-{name}.json"
    raw_path.unlink(missing_ok=True)
    spec = BenchSpec(
        workload=opts.workload,
        batch_size=opts.batch_size,
        steps=opts.steps,
        warmup=opts.warmup,
        variants=[asdict(v) for v in variants],
        out_path=str(raw_path.resolve()),
        threads=threads,
        algorithm=opts.algorithm,
        chunk_size=opts.chunk_size,
        input_shape=list(opts.input_shape) if opts.input_shape else None,
        device=opts.device,
        emulated=cluster is not None,
        optimizer=opts.optimizer,
        transformer_size=list(opts.transformer_size),
    )
    spec_path = out / f"spec-{name}.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    reason, log_path, seconds = launch_workers(
        name, spec_path, out, opts.nproc, cluster, timeout, threads, nproc_per_node=opts.nproc_per_node
    )
    if reason is None and raw_path.exists():
        return json.loads(raw_path.read_text()), None, seconds
    detail = error_from_log(log_path)
    why = (reason or "no results written") + (f": {detail}" if detail else "")
    return None, f"{why} (log: {log_path})", seconds


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run the bench, write ``results.json``, ``table.md`` and ``bench.png`` to ``opts.out``; return the summary.

    ``opts.links`` is for :func:`gradientflow.bench.links_matrix.run_links` (the link-profile matrix).
    """
    from gradientflow.bench.cluster import EmulatedCluster, can_emulate

    if opts.links:
        raise ValueError("run_bench times one network; the link-profile matrix (opts.links) is links_matrix.run_links")
    emulate = opts.bandwidth != "none"
    if emulate:
        ok, why = can_emulate()
        if not ok:
            print(
                f"gradientflow bench: cannot emulate a {opts.bandwidth} cluster ({why}); running on loopback",
                file=sys.stderr,
            )
            emulate = False
    with contextlib.ExitStack() as stack:
        cluster = None
        if emulate:
            cluster = stack.enter_context(EmulatedCluster(nodes=opts.nodes, rate=opts.bandwidth, prefix=opts.prefix))
        launches = run_launches(opts, cluster)
    summary = report.summarize(launches, opts, emulated=cluster is not None)
    report.write_all(summary, Path(opts.out))
    for warning in summary["reference_warnings"]:
        logger.warning("bench: %s", warning)
    return summary


def run_launches(opts: BenchOptions, cluster: Any) -> list[dict[str, Any]]:
    """Every launch of one bench on ``cluster`` (None: loopback): the main one, then torch's PowerSGD hook
    and the alone twins, each with its own compute reference; their raw results, for :func:`report.summarize`."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = plan_variants(opts.modes, opts.fusion_mb, opts.theta_sweep, opts.alone)
    main = [v for v in variants if v.mode not in ISOLATED and not v.alone]
    # Extra launches, each with its own compute reference: torch's PowerSGD hook (kept apart in case it
    # fails) and the alone twins (own launch: twice the models in one process would not fit AlexNet's
    # 2 x ~9 GB in this machine's memory; a twin is compared with the compute mode of its own launch).
    extra = [("isolated", [v for v in variants if v.mode in ISOLATED]), ("alone", [v for v in variants if v.alone])]
    layout = f"{opts.nodes} x {opts.nproc_per_node} ranks" if opts.nproc_per_node > 1 else f"{opts.nproc} ranks"
    where = f"{layout} on emulated nodes ({cluster.describe()})" if cluster else layout
    logger.info(
        "bench %s: %s; %d variants, %d warm-up + %d timed steps each",
        opts.workload,
        where,
        len(variants),
        opts.warmup,
        opts.steps,
    )
    launches: list[dict[str, Any]] = []
    raw, err, secs = _launch("main", main, opts, out, cluster, opts.timeout_s)
    if raw is None:
        raise RuntimeError(f"bench launch failed: {err}")
    launches.append({"name": "main", "seconds": secs, **raw})
    per_variant = secs / max(1, len(main))
    for name, vs in extra:
        if not vs:
            continue
        # healthy, it takes about as long per variant as the main launch; a hang must not take forever
        limit = min(opts.timeout_s, 90 + 3 * per_variant * (len(vs) + 1))
        logger.info("bench: %s in launch '%s' (timeout %.0f s)", ", ".join(v.name for v in vs), name, limit)
        raw, err, secs = _launch(name, [Variant("compute", "compute"), *vs], opts, out, cluster, limit)
        if raw is None:
            raw = {"variants": [{**asdict(v), "status": "error", "error": err, "step_s": [], "stats": {}} for v in vs]}
            logger.warning("bench: %s failed: %s", ", ".join(v.name for v in vs), err)
        launches.append({"name": name, "seconds": secs, **raw})
    return launches


if __name__ == "__main__":
    worker_main(sys.argv[1])
    exit_measured()
