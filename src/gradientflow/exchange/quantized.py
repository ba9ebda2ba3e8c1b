"""The quantised exchange (the ``"3bit"`` family's), one object for every door: :class:`QuantizedExchange`.

Its state between calls is the quantiser that runs (``options_base.Quantizer``), the count of exchanges (the
first ``warmup_steps`` run the default 3-bit quantiser) and the preconditioner around the ring (``-precond``: the
ring sees ``(x + e) / r``, its result and error are multiplied back after, ``q``'s moving average updated from the
result); the wire is :mod:`.ring`'s, so a failure is named through the watchdog.  The residual ``e`` and ``q``
are the door's tensors (allocated by :mod:`.error_feedback`, laid out where the door's values live: the DDP
pool's buckets, an FSDP module's shard, an outer fragment), handed to :meth:`QuantizedExchange.start`.

Per exchange: :meth:`QuantizedExchange.start` posts the ring of ``x`` (the contribution, fp32) with ``e`` carried (added
to it first); the returned :class:`~.ring.Ring` is advanced (:meth:`~.ring.Ring.poll`, never blocking) or waited
for (:meth:`~.ring.Ring.wait`), then :meth:`~.ring.Ring.complete` undoes the preconditioner; ``x`` holds the
decoded sum, ``e`` what this rank's quantisation lost.  :meth:`QuantizedExchange.advance` counts one exchange (a door's
step: the DDP recipe counts its steps, not its buckets).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import codec_native
from ..diagnostics.watchdog import Watchdog
from ..option_values import DEFAULT_QUANT
from ..options_base import Quantizer
from .precondition import Root, ema_update
from .ring import Ring, start_ring


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


class QuantizedExchange:
    """The quantised exchange over ``group`` (its ranks are the parties: DDP's ranks, FSDP's or the outer loop's
    nodes): the quantiser, the exchanges counted for the warm-up, failures named by ``watchdog``."""

    def __init__(self, quantizer: Quantizer, group: dist.ProcessGroup, watchdog: Watchdog | None) -> None:
        self.quantizer, self.group, self.watchdog = quantizer, group, watchdog
        self.parties = dist.get_world_size(group)
        self.step = 0

    def widths(self) -> tuple[int, str]:
        """This exchange's bits and levels: the default quantiser's during the warm-up."""
        q = self.quantizer
        return step_quantizer(self.step, q.warmup_steps, q.bits, q.levels)

    @property
    def preconditions(self) -> bool:
        """Whether this exchange divides by the preconditioner's ``r`` (its recipe preconditions, past the warm-up)."""
        return self.quantizer.precondition and self.step >= self.quantizer.warmup_steps

    def start(
        self, x: torch.Tensor, err: torch.Tensor, what: str, sq: torch.Tensor | None = None, carry: bool = True
    ) -> Ring:
        """Post the exchange of ``x`` (this rank's fp32 contribution) with the residual ``err`` carried (added to it
        first); ``sq``: the preconditioner's ``q`` for these coordinates where the recipe preconditions (``None``
        otherwise).  ``carry=False``: ``err`` only receives this exchange's error (the top-k recipes' rows, whose
        residual is kept in the chunks' own rows)."""
        q = self.quantizer
        bits, levels = self.widths()
        root, fused = None, None  # carry: x + e, the ring adds e (two parties: inside the quantisation's pass)
        if sq is not None and self.preconditions:
            root, fused, carry = precondition(x, err, sq, self.parties == 2)
        ring = start_ring(
            x,
            err,
            self.group,
            bits=bits,
            block=q.block,
            watchdog=self.watchdog,
            what=what,
            clip=q.clip,
            levels=levels,
            carry=carry,
            fused=fused,
        )
        ring.then = lambda: after_ring(x, err, root, fused, sq)
        return ring

    def advance(self) -> None:
        """One exchange (a door's step) done: the warm-up's count."""
        self.step += 1
