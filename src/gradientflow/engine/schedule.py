"""``schedule="auto"``: the bucket size θ and CSC's scope chosen from the link, measured at construction.

Users' networks differ (token-bucket depth, queueing, rate, latency): one fixed θ = 25 MB suits some.
With ``schedule="auto"`` the wrapper measures its process group once, at construction, and derives
θ and ``csc_scope`` from two numbers:

* ``alpha_s``: the cost of one collective, whatever its size: the fastest of
  :data:`SMALL_REPEATS` one-element allreduces (latency, the backend's rendezvous);
* ``bulk_Bps``: bytes per second handed to allreduce, from the fastest of :data:`BULK_REPEATS`
  allreduces of :data:`BULK_BYTES` (fp32), less ``alpha_s``.

The fastest, not the median: what another process does to this machine only ever adds time, and a
construction that happens to run while the CPUs are busy must not turn a bandwidth-bound link into
a "latency-bound" one for the whole run (a median under load once sent the schedule to one collective:
docs/results/benchmarks.md#figures-behind-the-codes-comments).

Both are rank 0's measurement, broadcast, so every rank derives the same schedule from the same
bits; the rule (:func:`plan`) is a pure function of them and of the model's sizes:

1. Messages: a bucket's fixed cost must stay under :data:`MESSAGE_SHARE` of its transfer time:
   ``θ_msg = alpha_s * bulk_Bps / MESSAGE_SHARE`` (in pool bytes, scaled by the wire bytes a pool
   byte becomes: 1/2 for a 16-bit wire, ``density`` for CSC).
2. ``θ = max(θ_msg, 25 MB)``: never below the fixed default.  A first version also capped θ at
   1/8 of the pool so that the first bucket leaves early in backward (12.2 MB on ResNet-50); side by
   side with the default (``benchmarks/links/auto-vs-default``, 2026-11-25 15:11 UTC) it was slower
   on both 1 Gbit/s profiles (efficiency 0.82 vs 0.90 and 0.70 vs 0.77): twice the slices cost more
   of CSC's own CPU (score exchanges, selections, packs) than the earlier start saved.
3. If ``θ_msg`` exceeds half the pool, fewer than two buckets could pay for their fixed cost: the
   link is *latency-bound* for this model, and the schedule is one collective after backward
   (``θ = inf``) and, for CSC, the ``"global"`` scope (one score exchange and one packed allreduce
   per pool instead of one of each per slice).  Otherwise CSC keeps ``"slice"`` (its chunks overlap
   backward).

The measurement takes ``SMALL_REPEATS + BULK_REPEATS + 2`` collectives on the group (at 1 Gbit/s
about 0.1 s; at 100 Mbit/s about 0.8 s), once per wrapper.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import CscScope, GradientFlowConfig
from ..diagnostics.watchdog import Watchdog

SMALL_REPEATS = 15
BULK_REPEATS = 3
BULK_BYTES = 2 << 20  # 2 MB: > one token bucket of every shaper we measured (<= 1.25 MB), short at 100 Mbit/s
MESSAGE_SHARE = 0.05
DEFAULT_THETA_BYTES = 25 * 2**20

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkEstimate:
    """What the rule needs from the network: one collective's fixed cost and the bulk throughput."""

    alpha_s: float
    bulk_Bps: float


@dataclass(frozen=True)
class Schedule:
    """The derived settings and why (``reason``, for logs and ``DistributedDataParallel.schedule``)."""

    fusion_threshold_mb: float
    csc_scope: CscScope
    latency_bound: bool
    link: LinkEstimate
    reason: str


