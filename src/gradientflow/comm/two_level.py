"""Two-level synchronisation of a bucket: inside the node, between nodes, inside the node again.

For each bucket's padded wire buffer (:func:`~gradientflow.comm.topology.two_level_plan`):

1. a dense SUM reduce-scatter among the ranks of the node (``reduce_scatter``): local rank j ends
   with the node's sum of shard j;
2. the recipe's exchange of that shard between nodes, among the ranks with the same local index
   (``inter``): a dense allreduce (``"native"`` or ``"ring"``), or the quantised ring with error
   feedback (supplied by the strategy as a :class:`Middle`);
3. a dense all-gather of the shards among the ranks of the node (``all_gather``).

Each stage has its own process group, and every stage is issued strictly in bucket order on every
rank: collectives on one group are matched by issue order, so if the reduce-scatter of bucket 2 and
the all-gather of bucket 1 shared a group, ranks polling at different moments would issue them in
different orders.  With one group per stage, a rank may move bucket 1 to its all-gather before or
after launching bucket 2's reduce-scatter: each group still sees bucket 1, 2, .. in order.

Non-blocking: :meth:`TwoLevelPipeline.progress` moves every bucket whose stage completed to its next
stage and never waits (the engine calls it at every gradient hook); :meth:`TwoLevelPipeline.drain`
drives the rest, always blocking on the earliest bucket's current stage after issuing everything
that can be issued (what a peer may be waiting for from this rank has then been issued).  Gloo's
``reduce_scatter_single`` never reports completion to ``is_completed()``, so a waiter thread per stage's group
(:mod:`.waiter`) waits on the works and sets an event; collectives are issued from the training
thread only.  CUDA tensors on Gloo are staged through host memory for the two stages inside the node
(as the quantised ring stages its bytes); NCCL takes device memory directly.

Tracing (``trace_path=``): each stage of each bucket is one ``collective`` event on the comm tracks,
named ``reduce-scatter <what>``, ``inter-node <what>`` and ``all-gather <what>`` (args: ``stage``, ``bytes``
the tensor the stage sends from, ``group``), from its issue to the moment the pipeline saw it complete.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .collectives import all_gather_single, reduce_scatter_single, start_allreduce
from .topology import Topology
from .waiter import Arrival, waiter_for


@dataclass
class NodeGroups:
    """This rank's groups for two-level synchronisation (created once per wrapper, see
    :mod:`gradientflow.wrapper.node_groups`): ``reduce_scatter`` and ``all_gather`` hold the ranks of its
    node (two groups over the same ranks: one per stage), ``inter`` the ranks of its local index."""

    topology: Topology
    local: int  # this rank's index inside its node (its shard)
    node: int
    reduce_scatter: dist.ProcessGroup
    all_gather: dist.ProcessGroup
    inter: dist.ProcessGroup
    timeout: timedelta | None = None


class Middle(Protocol):
    """The stage between nodes of one bucket, in flight: advanced by ``poll`` (never blocks) or ``wait``."""

    def poll(self) -> bool: ...

    def wait(self) -> object: ...


class _Done:
    """A stage that completed as it was started (the synchronous ring)."""

    def poll(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _Watched:
    """Works handed to a stage's waiter thread: done once its event is set.  (Waiting on the works from the
    training thread instead, to save the hand-off, made resumed runs differ on some ranks: not done.)"""

    def __init__(self, arrival: Arrival) -> None:
        self.arrival = arrival

    def poll(self) -> bool:
        if self.arrival.event.is_set():
            self.arrival.check()
            return True
        return False

    def wait(self) -> None:
        self.arrival.event.wait()
        self.arrival.check()


@dataclass
class Item:
    """One bucket on its way: ``full`` the padded wire buffer (the result lands there), ``shard`` this
    rank's shard of the node sum (its own buffer: the all-gather reads it while writing ``full``)."""

    full: torch.Tensor
    shard: torch.Tensor
    what: str
    on_done: Callable[[Item], None]
    stage: int = 0  # 0 reduce-scatter, 1 waiting for / between nodes, 2 all-gather, 3 done
    handle: Middle | None = None
    host: tuple[torch.Tensor, torch.Tensor] | None = None  # staged: (full, shard) in host memory
    middle: torch.Tensor | None = None  # what the exchange between nodes works on: the shard or its host copy
    started_at: float = field(default_factory=time.perf_counter)
    span: _Span | None = None  # the current stage's trace event, when tracing


