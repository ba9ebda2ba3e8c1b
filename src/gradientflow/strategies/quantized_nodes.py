"""The quantised recipe on nodes of several ranks: the quantised ring between nodes only.

Per bucket (:mod:`gradientflow.comm.two_level` runs the stages, in bucket order, without blocking):

1. the contribution ``g / N`` (fp32, divided once by the world size), padded to ``G`` shards of whole
   quantisation blocks (:func:`~gradientflow.comm.topology.two_level_plan`), is reduce-scattered inside
   the node in fp32: local rank j holds the node's sum of shard j;
2. the shard plus this rank's residual there (error feedback on the node-reduced shard) goes round the
   :class:`~gradientflow.comm.quantized_ring.QuantizedRing` among the M ranks with local index j (one per
   node); the decoded node-sum of sums lands in the shard, the quantisation error in the residual;
3. the decoded shards are all-gathered inside the node: every rank of every node decodes the same
   bytes, so all ranks hold identical results.

The residual is only ever non-zero on this rank's shard (1/G of the bucket), so the error sources are
the M node sums, not the N ranks.  It is kept in the pool's layout (the checkpoint keeps its format);
the elements outside the shard stay zero (after the pool's re-layout the residual lands on other
shards: ``QuantizedSync`` then adds all of it to the next contribution, before the reduce-scatter).
Conservation as flat: ``sum over ranks of e + result == sum of the ranks' g / N`` elementwise, up to
fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm.quantize import wire_bytes
from ..comm.quantized_ring import QuantizedRing
from ..comm.topology import two_level_plan
from ..comm.two_level import Item, NodeGroups, TwoLevelPipeline
from ..engine.pool import Scratch


@dataclass
class _ShardItem(Item):
    """A bucket with what its ring needs: the residual slice, this shard's real length ``m`` at offset ``a``,
    the preconditioner's divisor there, the quantiser's arguments; ``sent``: the ring's bytes."""

    err: torch.Tensor | None = None
    m: int = 0
    a: int = 0
    r: torch.Tensor | None = None
    ring_args: dict[str, Any] = field(default_factory=dict)
    sent: int = 0


class ShardRing:
    """One bucket's exchange between nodes: the quantised ring on the shard, then the residual and the
    preconditioner's scaling put back (once, when the ring completes)."""

    def __init__(self, ring: QuantizedRing, after: Callable[[], None]) -> None:
        self.ring, self._after, self._finished = ring, after, False

    def poll(self) -> bool:
        if self.ring.poll():
            self._finish()
            return True
        return False

    def wait(self) -> None:
        self.ring.wait()
        self._finish()

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._after()


class NodeQuantizer:
    """The two-level pipeline of :class:`~gradientflow.strategies.quantized.QuantizedSync` (see the module
    docstring).  ``start(x, err, r, ring_args, done)``: ``x`` the bucket's fp32 contribution (divided),
    ``err`` its residual slice, ``r`` the preconditioner's divisor (or ``None``)."""

    def __init__(self, groups: NodeGroups, block: int) -> None:
        self.groups, self.block = groups, block
        # From 3 nodes a ring posts its second round as the first arrives: one ring at a time keeps the
        # posting order the same on every rank (as the flat recipe from 3 ranks).
        self.pipeline = TwoLevelPipeline(groups, self._start_ring, serial=groups.topology.nodes > 2)
        self.scratch: Scratch | None = None

    def start(
        self,
        x: torch.Tensor,
        err: torch.Tensor,
        r: torch.Tensor | None,
        ring_args: dict[str, Any],
        done: Callable[[torch.Tensor, int], None],
    ) -> tuple[int, int]:
        """Stage 1 of one bucket now; ``done(result, sent_bytes)`` once its decoded average is in hand.
        Returns the bytes this rank sends inside its node for it, and its shard's quantised bytes."""
        topo = self.groups.topology
        n = x.numel()
        plan = two_level_plan(n, topo.nodes, topo.per_node, self.block)
        if self.scratch is None:
            self.scratch = Scratch(x.device)
        full = x
        if plan.padded != n:
            full = self.scratch.take(plan.padded, torch.float32)
            full[:n].copy_(x)
            full[n:].zero_()
        shard = self.scratch.take(plan.shard, torch.float32)
        a, b = plan.bounds[self.groups.local]
        m = max(0, min(b, n) - a)  # this shard's elements that are real (the rest is padding)
        item = _ShardItem(
            full,
            shard,
            "quantised shard",
            lambda it: done(it.full[:n], it.sent if isinstance(it, _ShardItem) else 0),
            err=err,
            m=m,
            a=a,
            r=None if r is None else r[a : a + m],
            ring_args=ring_args,
        )
        self.pipeline.submit(item)
        return plan.intra_bytes, wire_bytes(plan.shard, int(ring_args["bits"]), self.block)

    def _start_ring(self, item: Item) -> ShardRing:
        """Stage 2: the shard plus its residual through the quantised ring among the nodes."""
        assert isinstance(item, _ShardItem) and item.err is not None
        err_all, m, a, r = item.err, item.m, item.a, item.r
        k = item.shard.numel()
        copied = m != k
        if not copied:
            e = err_all[a : a + k]  # the residual's own slice: the ring writes the error straight there
        else:  # the shard reaches past the bucket's end: a padded copy (the padding's error is dropped:
            assert self.scratch is not None  # it belongs to no element, so conservation holds elementwise)
            e = self.scratch.take(k, torch.float32)
            e[:m].copy_(err_all[a : a + m])
            e[m:].zero_()
        rs = None
        carry = True
        if r is not None:
            rs = torch.ones(k, dtype=torch.float32, device=item.shard.device)
            rs[:m].copy_(r)
            item.shard.add_(e).div_(rs)  # the ring sees x / r; its error comes back in those units
            carry = False
        ring = QuantizedRing(item.shard, e, self.groups.inter, carry=carry, **item.ring_args)

        def after() -> None:
            if rs is not None:
                item.shard.mul_(rs)
                e.mul_(rs)
            if copied and m:
                err_all[a : a + m].copy_(e[:m])
            item.sent = ring.sent_bytes

        return ShardRing(ring, after)

    def progress(self) -> None:
        self.pipeline.progress()

    def drain(self) -> None:
        self.pipeline.drain()
        if self.scratch is not None:
            self.scratch.reset()
