"""How many bits ``compression="auto"`` sends an Adam-type optimizer's gradients with: 3 or 2 (``"2bit-precond"``).

Both keep AdamW's quality at 2 ranks (docs/results/adamw.md: 3 bits 1.006-1.013x DDP's final loss on the matrix,
``"2bit-precond"`` 1.007-1.020x); 2 bits send 0.068 of DDP's bytes against 0.098, but their codec (the
preconditioner's work, the window floors) costs more per gradient.  Which reaches DDP's loss sooner is which
costs less per step: the bytes they save count only where the 3-bit step waited on them.  On this project's CPU
ranks 3 bits were sooner at 1 Gbit/s and at 500 Mbit/s, 2 bits at 200 Mbit/s (docs/results/adamw.md).  ``"auto"`` runs
``"2bit-precond"``, whose first :data:`WARMUP` steps send the 3-bit codes, and decides at their end, once:

* the wire: the 2-bit codes save :func:`saved_bytes` per gradient, ``saved / link_Bps`` seconds on the link
  (``link_Bps``: the bytes per second allreduce moved, :func:`gradientflow.engine.schedule.measure`);
* the step: of that, at most what the 3-bit steps left exposed (the end of backward waiting on communication,
  their lower quartile, leaving out the first :data:`SETTLE`), per gradient: bytes sent while backward still runs cost
  nothing;
* the codec: :func:`extra_seconds`, one rank's 2-bit exchange of a sample of the gradient (preconditioner,
  encode, decode and add, multiply back) less its 3-bit one, per gradient, on the model's device;

and 2 bits go on where the saving is larger (:func:`fewer_bits_pay`).  Only for two-party exchanges (2 ranks,
flat): from 3 ranks each segment's sum is requantised, and at 2 nodes x 2 three of the matrix's seven settings
ended above 1.02x (docs/results/adamw.md), so those keep 3 bits whatever the link (preconditioned beyond two parties:
``policy.auto_choice.MANY_PARTIES_ADAM``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from ..comm import codec_native
from ..comm import quantize as qz
from ..comm.quantized_ring import encode_share, sum_shares
from ..config import GradientFlowConfig
from ..exchange import error_feedback
from ..exchange.precondition import Root
from ..option_values import DEFAULT_QUANT

FEWER_BITS = "2bit-precond"
"""The 2-bit recipe ``"auto"`` may pick (docs/recipes.md#2bit-precond)."""
_TWO = GradientFlowConfig(compression=FEWER_BITS).quantizer()  # timed and counted as the recipe runs it
TWO_BITS, TWO_BLOCK, TWO_LEVELS = _TWO.bits, _TWO.block, _TWO.levels
WARMUP = _TWO.warmup_steps
"""Steps ``"2bit-precond"`` sends at 3 bits first (the run's, step 0 included): the decision is made at their end."""
SETTLE = 3
"""Steps left out of the exposure's quartile, the first a process runs in the warm-up: the first quantised steps
allocate the residual and buffers (and a resumed run's first forward has no step of its own behind it)."""
SAMPLE = 1 << 22
"""Gradients the codec is timed on (the model's own count where it has fewer): 16 MB a tensor, past the caches as
the quantised recipe's 8 MB buckets are.  On this project's CPU the extra cost per gradient was 1.6-2.0 ns timed on
0.25-1M gradients and 2.5 ns on 4M, as in the training step (2.6 ns, docs/results/adamw.md): a sample that fits the
caches flatters the slower codec.  (Since the preconditioner runs inside the exchange's passes: 1.4-1.8 ns on 4M.)"""
REPEATS = 5


def saved_bytes() -> float:
    """Wire bytes per gradient :data:`FEWER_BITS` saves over 3 bits (codes only: the scales are the same): 0.125."""
    n = 1024 * TWO_BLOCK
    return (qz.wire_bytes(n, DEFAULT_QUANT[0], DEFAULT_QUANT[1]) - qz.wire_bytes(n, TWO_BITS, TWO_BLOCK)) / n


def fewer_bits_pay(link_Bps: float, extra_s: float, exposed_s: float = math.inf) -> bool:
    """The rule: 2 bits where the time their smaller codes save exceeds their codec's extra time, all per gradient.
    The saving is the wire time of :func:`saved_bytes` on the link, at most ``exposed_s``: what the 3-bit step
    left exposed (infinite: not measured, the whole wire time counts).  Pure: the same measurements give the
    same answer on every rank."""
    if not link_Bps > 0:
        raise ValueError(f"link_Bps must be > 0, got {link_Bps}")
    if not exposed_s >= 0:
        raise ValueError(f"exposed_s must be >= 0, got {exposed_s}")
    return min(saved_bytes() / link_Bps, exposed_s) > extra_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def extra_seconds(device: torch.device, n: int = SAMPLE) -> float:
    """Seconds per gradient the 2-bit exchange's codec costs one rank over the 3-bit one (0 if it is not
    slower), the best of :data:`REPEATS` each: what a rank does around its two-party exchange, timed on
    ``n`` gradients of a fixed random sample on ``device`` (no collective)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(n, generator=gen).to(device)
    bits, block = DEFAULT_QUANT
    # each width's wire exactly (the torch ops, as on CUDA, take the scales from the bytes after the codes)
    wires = {
        b: torch.empty(qz.wire_bytes(n, b, blk), dtype=torch.uint8, device=device)
        for b, blk in [(bits, block), (TWO_BITS, TWO_BLOCK)]
    }
    x, e, q = torch.empty_like(g), error_feedback.zeros_like(g), g * g

    def exchange(b: int, blk: int, levels: str, carry: bool, fused: codec_native.Fused | None = None) -> None:
        """comm/quantized_ring.py's exchange, the peer's bytes standing in for ours."""
        wire = wires[b]
        own_in_x = encode_share(x, e, wire, b, blk, levels=levels, carry=carry, fused=fused)
        sum_shares(x, e, wire, wire, b, blk, levels=levels, own_in_x=own_in_x, fused=fused)

    def three() -> None:
        x.copy_(g)
        exchange(bits, block, "fitted", carry=True)

    def two() -> None:  # as strategies/quantized.py runs a two-rank exchange
        x.copy_(g)
        root = Root(q)  # FEWER_BITS preconditions (its "p")
        fused = root.fused(x, e)  # on CPU: inside the codec's passes
        if fused is None:
            root.divide(x, e)  # x = (x + e) / r: the exchange adds nothing more
        exchange(TWO_BITS, TWO_BLOCK, TWO_LEVELS, carry=fused is not None, fused=fused)
        if fused is None:
            root.restore(x, e, ema=True)

    def best(f: Callable[[], None]) -> float:
        f()  # first use: the kernel's load, CUDA's allocations
        times = []
        for _ in range(REPEATS):
            _sync(device)
            t0 = time.perf_counter()
            f()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    return max(best(two) - best(three), 0.0) / n
