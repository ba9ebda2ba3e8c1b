"""``sync_every=H`` wired into the wrapper: the outer loop (:mod:`gradientflow.outer`) after the inner optimizer's
steps, the engine on the node's ranks only, and no gradient exchange at all on a flat layout.

- **Flat** (every rank a replica): no forward synchronises (as inside ``no_sync()``, without the user asking):
  each rank steps on its own gradient; every H steps the outer sync.
- **Nodes of several ranks** (``topology="MxG"`` or torchrun's layout): the engine runs on the node's group,
  flat, dense, every step (the fast link); the outer exchange goes between nodes only, one shard per local rank.
- **Replicas that come and go** (``replicas=``, a torchft Manager per rank): the process group is one replica.
  Of one rank: the flat form.  Of several (torchrun per replica): the replica is the node, its ranks average
  densely every step on a group of the wrapper's own over them, and rank r's shard goes over its Manager's group
  to rank r of the other replicas (:mod:`gradientflow.outer.membership`).

The inner optimizer's steps drive the loop through :class:`gradientflow.outer.driver.InnerSteps` (torch's global
optimizer step hooks, one optimizer only, this rank's inner optimizer state in checkpoints), the code
``fully_shard``'s ``sync_every`` runs too (:mod:`gradientflow.fsdp.outer`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..config import GradientFlowConfig
from ..diagnostics.watchdog import Watchdog, resolve_timeout
from ..options_base import advise
from ..outer.driver import InnerSteps
from ..outer.exchange import Average
from ..outer.loop import OuterLoop
from ..outer.membership import Membership, check_manager, check_replica_ranks
from ..outer_options import OUTER_OPTIONS, outer_exchange_of
from .groups import exchange_group, node_groups, resolve_layout

DistributedDataParallel = Any
"""The wrapper (not imported: ddp imports this module)."""


class FewerSyncs:
    """The wrapper's outer loop and the groups it runs on (``model._gf_outer``; ``None`` at ``sync_every=1``)."""

    def __init__(self, model: DistributedDataParallel) -> None:
        config: GradientFlowConfig = model.config
        topo = resolve_layout(config, model.process_group)
        world = dist.get_world_size(model.process_group)
        # replicas= over several ranks: the process group is one replica, the node of the two-level form
        replica_node = model._gf_replicas is not None and world > 1
        self.two_level = topo.two_level or replica_node
        self.per_node = world if replica_node else topo.per_node
        self.local_steps = not self.two_level  # flat: no forward synchronises
        spec = outer_exchange_of(config.outer_compression, config.outer_density)
        self.node_watchdog: Watchdog | None = None
        self.node_group: Any = None
        local = dist.get_rank(model.process_group)
        if replica_node:
            # one group of the wrapper's own over the replica: the engine's dense allreduce in the backward, and the
            # all-gather of the outer means in the optimizer step (after the backward: never both at once)
            self.node_group = exchange_group(model)
            self.node_watchdog = Watchdog(self.node_group, model._gf_watchdog.timeout)
            exchange = Average(
                spec,
                self.node_group,  # stands until the first sync: each sync's exchange is over its quorum
                model._gf_watchdog,
                int(config.sync_fragments or 1),
                node=self.node_group,
                local=local,
                per_node=world,
            )
        elif self.two_level:
            nodes = node_groups(model)
            assert nodes is not None
            self.node_group = nodes.reduce_scatter  # the engine's dense allreduce inside the node
            self.node_watchdog = Watchdog(self.node_group, model._gf_watchdog.timeout)
            exchange = Average(
                spec,
                nodes.inter,
                model._gf_watchdog,
                int(config.sync_fragments or 1),
                node=nodes.all_gather,
                local=nodes.local,
                per_node=topo.per_node,
            )
        else:
            exchange = Average(spec, exchange_group(model), model._gf_watchdog, int(config.sync_fragments or 1))
        device = torch.device(config.outer_state_device) if config.outer_state_device is not None else None
        self.membership: Membership | None = None
        if model._gf_replicas is not None:  # replicas that come and go: the exchange is over each sync's quorum
            timeout = resolve_timeout(config.timeout, model.process_group, between_nodes=True)
            node = (self.node_group, local, world) if replica_node else (None, 0, 1)
            self.membership = Membership(model._gf_replicas, spec, timeout, *node)
        self.loop = OuterLoop(
            model._gf_params,
            every=config.sync_every,
            lr=float(config.outer_lr or 0.0),
            momentum=float(config.outer_momentum or 0.0),
            fragments=int(config.sync_fragments or 1),
            exchange=exchange,
            watchdog=model._gf_watchdog,
            state_device=device,
            delay=int(config.sync_delay or 0),
        )
        # the door-neutral part (outer/driver.py): the inner optimizer's steps, the one-optimizer check, this rank's
        # inner optimizer state in checkpoints
        self.steps = InnerSteps(self.loop, model._gf_params)
        self.steps.hook(model, lambda m: m._gf_after_outer_sync())
        if self.membership is not None:  # the first quorum: a replica joining a running job enters its sync here
            self.membership.attach(self.loop)
            self.membership.join()

    # ---- checkpoint (outer/driver.py: why each rank keeps its own inner optimizer state) ------------------------
    def state_dict(self) -> dict[str, Any]:
        """The outer loop's state, this replica's parameters and this rank's inner optimizer state."""
        return self.steps.state_dict()

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        self.steps.validate_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps.load_state_dict(state)

    def engine_setup(self, model: DistributedDataParallel) -> tuple[GradientFlowConfig, Any, Watchdog] | None:
        """Nodes of several ranks: the engine's config (flat: dense inside the node), group and watchdog; ``None``
        on a flat layout (the engine on the wrapper's group, never synchronising)."""
        if not self.two_level:
            return None
        assert self.node_watchdog is not None
        # the engine's view: a flat, per-step dense run over the node (the outer options are not its own)
        unset = dict.fromkeys(OUTER_OPTIONS)
        inner = dataclasses.replace(model.config, topology="flat", sync_every=1, **unset)
        return inner, self.node_group, self.node_watchdog

    def stats(self, dense_bytes: int) -> dict[str, float | int | str]:
        return {**self.loop.stats(dense_bytes), "outer_compression": self.loop.exchange.spec.name}

    def between_nodes(self, engine: dict[str, float | int], dense_bytes: int, total: bool) -> dict[str, float | int]:
        """``comm_stats()``'s counters with ``payload_bytes`` the bytes handed to the exchange between nodes, as for
        every recipe: here the outer syncs' (of the last inner step, or since construction with ``total``), not the
        engine's (flat: it exchanges nothing; nodes: its dense allreduce inside the node, counted as a ring's
        ``2 (G-1)/G`` in ``intra_node_bytes``).  ``dense_bytes`` is torch DDP's per step (times the inner steps of
        this process with ``total``), so ``payload_bytes / dense_bytes`` is the share of its bytes, as everywhere."""
        loop, out = self.loop, dict(engine)
        sent = loop.sent if total else loop.last
        inside = int(engine.get("payload_bytes", 0))  # the engine's: nodes, the node's dense allreduce; flat, 0
        g = self.per_node
        out["payload_bytes"] = sent.payload
        out["dense_bytes"] = dense_bytes * (loop.steps_here if total else 1)
        if total:
            out["steps"] = loop.steps_here
        if self.two_level:
            out["inter_node_bytes"] = sent.inter
            out["intra_node_bytes"] = sent.intra + inside * 2 * (g - 1) // g
        return out

    def remove(self) -> None:
        self.steps.remove()