class _Span:
    """A stage as the trace sees it (:meth:`~gradientflow.diagnostics.trace.TraceRecorder.collective`): done
    once the pipeline stamped ``completed_at`` (polling it never advances a collective)."""

    def __init__(self) -> None:
        self.completed_at: float | None = None

    def poll(self) -> bool:
        return self.completed_at is not None


def _watched(group: dist.ProcessGroup, work: dist.Work | None, timeout: timedelta | None) -> _Watched:
    """``work`` (a stage's, on ``group``) handed to that group's waiter."""
    return _Watched(waiter_for(group).watch([work] if work is not None else [], timeout))


StartMiddle = Callable[[Item], Middle]
"""Starts an item's exchange between nodes on ``item.shard`` (in place), returns it in flight."""


def dense_middle(groups: NodeGroups, algorithm: str) -> StartMiddle:
    """A dense SUM allreduce of the shard among the nodes, with ``algorithm`` (the ring runs at once)."""

    def start(item: Item) -> Middle:
        shard = item.middle  # the shard, or its host copy (set by the pipeline)
        assert shard is not None
        if algorithm == "ring":
            start_allreduce(shard, group=groups.inter, algorithm="ring", what=item.what)
            return _Done()
        work = dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=groups.inter, async_op=True)
        return _watched(groups.inter, work, groups.timeout)

    return start


class StageTrace(Protocol):
    """What the pipeline records its stages into (``diagnostics.trace.TraceRecorder``; comm/ sits below
    diagnostics/, so it names the shape, not the class)."""

    active: bool

    def collective(self, handle: Any, kind: str, nbytes: int, t0: float, **args: Any) -> None: ...

    def complete(self, name: str, cat: str, t0: float, t1: float, **args: Any) -> None: ...


class Traced(Protocol):
    """An owner of a :class:`StageTrace` that is set while a step is recorded (the engine's watchdog)."""

    trace: Any  # StageTrace | None; Any so that a recorder's own class satisfies it (attributes are invariant)


