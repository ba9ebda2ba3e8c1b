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

The residual lives on this rank's shard only, so the error sources are the M node sums, not the N
ranks, and it takes 1/G of a flat rank's memory: :class:`ShardResiduals` holds, per pool, the shards of
its buckets back to back (``two_level_plan(bucket).shard`` elements each, fp32; the padding past the
bucket's end is kept at zero: its error belongs to no element and is dropped).  Checkpoints keep flat's
format (the residual in the pool's layout, zero off the shard), expanded only while a checkpoint is
written or read.  The pool's one-time re-layout moves the buckets' shards onto other elements: the
residual is then expanded once into the new layout and added whole to the next step's contribution,
before the reduce-scatter (``QuantizedSync``: a full-size transient for that one step), and the shards
start again from zero.  Conservation as flat: ``sum over ranks of e + result == sum of the ranks' g / N``
elementwise, up to fp32 rounding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm.quantize import wire_bytes
from ..comm.topology import two_level_plan
from ..comm.two_level import Item, NodeGroups, TwoLevelPipeline
from ..diagnostics.stats import StepStats
from ..engine.pool import Layout, Scratch
from ..exchange.error_feedback import ShardResiduals
from ..exchange.precondition import Root
from ..exchange.ring import Ring, start_ring

TWO_LEVEL = "two-level quantised exchange"
"""What a failure of the two-level pipeline names (the pipeline's steps are guarded as a whole, so its rings are
started without a watchdog of their own)."""


@dataclass
class _ShardItem(Item):
    """A bucket with what its ring needs: the residual slice, this shard's real length ``m`` at offset ``a``,
    the preconditioner's divisor there, the quantiser's arguments; ``sent``: the ring's bytes."""

    err: torch.Tensor | None = None
    m: int = 0
    a: int = 0
    root: Root | None = None
    ring_args: dict[str, Any] = field(default_factory=dict)
    sent: int = 0


class ShardRing:
    """One bucket's exchange between nodes: the quantised ring on the shard, then the residual and the
    preconditioner's scaling put back (once, when the ring completes)."""

    def __init__(self, ring: Ring, after: Callable[[], None]) -> None:
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
    docstring).  ``start(x, err, root, ring_args, done)``: ``x`` the bucket's fp32 contribution (divided),
    ``err`` its residual slice, ``root`` the preconditioner's divisor (or ``None``)."""

    def __init__(self, groups: NodeGroups, block: int, watchdog: Any = None) -> None:
        self.groups, self.block, self.watchdog = groups, block, watchdog
        # From 3 nodes a ring posts its second round as the first arrives: one ring at a time keeps the
        # posting order the same on every rank (as the flat recipe from 3 ranks).
        self.pipeline = TwoLevelPipeline(groups, self._start_ring, serial=groups.topology.nodes > 2, watchdog=watchdog)
        self.scratch: Scratch | None = None

    def residuals(self, layout: Layout) -> ShardResiduals:
        """Empty error feedback for ``layout``: this rank's shard of each bucket (1/G of the pool)."""
        return ShardResiduals(layout, self.groups, self.block)

    def start(
        self,
        x: torch.Tensor,
        err: torch.Tensor,
        root: Root | None,
        ring_args: dict[str, Any],
        done: Callable[[torch.Tensor, int], None],
        what: str = "quantised shard",
    ) -> tuple[int, int]:
        """Stage 1 of one bucket now; ``done(result, sent_bytes)`` once its decoded average is in hand.
        ``err``: the bucket's shard of the residual (:meth:`ShardResiduals.shard`, ``plan.shard`` elements);
        ``what`` names it in errors and the trace.
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
        assert err.numel() == plan.shard, "the residual's shard is the plan's"
        a, b = plan.bounds[self.groups.local]
        m = max(0, min(b, n) - a)  # this shard's elements that are real (the rest is padding)
        item = _ShardItem(
            full,
            shard,
            what,
            lambda it: done(it.full[:n], it.sent if isinstance(it, _ShardItem) else 0),
            err=err,
            m=m,
            a=a,
            root=root,
            ring_args=ring_args,
        )
        self.pipeline.submit(item)
        return plan.intra_bytes, wire_bytes(plan.shard, int(ring_args["bits"]), self.block)

    def _start_ring(self, item: Item) -> ShardRing:
        """Stage 2: the shard plus its residual through the quantised ring among the nodes."""
        assert isinstance(item, _ShardItem) and item.err is not None
        e, m, a, root = item.err, item.m, item.a, item.root
        k = item.shard.numel()
        carry = True
        if root is not None:  # the ring sees (x + e) / r (r = 1 on the padding); its error comes back in those units
            root.divide(item.shard[:m], e[:m], lo=a)
            item.shard[m:].add_(e[m:])
            carry = False
        args = item.ring_args
        ring = start_ring(
            item.shard,
            e,
            self.groups.inter,
            bits=int(args["bits"]),
            block=int(args["block"]),
            watchdog=self.watchdog,
            what=item.what,
            levels=str(args["levels"]),
            clip=float(args["clip"]),
            carry=carry,
            named=False,  # the pipeline's steps are guarded as a whole (TWO_LEVEL)
        )

        def after() -> None:
            if root is not None:  # before done()'s EMA moves q: r is recomputed from it
                root.restore(item.shard[:m], e[:m], lo=a)
            if m < k:  # the padding's error belongs to no element: dropped (conservation holds elementwise)
                e[m:].zero_()
            item.sent = ring.sent_bytes

        return ShardRing(ring, after)

    def progress(self) -> None:
        self.pipeline.progress()

    def drain(self) -> None:
        self.pipeline.drain()
        if self.scratch is not None:
            self.scratch.reset()


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
    ``inter_node_bytes`` what the ring sent, ``intra_node_bytes`` the stages inside the node.  One owner for the
    ``3bit`` family's buckets and ``topk-3bit``'s rows, so the bytes are counted the same whichever sends."""

    def done(result: torch.Tensor, sent: int) -> None:
        stats.record_done(time.perf_counter())
        stats.extra["inter_node_bytes"] = stats.extra.get("inter_node_bytes", 0) + sent
        on_result(result)

    intra, payload = nodes.start(x, err, root, ring_args, done, what)
    stats.record_collective(payload)
    stats.extra["intra_node_bytes"] = stats.extra.get("intra_node_bytes", 0) + intra
