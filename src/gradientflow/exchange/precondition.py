"""The quantised recipe's preconditioner (``compression="q...p"``): the divisor ``r`` of each coordinate.

Every coordinate is divided by ``r = sqrt(q)`` before the quantised ring and multiplied back after, ``q`` an EMA
of the squared synchronised result (bit-identical on every rank, so ranks agree on ``r`` without a byte).
``strategies/quantized.py`` keeps ``q``; this module says what ``r`` is for a given ``q`` and applies it
(:class:`Root`: on CPU tensors through ``comm/codec.c``'s two fused passes, bit-identical to the torch ops).
"""

from __future__ import annotations

import torch

from ..comm import codec_native

PRECONDITION_BETA = 0.9
"""EMA of the squared result behind ``precondition``'s ``r``: 0.9 ended closer to DDP's loss than 0.99 (which
lags the gradient's scale) and than 0.7 or 0.5 (r as noisy as one step's gradient), on the bench's
transformer with 2 bits (experiments/quant_sim.py, docs/results/adamw.md)."""
PRECONDITION_FLOOR = 1e-6
"""``q`` is clamped at this fraction of its bucket's mean before the root: a coordinate that never had a
gradient (q = 0) would otherwise divide by 0."""
PRECONDITION_WINDOW = 128
PRECONDITION_WINDOW_FLOOR = 1e-2
"""...and at this fraction of the mean of its window of :data:`PRECONDITION_WINDOW` coordinates: ``r`` at least a
tenth of the window's RMS.  The warm-up's levels have a zero, so a small coordinate can decode to 0 for every
warm-up step (q = 0) while its error feedback grows; with the bucket's floor alone its ``x / r`` then set its
whole block's scale at the first preconditioned step (SGD on the digits CNN diverged there: docs/results/adamw.md)."""


def _floors(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``'s floors: one per window (the last may be short) and the bucket's, and ``q``'s mean."""
    mean = q.mean()
    n = q.numel()
    whole = n - n % PRECONDITION_WINDOW
    wf = torch.empty(-(-n // PRECONDITION_WINDOW), dtype=q.dtype, device=q.device)
    if whole:  # each window's mean, in one pass
        torch.mean(q[:whole].view(-1, PRECONDITION_WINDOW), 1, out=wf[: whole // PRECONDITION_WINDOW])
    if whole < n:  # the short last window
        wf[-1:].copy_(q[whole:].mean())
    return wf.mul_(PRECONDITION_WINDOW_FLOOR), mean * PRECONDITION_FLOOR, mean


def precondition_root(q: torch.Tensor) -> torch.Tensor:
    """``r = sqrt(max(q, floor x mean q, window floor x its window's mean q))``; 1 everywhere while ``q`` is
    all zero (no history yet).  Tensor ops, no host read; the same floats on every rank for the same ``q``."""
    wf, bf, mean = _floors(q)
    n = q.numel()
    whole = n - n % PRECONDITION_WINDOW
    r = torch.empty_like(q)
    if whole:  # each window's floor broadcast over its coordinates
        k = whole // PRECONDITION_WINDOW
        torch.maximum(q[:whole].view(k, -1), wf[:k, None], out=r[:whole].view(k, -1))
    if whole < n:
        torch.maximum(q[whole:], wf[-1], out=r[whole:])
    torch.maximum(r, bf, out=r)
    if r.device.type == "cpu":  # correctly rounded, as codec.c's sqrtf: torch's AVX-512 sqrt is not (1 ulp off on
        r.copy_(r.double().sqrt_())  # ~0.7% of the bench's q), and ranks with and without the kernel must agree
    else:
        r.sqrt_()  # IEEE sqrt on CUDA
    # not torch.where(mean > 0, r, 1): with a 0-dim condition it is many times slower (docs/results/benchmarks.md)
    return r.masked_fill_(mean <= 0, 1.0)


def ema_update(q: torch.Tensor, result: torch.Tensor) -> None:
    """``q <- beta q + (1 - beta) result²`` (:data:`PRECONDITION_BETA`), in place."""
    q.mul_(PRECONDITION_BETA).addcmul_(result, result, value=1 - PRECONDITION_BETA)


class Root:
    """One bucket's ``r`` for one step, from its ``q`` (the bucket's view, unchanged until :meth:`restore`).

    On CPU tensors with the codec's kernel only the floors are computed here (two torch passes, so their
    means keep torch's summation order); ``r`` is recomputed inside the two fused passes that use it,
    bit-identical to :func:`precondition_root` and the torch ops (tests/test_codec.py): 11 passes over the
    bucket become 4, and 2 where the codec's own passes take them (:meth:`fused`).  Elsewhere (CUDA: a kernel
    per op, no host read) ``r`` is materialised."""

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q
        self.r: torch.Tensor | None = None
        if codec_native.applies(q):
            self.wf, bf, mean = _floors(q)
            self.bf, self.unit = float(bf), bool(mean <= 0)  # CPU scalars: no device sync
        else:
            self.r = precondition_root(q)

    def _fused(self, *ts: torch.Tensor) -> bool:
        return self.r is None and all(t.dtype == torch.float32 for t in ts) and codec_native.applies(*ts)

    def fused(self, x: torch.Tensor, e: torch.Tensor, lo: int = 0) -> codec_native.Fused | None:
        """The kernel's arguments to fold :meth:`divide` and :meth:`restore` (with the EMA) into the codec's own
        passes over ``x`` (the bucket's coordinates ``lo ..``): two passes over the bucket fewer, the same floats
        (tests/test_codec.py); None where the kernel does not take these tensors (divide and restore then)."""
        if not self._fused(x, e):
            return None
        q = self.q[lo : lo + x.numel()]
        beta = (PRECONDITION_BETA, 1 - PRECONDITION_BETA)
        return codec_native.Fused(q, self.wf, self.bf, self.unit, lo, PRECONDITION_WINDOW, beta)

    def divide(self, x: torch.Tensor, e: torch.Tensor, lo: int = 0) -> None:
        """``x = (x + e) / r`` for the bucket's coordinates ``lo .. lo + x.numel()``."""
        q = self.q[lo : lo + x.numel()]
        if self._fused(x, e):
            codec_native.precondition_in(x, e, q, self.wf, self.bf, self.unit, lo, PRECONDITION_WINDOW)
        else:
            x.add_(e).div_(self._root(lo, x.numel()))

    def restore(self, x: torch.Tensor, e: torch.Tensor, lo: int = 0, ema: bool = False) -> None:
        """``x *= r``, ``e *= r`` (back from the ring's units) for coordinates ``lo ..``; ``ema``: then
        :func:`ema_update` of ``q`` with the restored ``x`` (in the same pass on CPU)."""
        q = self.q[lo : lo + x.numel()]
        if self._fused(x, e):
            beta = (PRECONDITION_BETA, 1 - PRECONDITION_BETA) if ema else None
            codec_native.precondition_out(x, e, q, self.wf, self.bf, self.unit, lo, PRECONDITION_WINDOW, beta)
            return
        r = self._root(lo, x.numel())
        x.mul_(r)
        e.mul_(r)
        if ema:
            ema_update(q, x)

    def _root(self, lo: int, n: int) -> torch.Tensor:
        if self.r is None:  # the kernel path asked for tensors it does not take (not fp32, not contiguous)
            self.r = precondition_root(self.q)
        return self.r[lo : lo + n]