class TwoLevelPipeline:
    """Buckets through the three stages, each stage issued in submission order (see the module docstring).

    ``serial``: a bucket's exchange between nodes starts only once the previous bucket's completed (the
    quantised ring from 3 nodes posts its second round as its first arrives: one ring at a time keeps
    the posting order the same on every rank); otherwise as soon as its reduce-scatter completed.
    ``host_middle``: the exchange between nodes takes host memory as well (a dense allreduce reads
    ``item.middle``): a bucket staged through the host stays there from its reduce-scatter to its all-gather,
    instead of a copy to the device and back between the stages: each such copy waits, on the training
    thread, for the GPU's queue (and, with several processes on one GPU, for their turns).
    """

    def __init__(
        self,
        groups: NodeGroups,
        start_middle: StartMiddle,
        serial: bool = False,
        watchdog: Traced | None = None,
        host_middle: bool = False,
    ) -> None:
        self.groups, self.start_middle, self.serial = groups, start_middle, serial
        self.host_middle = host_middle
        self.watchdog = watchdog  # its trace, when recording, gets every stage (see the module docstring)
        self._rs: deque[Item] = deque()  # reduce-scatter in flight (handle: its arrival)
        self._ready: deque[Item] = deque()  # node sum in hand, waiting to go between nodes
        self._inter: deque[Item] = deque()  # between nodes
        self._ag: deque[Item] = deque()  # all-gather in flight
        self._backend: str | None = None

    @property
    def idle(self) -> bool:
        return not (self._rs or self._ready or self._inter or self._ag)

    def submit(self, item: Item) -> None:
        """Stage 1 now: the reduce-scatter of ``item.full`` into ``item.shard`` inside the node."""
        full, shard = item.full, item.shard
        if self._staged(full):
            # pinned: the copy back after the all-gather is then queued on the stream, not waited for (the host
            # allocator keeps the buffer until that copy ran)
            pin = full.is_cuda
            host = torch.empty(full.shape, dtype=full.dtype, pin_memory=pin)
            host.copy_(full)
            full, shard = host, torch.empty(shard.numel(), dtype=shard.dtype, pin_memory=pin)
            item.host = (full, shard)
        self._trace(item, "reduce-scatter", full)
        work = reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=self.groups.reduce_scatter, async_op=True)
        item.handle = _watched(self.groups.reduce_scatter, work, self.groups.timeout)
        self._rs.append(item)

    def _trace(self, item: Item, stage: str, sent: torch.Tensor) -> None:
        """The stage starting now, as a collective event of the trace (when it records this step)."""
        trace = self._recorder()
        if trace is None or not trace.active:
            item.span = None
            return
        item.span = _Span()
        group = "inter" if stage == "inter-node" else "intra"
        nbytes = sent.numel() * sent.element_size()
        trace.collective(item.span, f"{stage} {item.what}", nbytes, time.perf_counter(), stage=stage, group=group)

    def _recorder(self) -> StageTrace | None:
        return self.watchdog.trace if self.watchdog is not None else None

    @staticmethod
    def _stamp(item: Item) -> None:
        if item.span is not None:
            item.span.completed_at = time.perf_counter()
            item.span = None

    def progress(self) -> None:
        """Move every bucket whose stage completed on; issue what follows, in order; never wait."""
        moved = True
        while moved:
            moved = False
            if self._rs and self._head_done(self._rs):
                item = self._rs.popleft()
                self._stamp(item)
                item.middle = item.shard
                if item.host is not None:
                    if self.host_middle:
                        item.middle = item.host[1]
                    else:
                        item.shard.copy_(item.host[1])
                self._ready.append(item)
                moved = True
            if self._ready and not (self.serial and self._inter):
                item = self._ready.popleft()
                self._trace(item, "inter-node", item.shard)
                item.stage, item.handle = 1, self.start_middle(item)
                self._inter.append(item)
                moved = True
            if self._inter and self._head_done(self._inter):
                item = self._inter.popleft()
                self._stamp(item)
                full, shard = item.full, item.shard
                if item.host is not None:
                    full, shard = item.host[0], (item.host[1] if self.host_middle else shard.cpu())
                    item.host = (full, shard)  # alive until the all-gather completed
                self._trace(item, "all-gather", shard)
                work = all_gather_single(full, shard, group=self.groups.all_gather, async_op=True)
                item.stage = 2
                item.handle = _watched(self.groups.all_gather, work, self.groups.timeout)
                self._ag.append(item)
                moved = True
            if self._ag and self._head_done(self._ag):
                item = self._ag.popleft()
                self._stamp(item)
                if item.host is not None:
                    item.full.copy_(item.host[0], non_blocking=item.host[0].is_pinned())
                    item.host = None
                item.stage = 3
                item.on_done(item)
                moved = True

    def drain(self) -> None:
        """Every submitted bucket to the end: issue what can be issued, then block on the earliest bucket."""
        while True:
            self.progress()
            queues = [q for q in (self._ag, self._inter, self._rs) if q]
            if not queues and not self._ready:
                return
            if not queues:  # only waiting buckets: progress() starts the next at once
                continue
            head = min((q[0] for q in queues), key=self._order)
            assert head.handle is not None
            trace = self._recorder()
            t0 = time.perf_counter()
            head.handle.wait()
            if trace is not None and trace.active:  # the blocking waits after backward, by stage
                stage = ("reduce-scatter", "inter-node", "all-gather")[min(head.stage, 2)]
                trace.complete(f"wait {stage} {head.what}", "wait", t0, time.perf_counter(), stage=stage)

    def _staged(self, t: torch.Tensor) -> bool:
        """Gloo's collectives inside the node on host memory: a CUDA tensor's bytes are staged through the
        host there (NCCL takes device memory as it is)."""
        if self._backend is None:
            self._backend = str(dist.get_backend(self.groups.reduce_scatter)).lower()
        return t.device.type != "cpu" and "nccl" not in self._backend

    def _order(self, item: Item) -> float:
        return item.started_at

    @staticmethod
    def _head_done(q: deque[Item]) -> bool:
        handle = q[0].handle
        assert handle is not None, "every queued item has its stage in flight"
        return handle.poll()
