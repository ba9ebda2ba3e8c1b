"""CSC's choice of what to send: per-chunk scores and the top-k of them, as pure functions.

Every function here is deterministic and depends on its arguments only, so ranks that hold the
same (allreduced) scores pick the same chunks without exchanging indices.
"""

from __future__ import annotations

import math

import torch

# Rows of a CPU score pass handled per step: ~1M floats (4 MB) stay in cache between the abs and
# the sum, faster than ``vector_norm(ord=1, dim=1)`` and than ``abs().sum(1)`` (a pool-sized temporary);
# measured: docs/results/benchmarks.md#figures-behind-the-codes-comments.
_CPU_BLOCK_ELEMENTS = 1 << 20


def density_at(step: int, density: float, warmup_steps: int) -> float:
    """The density of synchronised step ``step``: an exponential ramp from 1 (dense) to ``density``.

    ``density ** (step / warmup_steps)`` for ``step < warmup_steps``, then ``density``: step 0 is
    dense, and the fraction sent shrinks by a constant factor per step, as DGC's warm-up shrinks
    it per epoch, without knowing how long training runs.  A pure function of the step counter,
    which every rank advances together, so every rank sends the same number of chunks.
    """
    if step >= warmup_steps:
        return density
    return density ** (step / warmup_steps)


def dense_from(chunk_size: int, wire_itemsize: int, score_itemsize: int = 4) -> float:
    """The density from which a step is sent dense: its chunks plus scores would not be fewer bytes.

    A sparse step hands over one score per chunk and the selected chunks; per chunk of the pool
    that is ``score_itemsize + density * chunk_size * wire_itemsize`` bytes against a dense
    step's ``chunk_size * wire_itemsize``.  At or above ``1 - score_itemsize / (chunk_size *
    wire_itemsize)`` the dense step is no more bytes, and it skips the score pass, the selection
    and the packing.  Only the first steps of a ramp with small chunks get there (fp16, 16-element
    chunks: density >= 0.875; the paper's 32768: >= 0.99994).
    """
    return 1.0 - score_itemsize / (chunk_size * wire_itemsize)


def n_selected(density: float, n_chunks: int) -> int:
    """``ceil(density * n_chunks)``, at least 1; the product is rounded first so 0.1*30 gives 3."""
    if n_chunks == 0:
        return 0
    return min(n_chunks, max(1, math.ceil(round(density * n_chunks, 9))))


SAMPLE_PERIOD = 128
"""``sampled_l1`` scores the first :data:`SAMPLE_RUN` elements of every ``SAMPLE_PERIOD``."""
SAMPLE_RUN = 16
"""16 fp32 = one 64-byte cache line: the pass reads 1/8 of the chunk's lines, not all of them."""
MIN_SAMPLED_CHUNK = 1024
"""Smaller chunks are scored exactly under ``sampled_l1``: 128 samples would be too few to rank
them, and their models are small enough that the exact pass costs little."""


def samples_chunks(method: str, chunk_size: int) -> bool:
    """Whether ``method`` scores chunks of ``chunk_size`` from a sample (else exactly)."""
    return method == "sampled_l1" and chunk_size >= MIN_SAMPLED_CHUNK and chunk_size % SAMPLE_PERIOD == 0


def score_scratch(chunk_size: int, dtype: torch.dtype = torch.float32, sampled: bool = False) -> torch.Tensor:
    """The CPU scratch :func:`chunk_scores` works in (keep one to avoid an allocation per call)."""
    width = chunk_size // SAMPLE_PERIOD * SAMPLE_RUN if sampled else chunk_size
    return torch.empty(max(1, _CPU_BLOCK_ELEMENTS // width), width, dtype=dtype)


def chunk_scores(
    rows: torch.Tensor, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None, sampled: bool = False
) -> torch.Tensor:
    """L1 norm of each row of ``rows`` ([n_chunks, chunk_size]): the paper's chunk score.

    ``sampled=True`` (``chunk_score="sampled_l1"``, see :func:`samples_chunks`): 8 times the L1
    of the first 16 elements of every 128, an estimate of the L1 that reads 1/8 of the pool.  On
    ResNet-50 and AlexNet residuals the top 10% it picks carry >= 98.9% of the L1 mass the exact
    top 10% carry (README); what it misses stays in the residual, as every unsent chunk does.

    On CPU the rows are scored in cache-sized blocks (abs into a small scratch, then a row sum):
    2.6x faster than one ``vector_norm`` call and the same value up to summation order.  On an
    accelerator one fused ``vector_norm`` kernel is the fast path.
    """
    n, c = rows.shape
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=rows.device)
    if n == 0:
        return out
    if sampled:
        rows = rows.view(n, c // SAMPLE_PERIOD, SAMPLE_PERIOD)[:, :, :SAMPLE_RUN]
    if rows.device.type != "cpu":
        fused_scores(rows, out, dims=(1, 2) if sampled else 1)
    else:
        width = rows[0].numel()
        if scratch is None or scratch.dtype != rows.dtype or scratch.shape[1] != width:
            scratch = score_scratch(c, rows.dtype, sampled)
        block = scratch.shape[0]
        for lo in range(0, n, block):
            part = rows[lo : lo + block]
            tmp = scratch[: part.shape[0]]
            torch.abs(part, out=tmp.view(part.shape))
            torch.sum(tmp, dim=1, out=out[lo : lo + part.shape[0]])
    if sampled:
        out.mul_(SAMPLE_PERIOD / SAMPLE_RUN)
    return out


def fused_scores(rows: torch.Tensor, out: torch.Tensor, dims: int | tuple[int, ...] = 1) -> torch.Tensor:
    """The accelerator's score pass: one ``vector_norm(ord=1)`` kernel writing fp32 ``out``.

    ``out=`` must have the result's dtype, so fp16/bf16 rows are reduced in fp32 (``dtype=``, which
    also keeps a 32768-element sum from overflowing fp16) and fp64 rows reduce in fp64 and are
    copied into ``out`` (a per-chunk vector, tiny next to the rows).
    """
    if rows.dtype == out.dtype:
        return torch.linalg.vector_norm(rows, ord=1, dim=dims, out=out)
    if rows.dtype.itemsize < out.dtype.itemsize:
        return torch.linalg.vector_norm(rows, ord=1, dim=dims, dtype=out.dtype, out=out)
    return out.copy_(torch.linalg.vector_norm(rows, ord=1, dim=dims))


def select_chunks(scores: torch.Tensor, k: int, forced: int = 0) -> torch.Tensor:
    """Indices (ascending) of the ``k`` highest scores; equal scores go to the lower index.

    The last ``forced`` entries are always among them (chunks sent every step, e.g. those of
    1-D parameters); ``scores`` itself is left as it is.  A stable descending sort keeps equal
    scores in index order, so the result is a pure function of the score values: identical on
    ranks holding identical scores.
    """
    if forced:
        scores = scores.clone()
        scores[-forced:] = float("inf")
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values
