"""The quantised recipe's preconditioner (``compression="q...p"``): the divisor ``r`` of each coordinate.

Every coordinate is divided by ``r = sqrt(q)`` before the quantised ring and multiplied back after, ``q`` an EMA
of the squared synchronised result (bit-identical on every rank, so ranks agree on ``r`` without a byte).
``strategies/quantized.py`` keeps ``q``; this module only says what ``r`` is for a given ``q``.
"""

from __future__ import annotations

import torch

PRECONDITION_BETA = 0.9
"""EMA of the squared result behind ``precondition``'s ``r``: 0.9 ended closer to DDP's loss than 0.99 (which
lags the gradient's scale) and than 0.7 or 0.5 (r as noisy as one step's gradient), on the bench's
transformer with 2 bits (experiments/quant_sim.py, docs/adamw.md)."""
PRECONDITION_FLOOR = 1e-6
"""``q`` is clamped at this fraction of its bucket's mean before the root: a coordinate that never had a
gradient (q = 0) would otherwise divide by 0."""
PRECONDITION_WINDOW = 128
PRECONDITION_WINDOW_FLOOR = 1e-2
"""...and at this fraction of the mean of its window of :data:`PRECONDITION_WINDOW` coordinates: ``r`` at least a
tenth of the window's RMS.  The warm-up's levels have a zero, so a small coordinate can decode to 0 for every
warm-up step (q = 0) while its error feedback grows; with the bucket's floor alone its ``x / r`` then set its
whole block's scale at the first preconditioned step (SGD on the digits CNN diverged there: docs/adamw.md)."""


def precondition_root(q: torch.Tensor) -> torch.Tensor:
    """``r = sqrt(max(q, floor x mean q, window floor x its window's mean q))``; 1 everywhere while ``q`` is
    all zero (no history yet).  Tensor ops, no host read; the same floats on every rank for the same ``q``."""
    mean = q.mean()
    n = q.numel()
    whole = n - n % PRECONDITION_WINDOW
    r = torch.empty_like(q)
    if whole:  # each window's mean, broadcast over its coordinates, in one pass
        head = q[:whole].view(-1, PRECONDITION_WINDOW)
        floor = head.mean(1, keepdim=True).mul_(PRECONDITION_WINDOW_FLOOR)
        torch.maximum(head, floor, out=r[:whole].view(-1, PRECONDITION_WINDOW))
    if whole < n:  # the short last window
        tail = q[whole:]
        torch.maximum(tail, tail.mean().mul(PRECONDITION_WINDOW_FLOOR), out=r[whole:])
    torch.maximum(r, mean * PRECONDITION_FLOOR, out=r).sqrt_()
    # not torch.where(mean > 0, r, 1): with a 0-dim condition it is many times slower (docs/benchmarks.md)
    return r.masked_fill_(mean <= 0, 1.0)
