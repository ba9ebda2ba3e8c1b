"""Dense synchronisation of fused gradient slices: cast to the wire dtype, allreduce, cast back.

``launch`` starts one asynchronous allreduce per bucket as the scheduler hands it over;
``finish`` waits for all of them and leaves the averaged gradient in the pool.  Both run on the
thread that runs backward, so every rank issues the same collectives in the same order.

With ``groups`` (nodes of several ranks), each allreduce is two-level instead
(:mod:`gradientflow.comm.two_level`): the wire buffer, padded to whole shards, is reduce-scattered
inside the node, each shard allreduced between nodes with ``algorithm``, and all-gathered inside the
node, advanced by :meth:`progress` at every gradient hook.  CSC's packed chunks go through
:meth:`DenseSync.start` too, so they travel two-level the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm.collectives import PendingAllreduce, start_allreduce
from ..comm.precision import divide, from_wire, to_wire
from ..comm.topology import two_level_plan
from ..comm.two_level import Item, NodeGroups, TwoLevelPipeline, dense_middle
from ..diagnostics.stats import StepStats
from ..diagnostics.watchdog import Watchdog
from ..engine.pool import Bucket, Scratch
from ..engine.protocol import SyncStrategy


class DenseSync(SyncStrategy):
    """Every gradient, every step: one allreduce per bucket in the wire dtype."""

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        world_size: int,
        wire_dtype: torch.dtype | None,
        algorithm: str,
        watchdog: Watchdog | None = None,
        groups: NodeGroups | None = None,
    ):
        self.group = group
        self.watchdog = watchdog  # bounds every wait, names the collective; CSC's collectives use it too
        self.world_size = world_size
        self.wire_dtype = wire_dtype
        self.algorithm = algorithm
        self._pending: list[tuple[torch.Tensor | None, torch.Tensor, PendingAllreduce]] = []
        self.scratch: Scratch | None = None  # wire buffers (and CSC's packed chunks), kept between steps
        # the fp32 default: the pool's dtype is the wire's, so divide() is torch.div (world size 1: a copy)
        self._plain_divide = wire_dtype is None and world_size > 1
        self._divisor32 = torch.tensor(float(world_size), dtype=torch.float32)
        self.groups = groups
        # two-level: wire buffers handed out padded to whole shards (wire_buffer), by (data_ptr, numel) of the head
        self._padded: dict[tuple[int, int], torch.Tensor] = {}
        self._two = (
            TwoLevelPipeline(groups, dense_middle(groups, algorithm), watchdog=watchdog, host_middle=True)
            if groups is not None
            else None
        )

    def take_fresh(self, grad: torch.Tensor, out: torch.Tensor) -> bool:
        """Step 1's division, folded into the copy of a fresh gradient into the pool (one pass, not two)."""
        if self._plain_divide and grad.dtype is torch.float32:
            # divide()'s own first branch without its frame (once per parameter per step), by a 0-dim fp32
            # tensor: the same fp32 quotient bit for bit (tests/test_precision.py), cheaper a call than a Python
            # int divisor (measured: docs/results/benchmarks.md, per-step fixed cost on small models)
            torch.div(grad, self._divisor32, out=out)
        else:
            divide(grad, self.world_size, self.wire_dtype, out=out)
        return True

    def launch(self, bucket: Bucket, flat: torch.Tensor, stats: StepStats, divided: bool = False) -> None:
        """1. pre-divide (unless ``divided``: :meth:`take_fresh` did) and cast into the wire buffer;
        2. start its allreduce."""
        self._cast_and_start(flat, f"bucket {bucket.index}", stats, divided)

    def send_chunks(self, packed: torch.Tensor, stats: StepStats) -> None:
        """:meth:`launch` for a tensor that is no bucket of the pool: CSC's packed chunks (its undivided
        residual rows), divided, cast and allreduced the same way; read back into ``packed``."""
        self._cast_and_start(packed, "chunks", stats, divided=False)

    def _cast_and_start(self, flat: torch.Tensor, what: str, stats: StepStats, divided: bool) -> None:
        t0 = time.perf_counter()
        out = None
        if self.wire_dtype is not None and flat.dtype != self.wire_dtype:
            out = self.wire_buffer(flat.numel(), self.wire_dtype, flat.device)
        wire = to_wire(flat, self.wire_dtype, self.world_size, out=out, divided=divided)
        stats.phase("pack", t0)
        self.start(wire, flat, what, stats)

    def wire_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A step's wire buffer of ``numel`` elements (dead after :meth:`finish`).  Two-level: the head of a
        buffer padded to whole shards, its padding zeroed, so :meth:`start` hands it to the pipeline as it is
        (no padded copy)."""
        scratch = self.scratch_for(device)
        if self.groups is None:
            return scratch.take(numel, dtype)
        topo = self.groups.topology
        padded = two_level_plan(numel, topo.nodes, topo.per_node).padded
        full = scratch.take(padded, dtype)
        full[numel:].zero_()
        head = full[:numel]
        self._padded[(head.data_ptr(), numel)] = full
        return head

    def start(self, wire: torch.Tensor, flat: torch.Tensor | None, what: str, stats: StepStats) -> None:
        """2. start ``wire``'s allreduce; :meth:`finish` waits for it and copies it back into ``flat``
        (``None``: the caller reads ``wire`` itself after :meth:`finish`, before the next step)."""
        if self._two is not None:
            self._start_two_level(wire, flat, what, stats)
            return
        stats.record_collective(wire.numel() * wire.element_size())
        handle = start_allreduce(wire, group=self.group, algorithm=self.algorithm, watchdog=self.watchdog, what=what)
        self._pending.append((flat, wire, handle))

    def _start_two_level(self, wire: torch.Tensor, flat: torch.Tensor | None, what: str, stats: StepStats) -> None:
        """The wire buffer padded to whole shards (a copy unless it divides evenly or came from
        :meth:`wire_buffer`), into the pipeline."""
        assert self._two is not None and self.groups is not None
        topo = self.groups.topology
        n = wire.numel()
        plan = two_level_plan(n, topo.nodes, topo.per_node, itemsize=wire.element_size())
        scratch = self.scratch_for(wire.device)
        full = self._padded.pop((wire.data_ptr(), n), wire)
        if full.numel() != plan.padded:
            full = scratch.take(plan.padded, wire.dtype)
            full[:n].copy_(wire)
            full[n:].zero_()
        shard = scratch.take(plan.shard, wire.dtype)

        def done(item: Item) -> None:
            stats.record_done(time.perf_counter())
            if item.full.data_ptr() != wire.data_ptr():
                wire.copy_(item.full[:n])
            if flat is not None:
                from_wire(flat, wire)

        # payload: the shard this rank hands to the exchange between nodes (the quantised recipe counts its shard
        # too), so a dense warm-up step and the compressed steps after it count the same thing
        stats.record_collective(plan.shard * wire.element_size())
        extra = stats.extra
        extra["inter_node_bytes"] = extra.get("inter_node_bytes", 0) + plan.inter_bytes
        extra["intra_node_bytes"] = extra.get("intra_node_bytes", 0) + plan.intra_bytes
        self._two.submit(Item(full, shard, what, done))
        self.progress(stats)

    def progress(self, stats: StepStats) -> None:
        """Two-level: move every bucket whose stage completed to its next stage; never wait."""
        if self._two is not None and not self._two.idle:
            self._guarded(self._two.progress)

    def _guarded(self, step: Callable[[], None]) -> None:
        if self.watchdog is None:
            step()
            return
        try:
            with self.watchdog.watched("two-level exchange", None):  # a drain that waits long is logged
                step()
        except RuntimeError as exc:
            raise self.watchdog.failure("two-level exchange", None, exc, 0.0) from exc

    def finish(self, stats: StepStats) -> None:
        """3. wait for every launched allreduce, in launch order; 4. write results back."""
        if self._two is not None:
            t0 = time.perf_counter()
            self._guarded(self._two.drain)
            stats.phase("wire_wait", t0)
        pending, self._pending = self._pending, []
        for flat, wire, handle in pending:
            t0 = time.perf_counter()
            handle.poll()  # already done: stamp now, so comm_seconds does not include our waiting
            handle.wait()
            stats.record_done(handle.completed_at)
            t0 = stats.phase("wire_wait", t0)
            if flat is not None:
                from_wire(flat, wire)
            stats.phase("unpack", t0)
        self._padded.clear()
        if self.scratch is not None:
            self.scratch.reset()  # every wire buffer of the step has been read back

    def scratch_for(self, device: torch.device) -> Scratch:
        """The step's temporaries' memory (one per wrapper; the model lives on one device)."""
        if self.scratch is None:
            self.scratch = Scratch(device)
        return self.scratch
