"""Replicas that come and go: every outer sync among the replicas alive at it, membership from torchft's Manager.

``sync_every=H, replicas=manager`` (a ``torchft.Manager``, torchft 0.2.0; docs/fault-tolerance.md says why torchft
and not torchrun's elastic rendezvous).  Each replica is its own launch (torchrun per replica) of one rank or
several, each rank with its own Manager (torchft's replica group: ``rank`` the rank inside the replica,
``world_size`` the replica's ranks), the Manager's process group joining rank r of every replica; torchft's
Lighthouse says who is alive.  Each rank exchanges its own part over its Manager's group: its shard of the
pseudo-gradient (the DDP door: shard r of the fragment, the replica's ranks all-gathering the means inside the
replica after the step is committed; ``fully_shard``: its FSDP shard, nothing to gather).  At every sync of a
fragment:

1. ``manager.start_quorum()`` (synchronous: the Manager needs ``use_async_quorum=False``, as torchft's DiLoCo does):
   the Lighthouse's quorum of the replicas that asked for one, every replica still heartbeating waited for (a
   killed or stopped one stops heartbeating, and is left out once the Lighthouse's ``heartbeat_timeout_ms`` passed);
   the Manager reconfigures its process group over them.  A replica behind the others (restarted, new, or one whose
   last sync failed where the others' succeeded) is healed here by torchft's checkpoint transport (HTTP from a live
   peer, no shared disk): :meth:`Membership.state_dict` of the peer, the anchor, the outer momentum and the step
   count (the fragment phase), loaded by :meth:`Membership.load_state_dict`, which sets its parameters to the anchor;
2. one 4-byte SUM allreduce counts the replicas that contribute: a replica healed at this quorum sends zeros (its
   parameters are the anchor, so its pseudo-gradient is exactly 0) and is not counted, so the mean is the others'
   mean, not diluted;
3. the outer exchange (:class:`.exchange.Average`, any ``outer_compression``: dense allreduce, the quantised
   exchange's point-to-point rounds, the top-k all-gather) over the quorum's group, divided by that count;
4. ``manager.should_commit()``: the step is applied (:meth:`.loop.OuterLoop.apply`) only where the exchange completed
   on this replica (torchft decides it for all the replica's ranks together: applied only where every one of them
   completed its part); otherwise nothing changed (the exchange writes scratch only) and the sync is redone from 1
   among the replicas then alive, ``max_retries`` times at most (the Manager's).  Only then do the ranks of a
   replica of several ranks all-gather their averaged shards inside it: none of them waits in that all-gather for
   a rank whose exchange failed.  The lost replicas are logged (WARNING) on every survivor by number.

A replica's quantised residual is its own undelivered mass: a healed replica starts with none (a peer's copy would
deliver that peer's mass twice).  Its inner optimizer state is what the user registered with the Manager
(``Manager(state_dict=..., load_state_dict=...)``: copied from the peer), or its own (fresh) without.

torchft's quorum group is not registered with torch.distributed (it changes at every quorum), so the exchanges call
the group's own methods there (:func:`gradientflow.comm.quantized_ring.post_p2p`), and the watchdog names the
replicas by torchft's numbers (the trailing digits of each ``replica_id``).  Private torchft attributes read here
(torchft 0.2.0): ``Manager._pg`` (the process group the user passed), ``_use_async_quorum``, ``_group_rank`` and
``_group_world_size`` (the rank inside the replica, the replica's ranks), and the wrapper's ``_global_ranks``
(``replica number * world_size + rank`` of each member of the quorum's group).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..diagnostics.errors import CommunicationError
from ..diagnostics.watchdog import Watchdog
from ..outer_options import OuterExchange
from .exchange import Average
from .fragments import due

if TYPE_CHECKING:
    from .loop import OuterLoop

logger = logging.getLogger(__name__)

STATE_KEY = "gradientflow_outer"
"""The key of the outer state among the Manager's registered state dicts (beside the user's ``"default"``)."""

_SUM = dist.AllreduceOptions()
_SUM.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)  # a ReduceOp on torch 2.13 and 2.14 alike (their stubs differ)


def check_manager(manager: Any) -> None:
    """``ValueError`` saying what to do unless ``manager`` is a torchft Manager this module can drive."""
    try:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupWrapper
    except ImportError as exc:  # pragma: no cover - the extra is installed where replicas= is used
        raise ValueError(
            "gradientflow: replicas= takes a torchft.Manager, and torchft is not installed: pip install torchft==0.2.0"
        ) from exc
    if not isinstance(manager, Manager):
        raise ValueError(
            f"gradientflow: replicas= takes a torchft.Manager (one per replica, built as torchft's DiLoCo takes "
            f"one), got {type(manager).__name__}. Pass replicas=torchft.Manager(pg=torchft.ProcessGroupGloo(), "
            "min_replica_size=..., use_async_quorum=False, ...)."
        )
    if manager._use_async_quorum:
        raise ValueError(
            "gradientflow: replicas= needs a Manager built with use_async_quorum=False (each outer sync waits for "
            "its quorum, as torchft's DiLoCo requires). Build the Manager with use_async_quorum=False."
        )
    if not isinstance(manager._pg, ProcessGroupWrapper):
        raise ValueError(
            f"gradientflow: replicas= needs the Manager's process group to be one of torchft's reconfigurable "
            f"ones (ProcessGroupGloo, ProcessGroupNCCL), got {type(manager._pg).__name__}. Build the Manager with "
            "pg=torchft.ProcessGroupGloo()."
        )


class _QuorumWatchdog(Watchdog):
    """A watchdog over one quorum's group: every wait bounded by ``timeout``; the ranks it names are the replicas'
    numbers.  No check-in through a store (the quorum's store is torchft's): which replica was lost is told by the
    next quorum (:meth:`Membership.sync` logs it)."""

    unknown_why = "replicas share no store: the next quorum names a replica lost"
    missing_hint = None  # a replica does not run out of data: it dies, hangs or is cut off
    after_failure = "Nothing of this try is applied; the sync is redone among the replicas alive at the next quorum."

    def _check_in(self, where: str) -> tuple[list[int] | None, dict[int, str]]:
        return None, {}

    def _report_slow(self, where: str) -> dict[int, str] | None:
        return None


class Membership:
    """The outer syncs of one replica among the live ones, through ``manager`` (a ``torchft.Manager``).

    ``node``: the replica's own group where the DDP door's replica has several ranks (``local`` this rank in it, of
    ``per_node``): each rank exchanges shard ``local`` of the fragment and the means are all-gathered over ``node``
    (:class:`.exchange.Average`'s two-level form); ``None`` where each rank's part is its own (one rank, or
    ``fully_shard``'s shards)."""

    def __init__(
        self,
        manager: Any,
        spec: OuterExchange,
        timeout: timedelta,
        node: dist.ProcessGroup | None = None,
        local: int = 0,
        per_node: int = 1,
    ) -> None:
        check_manager(manager)
        self.manager, self.spec, self.timeout = manager, spec, timeout
        self.node, self.local, self.per_node = node, local, per_node
        self.loop: OuterLoop | None = None
        self.group: Any = None  # the quorum's c10d group (the Manager's process group, reconfigured)
        self.replicas: list[int] = []  # the quorum's replicas, by torchft's numbers
        self.healed = False  # the last quorum loaded a peer's state into this replica
        self.fresh = False  # its parameters are a peer's anchor, no inner step since: it contributes zeros
        self.lost: list[int] = []  # replicas of the quorum before that the current one lacks (logged)

    def attach(self, loop: OuterLoop) -> None:
        """Drive ``loop``'s syncs; the outer state offered to, and loaded from, torchft's checkpoint transport."""
        self.loop = loop
        loop.membership = self
        self.manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)

    # ---- healing: torchft's checkpoint transport ------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a replica behind receives from this one (called on torchft's quorum thread while this replica's
        training thread waits for the quorum): the anchor (the parameters, before the first step), the outer
        momentum, the step count."""
        loop = self.loop
        assert loop is not None
        anchor = loop.anchor if loop.anchor is not None else [loop._flat(f) for f in range(len(loop.runs))]
        return {
            "anchor": [a.detach().clone() for a in anchor],
            "momentum": None if loop.buf is None else [b.detach().clone() for b in loop.buf],
            "steps": loop.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A live peer's outer state: the anchor and momentum installed, the phase taken, the parameters set to the
        anchor, no residual (it is the sender's own)."""
        loop = self.loop
        assert loop is not None
        device = loop.device
        loop.anchor = [a.to(device=device, dtype=torch.float32).clone() for a in state["anchor"]]
        momentum = state["momentum"]
        if momentum is not None:
            loop.buf = [b.to(device=device, dtype=torch.float32).clone() for b in momentum]
        elif loop.momentum:
            loop.buf = [torch.zeros_like(a) for a in loop.anchor]
        loop.steps = loop.loaded_steps = int(state["steps"])
        loop.exchange.residuals = [None] * len(loop.runs)
        loop.replica = None
        for f in range(len(loop.runs)):
            loop._write(f)
        self.healed = self.fresh = True

    # ---- the quorum ----------------------------------------------------------------------------------
    def quorum(self) -> None:
        """A quorum of the live replicas (healing this one if it is behind); the exchange's group and names."""
        self.healed = False
        before = self.replicas
        self.manager.start_quorum()
        pg = self.manager._pg
        if self.manager.errored() is not None:  # the group could not be configured: no exchange this round
            return
        self.group = pg.parent
        # torchft numbers rank r of replica n as n * world_size + r: the replica's number is what a user reads
        per_replica = self.manager._group_world_size
        self.replicas = [g // per_replica for g in (pg._global_ranks or range(self.group.size()))]
        gone = [r for r in before if r not in self.replicas]
        if gone:
            self.lost = gone
            logger.warning(
                "gradientflow: replica(s) %s left (lost or stopped); the outer syncs go on among replicas %s",
                gone,
                self.replicas,
            )

    def join(self) -> None:
        """At construction: the first quorum.  A replica that joins a running job is healed there and enters the
        sync the others are at."""
        loop = self.loop
        assert loop is not None
        self.quorum()
        if self.healed:
            self.sync(loop, self._due(loop), joined=True)
        self.fresh = False  # healed at a fresh start (torchft's init_sync): its inner steps are its own from here

    @staticmethod
    def _due(loop: OuterLoop) -> list[int]:
        return [f for f in range(len(loop.runs)) if loop.steps and due(loop.steps, f, len(loop.runs), loop.every)]

    def sync(self, loop: OuterLoop, fragments: list[int], joined: bool = False) -> list[int]:
        """Every fragment of ``fragments`` synchronised among the live replicas (module docstring, 1-4); the
        fragments whose parameters changed."""
        done: list[int] = []
        queue = list(fragments)
        while queue:
            f = queue.pop(0)
            for attempt in range(1_000_000):  # bounded by the Manager's max_retries (it raises past them)
                if attempt or not joined:
                    self.quorum()
                    if self.healed:  # behind the others: their state loaded, their fragment(s) now
                        queue = self._due(loop)
                        if not queue:
                            return done
                        f = queue.pop(0)
                if self._exchange(loop, f, attempt):
                    done.append(f)
                    self.fresh = False
                    break
        return done

    def _exchange(self, loop: OuterLoop, f: int, attempt: int) -> bool:
        """One try of fragment ``f``'s exchange over the current quorum; True where it was applied."""
        assert loop.anchor is not None
        t0 = time.perf_counter()
        what = f"outer exchange of fragment {f} after step {loop.steps} (replicas {self.replicas})"
        flight, buffers, exchange = None, None, None
        contributes = not self.fresh
        if self.manager.errored() is None:
            watchdog = _QuorumWatchdog(self.group, self.timeout, global_ranks=self.replicas)
            watchdog.step = loop.steps
            try:
                count = torch.tensor([1.0 if contributes else 0.0])
                watchdog.wait(self.group.allreduce([count], _SUM), f"{what}: contributors", 4)
                # every replica of the quorum was healed (a fresh start's quorum): nobody has drift to average
                parties = max(int(count.item()), 1)
                exchange = Average(
                    self.spec,
                    self.group,
                    watchdog,
                    len(loop.runs),
                    node=self.node,
                    local=self.local,
                    per_node=self.per_node,
                    parties=parties,
                )
                exchange.residuals = loop.exchange.residuals
                delta = loop._flat(f).neg_().add_(loop.anchor[f])  # anchor - now: exactly 0 on a healed replica
                wire = delta.to(loop.params[0].device)  # where the backend sends from, as OuterLoop.sync
                buffers = [delta, wire]
                del delta, wire
                flight = exchange.start(buffers[1], f, what)
                flight.complete()  # between replicas only: the gather inside the replica waits for the commit
            except (CommunicationError, RuntimeError) as exc:
                self.manager.report_error(exc)
        if not self.manager.should_commit():
            logger.warning(
                "gradientflow: %s not applied (try %d): %s; redone among the replicas alive at the next quorum",
                what,
                attempt + 1,
                self.manager.errored() or "too few replicas in the quorum",
            )
            return False
        assert flight is not None and buffers is not None and exchange is not None
        # committed on every rank of this replica alike: its ranks all-gather their shards' means inside it (a
        # failure here is this replica's own rank lost: the replica is gone, and rejoins healed when restarted)
        sent, residual = flight.gathered()
        loop.exchange = exchange
        loop.apply(f, buffers, sent, residual, t0)
        return True


def check_replica_ranks(manager: Any, rank: int, ranks: int, door: str) -> None:
    """``ValueError`` unless ``manager`` was built for rank ``rank`` of a replica of ``ranks`` ranks (torchft's
    replica group: one Manager per rank, its ``rank`` and ``world_size`` the replica's own), as ``door`` counts
    them."""
    if (manager._group_rank, manager._group_world_size) != (rank, ranks):
        raise ValueError(
            f"gradientflow: replicas= got a Manager built for rank {manager._group_rank} of a replica of "
            f"{manager._group_world_size} rank(s), but this is rank {rank} of the {ranks} rank(s) of {door}. Build "
            "each rank's Manager with rank=torch.distributed.get_rank(), world_size=torch.distributed."
            "get_world_size() of the replica's own launch (docs/fault-tolerance.md)."
        )
