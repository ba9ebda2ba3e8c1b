"""Pure cost formulas: seconds for one allreduce of ``nbytes`` on ``n`` GPUs.

Two algorithms, each flat (one GPU per node) or two-level (``g`` GPUs per node, M = n/g nodes):

* ring (Patarasuk & Yuan 2009; Baidu's ring allreduce; DESIGN.md):
  flat ``α + 2(n-1)/n · S/B``.  Two-level: a reduce-scatter inside the node, then g concurrent
  inter-node rings on S/g bytes each (together S through the node's one link), then an
  all-gather inside the node:
  ``2·[α_i + (g-1)/g · S/B_i] + α + 2(M-1)/M · S/B``.
* tree, the ``baseline``'s allreduce: a binomial-tree reduce followed by a binomial-tree
  broadcast, the classic non-pipelined MPI algorithm (Thakur, Rabenseifner & Gropp, "Optimization
  of collective communication operations in MPICH", IJHPCA 2005: each costs ⌈log2 p⌉(α + S/B)).
  Every round moves the whole message, so its bandwidth term grows with log2(n) where the
  ring's stays below 2·S/B.  Two-level: the same inside the node, then across nodes.

``n == 1`` costs nothing: one GPU has nobody to talk to.
"""

from __future__ import annotations

import math

from ..comm.topology import two_level_plan
from .config import SimConfig


def ring_flat_s(nbytes: float, n: int, alpha: float, bw: float) -> float:
    """``α + 2(n-1)/n · nbytes / bw`` (0 for n <= 1 or nothing to send)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return alpha + 2.0 * (n - 1) / n * nbytes / bw


def tree_flat_s(nbytes: float, n: int, alpha: float, bw: float) -> float:
    """Binomial reduce + broadcast: ``2⌈log2 n⌉ · (α + nbytes / bw)``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / bw)


def _levels(n: int, cfg: SimConfig) -> tuple[int, int]:
    """(GPUs per node actually used, nodes) for ``n`` GPUs; n <= g is one partly filled node."""
    g = min(cfg.gpus_per_node, n)
    if n % g:
        raise ValueError(
            f"{n} GPUs do not fill whole nodes of {cfg.gpus_per_node}; "
            "pick a GPU count that is a multiple of --gpus-per-node"
        )
    return g, n // g


def two_level_bytes(numels: list[int], nodes: int, per_node: int, itemsize: int = 4) -> tuple[int, int]:
    """(bytes one rank sends inside its node, bytes it sends between nodes) for buckets of ``numels``
    elements synchronised two-level: the engine's own plan (:func:`gradientflow.comm.topology.two_level_plan`,
    shards padded to whole elements), what ``comm_stats()`` reports as ``intra_node_bytes`` /
    ``inter_node_bytes`` for a dense recipe."""
    plans = [two_level_plan(n, nodes, per_node, itemsize=itemsize) for n in numels]
    return sum(p.intra_bytes for p in plans), sum(p.inter_bytes for p in plans)


def allreduce_s(nbytes: float, n: int, cfg: SimConfig, algorithm: str = "ring", itemsize: int = 1) -> float:
    """Seconds for one allreduce of ``nbytes`` per GPU on ``n`` GPUs of the cluster ``cfg``.

    1. Split n into g GPUs per node and M nodes.
    2. Flat cluster (g == 1): the algorithm on the inter-node link.
    3. One node (M == 1): the algorithm on the intra-node link.
    4. Otherwise two levels (see the module docstring), the ring on the engine's plan
       (:func:`~gradientflow.comm.topology.two_level_plan`: ``nbytes`` as elements of ``itemsize`` bytes
       cut into g padded shards); the g shards' rings share the node's one link.
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    g, m = _levels(n, cfg)
    bi = cfg.intra_bandwidth if cfg.intra_bandwidth is not None else cfg.bandwidth
    if algorithm == "ring":
        if g == 1:
            return ring_flat_s(nbytes, m, cfg.latency, cfg.bandwidth)
        if m == 1:
            return ring_flat_s(nbytes, g, cfg.intra_latency, bi)
        plan = two_level_plan(math.ceil(nbytes / itemsize), m, g, itemsize=itemsize)
        intra = 2 * cfg.intra_latency + plan.intra_bytes / bi  # the reduce-scatter and the all-gather
        return intra + cfg.latency + g * plan.inter_bytes / cfg.bandwidth
    if algorithm == "tree":
        return tree_flat_s(nbytes, g, cfg.intra_latency, bi) + tree_flat_s(nbytes, m, cfg.latency, cfg.bandwidth)
    raise ValueError(f"algorithm must be 'ring' or 'tree', got {algorithm!r}")


def exchange_s(
    numel: int,
    n: int,
    cfg: SimConfig,
    wire: float,
    *,
    intra_wire: float | None = None,
    block: int = 1,
    flat: bool = False,
    direct: bool = False,
) -> float:
    """Seconds for one bucket of ``numel`` gradients on ``n`` GPUs, as the engine synchronises it.

    ``wire``: bytes per gradient between nodes (4 fp32, 2 fp16, 3/8 + 2/128 the 3-bit quantised
    wire); ``intra_wire``: bytes per gradient inside the node (default ``wire``; the quantised
    recipe reduce-scatters and all-gathers fp32 inside the node); ``block``: the quantiser's block,
    which the engine's shards are made of (:func:`~gradientflow.comm.topology.two_level_plan`).

    1. One rank per node, or one node: a flat ring (:func:`allreduce_s`) at ``wire``.
    2. ``flat`` on nodes of g > 1 ranks (``topology="flat"``): one ring over all n ranks, whose
       slowest hops cross the node's link: ``α + 2(n-1)/n · S/B``; or, ``direct`` (the quantised
       recipe's exchange from 3 ranks on: a direct reduce-scatter and all-gather), each of the node's
       g ranks sends its (n-g)/n share to the other nodes twice: ``α + 2g(n-g)/n · S/B``.
    3. Otherwise two-level on the engine's plan: ``2α_i + intra_bytes/B_i`` inside the node (the
       reduce-scatter and the all-gather, fp32 or the wire dtype), then g concurrent inter-node
       exchanges of one shard each, sharing the node's link: ``α + g · 2(M-1)/M · shard·wire/B``.
    """
    if n <= 1 or numel <= 0:
        return 0.0
    g, m = _levels(n, cfg)
    nbytes = math.ceil(numel * wire)
    if g == 1 or m == 1:
        return allreduce_s(nbytes, n, cfg, "ring", int(wire) if float(wire).is_integer() else 1)
    if flat:
        share = 2.0 * g * (n - g) / n if direct and n >= 3 else 2.0 * (n - 1) / n
        return cfg.latency + share * nbytes / cfg.bandwidth
    iw = wire if intra_wire is None else intra_wire
    assert cfg.intra_bandwidth is not None  # SimConfig requires it with gpus_per_node > 1
    plan = two_level_plan(numel, m, g, block=block)  # the shard in elements; its bytes at each level's wire
    intra = 2 * cfg.intra_latency + 2 * (g - 1) * math.ceil(plan.shard * iw) / cfg.intra_bandwidth
    inter = cfg.latency + g * 2.0 * (m - 1) / m * math.ceil(plan.shard * wire) / cfg.bandwidth
    return intra + inter