def check(model: DistributedDataParallel) -> None:
    """At validation, on each rank alone: what the model must offer the options (``ValueError`` saying what to do)."""
    replicas, config = model._gf_replicas, model.config
    if replicas is not None:
        if config.sync_every <= 1:
            raise ValueError(
                "gradientflow: replicas= (a torchft Manager) drives the outer syncs of fewer syncs; pass "
                "sync_every > 1 (e.g. sync_every=100), or leave replicas out."
            )
        if config.sync_delay:
            raise ValueError(
                f"gradientflow: replicas= runs each outer sync among the replicas alive at it, which streaming's "
                f"overlap (sync_delay={config.sync_delay}) cannot (its exchange spans inner steps). Pass sync_delay=0."
            )
        if resolve_layout(config, model.process_group).two_level:
            raise ValueError(
                f"gradientflow: replicas= takes the process group as one replica, its ranks averaging densely every "
                f"step, but topology={config.topology!r} splits it into nodes (a replica's launch of several nodes). "
                "Launch each node as its own replica (torchrun --nnodes 1 --nproc-per-node <GPUs> per node, each "
                "rank with its own torchft Manager), or pass topology='flat' to average densely across the replica's "
                "nodes every step (docs/fault-tolerance.md)."
            )
        check_manager(replicas)
        group = model.process_group
        check_replica_ranks(replicas, dist.get_rank(group), dist.get_world_size(group), "this process group")
    frags = model.config.sync_fragments
    if frags is not None and frags > len(model._gf_params):
        raise ValueError(
            f"sync_fragments={frags} is more than the model's {len(model._gf_params)} trainable tensors (fragments "
            f"hold whole tensors). " + advise(({"sync_fragments": [len(model._gf_params)]}, []))
        )


def build(model: DistributedDataParallel) -> FewerSyncs | None:
    """The outer loop for ``model.config`` (``None`` at ``sync_every=1``: today's path, untouched)."""
    return FewerSyncs(model) if model.config.sync_every > 1 else None
