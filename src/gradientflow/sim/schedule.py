"""The event-level model of one training iteration on N GPUs, for one configuration.

Timeline of one GPU (all GPUs are alike, so one stands for all):

  forward ─► backward (gradients become ready one by one) ─► [link busy] ─► local passes ─► update

The fusion schedule is the engine's own: :func:`gradientflow.engine.pool.plan_layout` cuts the pool in
backward order at θ (θ = 0: one bucket per tensor), and CSC's selection size is
:func:`gradientflow.exchange.selection.n_selected` — the model calls them, it does not re-derive them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradientflow.engine.pool import plan_layout
from gradientflow.exchange.selection import n_selected

from .config import CONFIGS, MIB, SimConfig
from .cost import _levels, allreduce_s, exchange_s
from .model_profile import ModelProfile


@dataclass(frozen=True)
class Technique:
    """What one configuration does; each row of :data:`TECHNIQUES` adds one thing to the last."""

    algorithm: str  # "tree" (baseline's allreduce) or "ring"
    overlap: bool  # a bucket may start while backward still runs
    wire_bytes: float  # bytes per gradient on the wire: 4 fp32, 2 fp16, 0.39 quantised (3 bits + scales)
    fused: bool  # θ fusion (lazy allreduce) instead of one collective per tensor
    csc: bool  # coarse-grained sparse communication at cfg.density
    local: str  # the local passes of a dense step: "fp32" (pre-divide, 1 pass) or "fp16" (cast
    # out and back, 3 passes); CSC selecting k < n chunks: see PASSES
    intra_wire_bytes: float | None = None  # bytes per gradient inside a node, two-level (None: wire_bytes)
    block: int = 1  # the engine's two-level shards are whole blocks of this many gradients (the quantiser's)
    direct: bool = False  # flat exchange from 3 ranks is a direct reduce-scatter + all-gather (quantised)
    shard_passes: bool = False  # two-level: the local passes run on this rank's 1/g shard only
    density: float | None = None  # CSC: the recipe's own density (None: cfg.density)
    chunk_codec: bool = (
        False  # top-k: the selected chunks go through the quantiser's codec ("quantized" passes on them)
    )


PASSES = {"fp32": 1, "fp16": 3, "csc": 1, "csc_accumulate": 1, "csc_chunks": 4, "quantized": 20}
"""Elementwise passes over the fp32 pool per kind, when they are costed at cfg.pass_bytes_per_s.
"csc": the score pass; "csc_accumulate": autograd adding each gradient into the residual during
backward (a dense step's autograd keeps each fresh gradient instead: the bench's "alone" column
measures the difference); "csc_chunks": clear, pack, write back, mask — over the selected chunks
only, so scaled by the fraction selected (the engine's write-back touches nothing else);
"quantized": the quantised recipe's codec, quantise and decode every element once plus the
error-feedback add (measured on this project's CPU, one thread, 4M fp32: quantise 60 ms, decode
33 ms, one ``add_`` 4-5 ms, so about 20 passes; ``--profile`` times it on the user's machine)."""

THREE_BIT = Technique(
    "ring",
    True,
    3 / 8 + 2 / 128,
    True,
    False,
    "quantized",
    intra_wire_bytes=4,
    block=128,
    direct=True,
    shard_passes=True,
)
"""``compression="3bit"`` (what ``"auto"`` picks for Adam/AdamW): every gradient every step,
3 bits plus one bf16 scale per 128 (0.39 bytes per gradient), on a ring overlapped with backward
(from 3 ranks a direct reduce-scatter + all-gather, ``comm/quantized_ring.py``).  Two-level
(``strategies/quantized_nodes.py``): fp32 reduce-scatter and all-gather inside the node, the quantised
ring on this rank's shard of whole 128-blocks between nodes, its codec and error feedback on the
shard only."""

TOPK_3BIT = Technique(
    "ring",
    True,
    3 / 8 + 2 / 128,
    True,
    True,
    "fp32",
    intra_wire_bytes=4,
    block=128,
    direct=True,
    density=0.3,
    chunk_codec=True,
)
"""``compression="topk-3bit"`` (what ``"auto"`` picks for SGD): top-k at density 0.3, the packed chunks on the quantised
exchange (3 bits + a bf16 scale per 128; two-level as the quantised recipe's buckets), the codec on them only."""

TECHNIQUES: dict[str, Technique] = {
    "baseline": Technique("tree", False, 4, False, False, "fp32"),
    "ring": Technique("ring", False, 4, False, False, "fp32"),
    "overlap": Technique("ring", True, 4, False, False, "fp32"),
    "fp16": Technique("ring", True, 2, False, False, "fp16"),
    "lazy": Technique("ring", True, 2, True, False, "fp16"),
    # CSC: autograd's accumulation into v and one score pass over the pool; clear/pack/unpack/mask
    # touch only the k selected chunks (the fp16 cast touches only the packed chunks)
    "csc": Technique("ring", True, 2, True, True, "fp16"),
}
assert tuple(TECHNIQUES) == CONFIGS


@dataclass(frozen=True)
class Iteration:
    """The model's answer for one (model, cluster, N, configuration)."""

    gpus: int
    config: str
    iteration_s: float
    compute_s: float  # t(1): one GPU, no communication
    speedup: float  # N · t(1) / t(N), the paper's metric
    bytes_per_gpu: int  # payload one GPU hands to allreduce per step
    collectives: int
    exposed_s: float  # communication not hidden behind backward

    @property
    def efficiency(self) -> float:
        return self.speedup / self.gpus


def compute_times(profile: ModelProfile, cfg: SimConfig) -> tuple[float, float, float]:
    """(forward, backward, update) seconds: measured here, or ``cfg``'s throughput split by FLOPs."""
    if profile.times is not None:
        return profile.times
    t1 = cfg.iteration_compute_s
    return (1 - cfg.backward_fraction) * t1, cfg.backward_fraction * t1, 0.0


def n_chunks(pool_sizes: tuple[int, ...], chunk_size: int) -> int:
    """Chunks of the pool as CSC cuts it: each pool buffer separately, its last chunk short.

    The same arithmetic as ``SparseSync._set_pool`` (csc.py), which keeps it inline in a method;
    it lives here as a pure function rather than as an edit to csc.py.
    """
    return sum(math.ceil(s / chunk_size) for s in pool_sizes)


def _passes_s(profile: ModelProfile, cfg: SimConfig, kind: str) -> float:
    """Seconds of the local passes ``kind`` (see :data:`PASSES`): timed here with ``--profile``,
    else costed at ``cfg.pass_bytes_per_s`` over the fp32 pool."""
    if profile.local_s is not None:
        return profile.local_s[kind]
    return PASSES[kind] * 4 * profile.n_params / cfg.pass_bytes_per_s


def simulate(
    profile: ModelProfile,
    cfg: SimConfig,
    gpus: int,
    config: str,
    technique: Technique | None = None,
    flat: bool = False,
) -> Iteration:
    """One iteration of ``config`` (or of ``technique``, named ``config``) on ``gpus`` GPUs.

    1. Compute: forward, then backward; parameter i's gradient is ready at
       ``forward + ready[i] · backward``.
    2. Layout: ``plan_layout`` in backward order, θ = cfg.theta_mb for fused configurations
       and 0 (one bucket per tensor) otherwise.
    3. Dense: each bucket is ready when its last gradient is (or at the end of backward without
       overlap); the link runs one collective at a time, in bucket order.
    4. CSC with k < n chunks selected: backward is longer by autograd's accumulation into the
       residual; after it, one fp32 score per chunk is allreduced, then the k chunks, packed, in
       fp16.  With k == n there is nothing to choose: every chunk is sent, so CSC is lazy
       allreduce (same buckets, no scores, no residual passes).
    5. Local passes over the pool (casts; CSC's score, and its clear/pack/unpack/mask of the k
       selected chunks) run after the last collective, then the update:
       t(N) = max(backward end, link free) + passes + update.

    With ``cfg.gpus_per_node`` > 1 and more than one node every bucket is synchronised two-level, on
    the engine's plan (:func:`~gradientflow.sim.cost.exchange_s`); CSC's scores travel flat (the
    engine's control group spans every rank), its packed chunks two-level.  ``flat``: the engine's
    ``topology="flat"`` on the same nodes (one ring over every rank, or the quantised recipe's direct
    exchange).
    """
    if technique is None and config not in TECHNIQUES:
        raise ValueError(f"unknown configuration {config!r}; choose one of {list(CONFIGS)}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    tech = technique or TECHNIQUES[config]
    t_fwd, t_bwd, t_upd = compute_times(profile, cfg)
    t1 = t_fwd + t_bwd + t_upd
    if gpus == 1:
        return Iteration(1, config, t1, t1, 1.0, 0, 0, 0.0)
    bwd_end = t_fwd + t_bwd
    theta = cfg.theta_mb * MIB if tech.fused else 0.0
    keys = [(torch.float32, torch.device("cpu"))] * len(profile.numels)
    layout = plan_layout(profile.numels, keys, profile.order, theta)
    sparse = False
    if tech.csc:
        chunks = n_chunks(layout.sizes, cfg.chunk_size)
        k = n_selected(tech.density or cfg.density, chunks)
        sparse = k < chunks
    link_free, sent, count = 0.0, 0.0, 0

    def wire_s(numel: int) -> float:  # the engine's exchange: two-level shards from comm.topology.two_level_plan
        return exchange_s(
            numel,
            gpus,
            cfg,
            tech.wire_bytes,
            intra_wire=tech.intra_wire_bytes,
            block=tech.block,
            flat=flat,
            direct=tech.direct,
        )

    if sparse:
        bwd_end += _passes_s(profile, cfg, "csc_accumulate")
        link_free = bwd_end
        link_free += exchange_s(chunks, gpus, cfg, 4, flat=True)  # the scores, on the flat control group
        link_free += wire_s(k * cfg.chunk_size)
        sent, count = sent + 4 * chunks + tech.wire_bytes * k * cfg.chunk_size, count + 2
    else:
        for b in layout.buckets:
            ready = t_fwd + max(profile.ready[i] for i in b.params) * t_bwd if tech.overlap else bwd_end
            nbytes = math.ceil(b.numel * tech.wire_bytes)
            if tech.algorithm == "ring":
                cost = wire_s(b.numel)
            else:
                cost = allreduce_s(nbytes, gpus, cfg, tech.algorithm, int(tech.wire_bytes))
            link_free = max(link_free, ready) + cost
            sent, count = sent + nbytes, count + 1
    if sparse:
        chunk_s = _passes_s(profile, cfg, "csc_chunks") + (
            _passes_s(profile, cfg, "quantized") if tech.chunk_codec else 0
        )
        passes_s = _passes_s(profile, cfg, "csc") + k / chunks * chunk_s
    else:
        passes_s = _passes_s(profile, cfg, tech.local)
        g, m = _levels(gpus, cfg)
        if tech.shard_passes and not flat and g > 1 and m > 1:
            passes_s /= g  # the codec and error feedback touch this rank's shard only
    comm_end = max(bwd_end, link_free)
    t_n = comm_end + passes_s + t_upd
    return Iteration(gpus, config, t_n, t1, gpus * t1 / t_n, round(sent), count, comm_end - bwd_end)
