"""The bookkeeping of one synchronised backward, read by the reducer and its unused-parameter search.

Its own module so that :mod:`.usage` can name it without importing the reducer (which imports usage).
"""

from __future__ import annotations

from ..diagnostics.stats import StepStats
from .pool import Layout


class Backward:
    """Bookkeeping of one synchronised backward."""

    def __init__(
        self,
        layout: Layout,
        n_params: int,
        dense_bytes: int,
        unbound: bool = False,
        fresh_add: bytearray | None = None,
        shadow: bool = False,
    ) -> None:
        self.remaining = [len(b.params) for b in layout.buckets]
        self.undivided = [0] * len(self.remaining)  # gradients that did not enter through take_fresh
        self.next_bucket = 0
        self.seen = bytearray(n_params)
        self.order: list[int] = []
        self.stats = StepStats(dense_bytes=dense_bytes)
        self.t_start = 0.0  # perf_counter at its start (the trace's span, torch's logging data)
        self.shadow = shadow  # a joined rank's zero step: no gradient is expected from it
        self.unbound = unbound  # it started from None gradients: each gradient is copied in at its hook
        self.fresh_add = fresh_add  # unbound: 1 where the gradient is added into a strategy's target (CSC's residual)
        # False between autograd runs while the step is open: a backward left parameters without gradient
        # and another backward of the same forward may bring them (torch's reducer waits for them too)
        self.queued = True
        self.closing = False  # raise_pending closes an open step: finish it whatever is missing
