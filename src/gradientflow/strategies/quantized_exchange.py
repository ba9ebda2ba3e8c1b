"""The quantised exchange's plumbing, with one owner: every recipe that quantises goes through it.

The ``"3bit"`` family sends each bucket of the pool (:mod:`.quantized`), ``"topk-3bit"`` the packed rows of the
chunks it selected (:mod:`.csc_quantized`); both put their values on the same wire: a
:class:`~gradientflow.comm.quantized_ring.QuantizedRing` over the flat group, or, on nodes of several ranks, the
two-level pipeline whose middle stage is that ring between nodes (:class:`~.quantized_nodes.NodeQuantizer`).
What they share is here, so that a failure reads the same and the bytes are counted the same whichever sends:

- :func:`guarded`: a step of the exchange, its ``RuntimeError`` (a peer gone, a timeout) turned into the
  watchdog's failure naming what was being exchanged;
- :func:`run_ring`: a ring advanced without blocking, or run to its end;
- :func:`start_two_level`: a contribution into the two-level pipeline, its bytes between and inside the nodes
  counted in the step's stats, its result handed back once the pipeline delivers it;
- :func:`step_quantizer`, :func:`precondition` and :func:`after_ring`: the width of a warm-up step, and the
  preconditioner around a flat ring (``-precond``: the ring sees ``(x + e) / r``, its result and error are
  multiplied back after), also used by FSDP's exchange of a shard (:mod:`gradientflow.fsdp.exchange`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..comm import codec_native
from ..comm.quantized_ring import QuantizedRing
from ..config import DEFAULT_QUANT
from ..diagnostics.stats import StepStats
from ..diagnostics.watchdog import Watchdog
from .precondition import Root, ema_update
from .quantized_nodes import NodeQuantizer

TWO_LEVEL = "two-level quantised exchange"
"""What a failure of the two-level pipeline names."""
RINGS = "CSC chunks (quantised exchange)"
"""What a failure of ``"topk-3bit"``'s flat rings names."""


def guarded(watchdog: Watchdog | None, what: str, step: Callable[[], object], started: float | None = None) -> None:
    """Run ``step``; a ``RuntimeError`` becomes the watchdog's failure naming ``what`` (and the seconds since
    ``started``); without a watchdog it propagates as it is."""
    try:
        step()
    except RuntimeError as exc:
        if watchdog is None:
            raise
        elapsed = time.perf_counter() - started if started is not None else 0.0
        raise watchdog.failure(what, None, exc, elapsed) from exc


def run_ring(ring: QuantizedRing, watchdog: Watchdog | None, what: str, started: float, block: bool) -> bool:
    """Advance ``ring`` as far as its messages allow (``block``: to its end); whether it is done.  A failure
    names ``what``, the ring's bytes and the seconds since it ``started``."""
    try:
        if block:
            ring.wait()
            return True
        return ring.poll()
    except RuntimeError as exc:
        if watchdog is None:
            raise
        raise watchdog.failure(what, ring.payload_bytes, exc, time.perf_counter() - started) from exc


def start_two_level(
    nodes: NodeQuantizer,
    x: torch.Tensor,
    err: torch.Tensor,
    root: Root | None,
    ring_args: dict[str, Any],
    stats: StepStats,
    what: str,
    on_result: Callable[[torch.Tensor], None],
) -> None:
    """``x`` (this rank's fp32 contribution) into the two-level pipeline, the ring between nodes carrying its
    error in ``err`` (this rank's shard); ``on_result(average)`` once the node's all-gather delivered it.
    ``payload_bytes`` is the quantised shard this rank hands to the exchange between nodes; the stats'
    ``inter_node_bytes`` what the ring sent, ``intra_node_bytes`` the stages inside the node."""

    def done(result: torch.Tensor, sent: int) -> None:
        stats.record_done(time.perf_counter())
        stats.extra["inter_node_bytes"] = stats.extra.get("inter_node_bytes", 0) + sent
        on_result(result)

    intra, payload = nodes.start(x, err, root, ring_args, done, what)
    stats.record_collective(payload)
    stats.extra["intra_node_bytes"] = stats.extra.get("intra_node_bytes", 0) + intra


def step_quantizer(step: int, warmup_steps: int, bits: int, levels: str) -> tuple[int, str]:
    """The bits and levels of exchange ``step``: the default 3-bit quantiser's for the first ``warmup_steps``."""
    return (DEFAULT_QUANT[0], "fitted") if step < warmup_steps else (bits, levels)


def precondition(
    x: torch.Tensor, err: torch.Tensor, q: torch.Tensor, two_parties: bool
) -> tuple[Root, codec_native.Fused | None, bool]:
    """Before a flat ring: ``x`` and ``err`` in units of ``r = sqrt(q)`` per coordinate.  Two parties: inside the
    codec's own passes where the CPU kernel can (``fused``), else a pass of its own, after which the ring must not
    add ``err`` again.  Returns the divisor, the fused passes (or ``None``) and the ring's ``carry``."""
    root = Root(q)
    fused = root.fused(x, err) if two_parties else None
    if fused is None:
        root.divide(x, err)
    return root, fused, fused is not None


def after_ring(
    x: torch.Tensor, err: torch.Tensor, root: Root | None, fused: codec_native.Fused | None, q: torch.Tensor | None
) -> None:
    """After a flat ring: back from ``x / r`` (the result and the error, then ``q``'s moving average; fused: the
    ring did it), or, in the warm-up before ``r`` is used, ``q``'s history started from the result."""
    if root is not None:
        if fused is None:
            root.restore(x, err, ema=True)
    elif q is not None:
        ema_update(q, x)