def plan(link: LinkEstimate, pool_bytes: int, wire_per_pool_byte: float, sparse: bool) -> Schedule:
    """The rule (module docstring): θ and the CSC scope for ``link`` and a pool of ``pool_bytes``.

    ``wire_per_pool_byte``: bytes on the wire per pool byte (fp32 pool: 1 for an fp32 wire, 1/2 for
    fp16, ``density/2`` for CSC on fp16).  Pure and deterministic: same inputs, same schedule.
    """
    if pool_bytes <= 0:
        raise ValueError(f"pool_bytes must be > 0, got {pool_bytes}")
    if not wire_per_pool_byte > 0:
        raise ValueError(f"wire_per_pool_byte must be > 0, got {wire_per_pool_byte}")
    theta_msg = link.alpha_s * link.bulk_Bps / MESSAGE_SHARE / wire_per_pool_byte
    if theta_msg > pool_bytes / 2:
        return Schedule(
            math.inf,
            "global" if sparse else "slice",
            True,
            link,
            f"latency-bound: a collective costs {link.alpha_s * 1e3:.2f} ms, "
            f"{link.alpha_s * link.bulk_Bps / 1e3:.0f} KB of transfer; fewer than 2 buckets of a "
            f"{pool_bytes / 2**20:.1f} MB pool pay for it: one collective" + (", global scope" if sparse else ""),
        )
    theta = max(theta_msg, DEFAULT_THETA_BYTES)
    return Schedule(
        theta / 2**20,
        "slice",
        False,
        link,
        f"θ = max({theta_msg / 2**20:.2f} MB so a collective's {link.alpha_s * 1e3:.2f} ms is <= "
        f"{MESSAGE_SHARE:.0%} of its transfer, the default 25 MB) = {theta / 2**20:.2f} MB",
    )


def measure(group: dist.ProcessGroup, watchdog: Watchdog, device: torch.device, src: int) -> LinkEstimate:
    """Rank ``src``'s measurement of ``group`` (module docstring), broadcast so every rank has its bits."""
    small = torch.zeros(1, device=device)
    bulk = torch.zeros(BULK_BYTES // 4, device=device)

    def timed(t: torch.Tensor, what: str) -> float:
        t0 = time.perf_counter()
        watchdog.wait(dist.all_reduce(t, group=group, async_op=True), what, t.numel() * 4)
        return time.perf_counter() - t0

    timed(small, "schedule probe (warm-up)")
    timed(bulk, "schedule probe (warm-up)")
    alpha = min(timed(small, "schedule probe (small)") for _ in range(SMALL_REPEATS))
    bulk_s = min(timed(bulk, "schedule probe (bulk)") for _ in range(BULK_REPEATS))
    # the bulk's own fixed cost is alpha; what is left is transfer (floored: a one-rank group has none)
    mine = torch.tensor([alpha, BULK_BYTES / max(bulk_s - alpha, 1e-6)], dtype=torch.float64, device=device)
    watchdog.wait(dist.broadcast(mine, src=src, group=group, async_op=True), "schedule broadcast", 16)
    values = mine.tolist()
    return LinkEstimate(alpha_s=float(values[0]), bulk_Bps=float(values[1]))


def adapt(config: GradientFlowConfig, link: LinkEstimate, pool_bytes: int) -> tuple[GradientFlowConfig, Schedule]:
    """``config`` with θ and ``csc_scope`` from :func:`plan` (``schedule="auto"``), and the schedule."""
    wire_ratio = (config.wire_dtype.itemsize / 4) if config.wire_dtype is not None else 1.0
    if config.sparse:
        wire_ratio *= float(config.density or 1.0)
    sched = plan(link, pool_bytes, wire_ratio, config.sparse)
    return dataclasses.replace(config, fusion_threshold_mb=sched.fusion_threshold_mb, csc_scope=sched.csc_scope), sched


def resolve(
    config: GradientFlowConfig,
    group: dist.ProcessGroup,
    watchdog: Watchdog,
    params: Sequence[torch.Tensor],
    src: int,
) -> tuple[GradientFlowConfig, Schedule | None]:
    """The wrapper's entry: ``config`` unchanged for ``schedule="fixed"``; for ``"auto"`` measured and
    adapted (collective: every rank of ``group`` calls it at construction, in the same place)."""
    if config.schedule != "auto":
        return config, None
    link = measure(group, watchdog, params[0].device, src)
    config, sched = adapt(config, link, sum(p.numel() * p.element_size() for p in params))
    logger.info("gradientflow: schedule auto: %s", sched.reason)
    return config, sched
