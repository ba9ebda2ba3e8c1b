"""The wrapper's own process groups beside the user's: CSC's control group, a compressed recipe's exchange group
and two-level's node groups.

Each is created once per wrapper (kept across engine rebuilds: ``.to()``, ``compression="auto"``)
and held by weak reference: torch's registry owns a group, so ``destroy_process_group()`` really
frees it (a group kept alive past that by a stray reference is torn down at interpreter exit, where
Gloo can abort the process).  Only a group's members take part in creating it
(``use_local_synchronization``); every rank creates its groups in the same order, so the names torch
derives for groups over the same ranks agree between the members.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from typing import Any

import torch.distributed as dist

from ..comm.collectives import as_member
from ..comm.topology import Topology, resolve_topology
from ..comm.two_level import NodeGroups
from ..config import GradientFlowConfig

logger = logging.getLogger(__name__)

DistributedDataParallel = Any
"""The wrapper (not imported: ddp imports this module)."""


def resolve_layout(config: GradientFlowConfig, group: dist.ProcessGroup) -> Topology:
    """The node layout ``config.topology`` means for ``group`` (torchrun's variables for ``"auto"``).

    ``"auto"`` reads the layout only for the default (whole-world) group: torchrun's variables describe
    the world's ranks, so a user's subgroup stays flat under ``"auto"`` (name it with ``"MxG"``, which
    counts the subgroup's own ranks).  ``ValueError`` (raised on every rank by the construction
    exchange) for a layout that cannot hold.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    whole = world == dist.get_world_size()
    return resolve_topology(config.topology, world, rank, os.environ, whole)


def between_nodes(config: GradientFlowConfig, group: dist.ProcessGroup) -> bool:
    """Whether the wrapper's waits include exchanges between nodes, where ``timeout=None`` is at most 5 minutes
    (:data:`gradientflow.diagnostics.watchdog.BETWEEN_NODES_TIMEOUT`): an outer sync (``sync_every > 1``, built for
    replicas on other machines) or nodes of several ranks.  A layout that cannot hold counts as flat here: the
    construction exchange raises its ``ValueError`` on every rank right after."""
    if config.sync_every > 1:
        return True
    try:
        return resolve_layout(config, group).two_level
    except ValueError:
        return False


def resolved_topology(config: GradientFlowConfig, group: dist.ProcessGroup) -> GradientFlowConfig:
    """``config`` with ``topology`` resolved to ``"flat"`` or ``"MxG"``: what ``model.config.topology`` shows
    and what the construction exchange compares across ranks (so ranks that resolved different layouts
    raise there, on every rank)."""
    return dataclasses.replace(config, topology=resolve_layout(config, group).name)


def layout_stats(model: DistributedDataParallel) -> dict[str, int | str]:
    """For ``comm_stats()``: the resolved layout (flat counts every rank as its own node); the name ``topology``
    only when two-level, so a flat run's counters stay all numbers (as ``compression`` is left out for "none")."""
    topo = resolve_layout(model.config, model.process_group)
    out: dict[str, int | str] = {"nodes": topo.nodes, "ranks_per_node": topo.per_node}
    if topo.two_level:
        out["topology"] = topo.name
    return out


def control_group(model: DistributedDataParallel) -> dist.ProcessGroup:
    """A second group over the same ranks for CSC's score exchanges and the "used" exchange.

    On one group, a backend runs collectives one after another: a few-KB score allreduce would queue
    behind the previous slice's megabytes of chunks, and backward would stall waiting for it.
    """
    return _own_group(model, "_gf_control")


def exchange_group(model: DistributedDataParallel) -> dist.ProcessGroup:
    """A third group over the same ranks, the wrapper's own, for a compressed recipe's exchanges.

    CSC starts a slice's chunks when its scores have arrived, and the quantised ring posts a round when the
    last one has arrived: moments that differ from rank to rank.  On the user's group, another model's
    collectives (two wrapped models in one backward: CLIP's two towers, an encoder and a decoder wrapped
    apart) would then be issued before them on one rank and after them on another, and a backend matches
    collectives and point-to-point messages by the order they were issued (Gloo: "Received data size
    doesn't match", or a hang).  On a group of its own a wrapper's exchanges are ordered among themselves only.
    """
    return _own_group(model, "_gf_exchange")


def sync_group(model: DistributedDataParallel) -> dist.ProcessGroup:
    """The group the wrapper's strategy synchronises on: its exchange group under a compressed recipe (CSC, the
    quantised ones) on a flat layout, else the user's: dense collectives are issued from autograd's hooks, as torch
    DDP's, and two-level synchronisation sends on the node groups (the wrapper's own already)."""
    flat = not resolve_layout(model.config, model.process_group).two_level
    return exchange_group(model) if model.config.needs_control_group and flat else model.process_group


def _own_group(model: DistributedDataParallel, attr: str) -> dist.ProcessGroup:
    """The wrapper's group ``attr`` over its process group's ranks, created once (every rank, in the same order)."""
    ref = model.__dict__.get(attr)
    group = ref() if ref is not None else None
    if group is None:
        ranks = dist.get_process_group_ranks(model.process_group)
        group = _new_group(model, ranks)
        setattr(model, attr, weakref.ref(group))
    return group


def _new_group(model: DistributedDataParallel, ranks: list[int]) -> dist.ProcessGroup:
    """A group over ``ranks`` (this rank among them), returned on no member before every member has joined it.

    Gloo connects a new group's pairs eagerly, and ``new_group`` returns on a rank once *its* ends are
    connected: a peer may still be finishing its handshake.  A rank that then destroys its groups or
    exits (a script that only builds the model; the first outer sync H steps away, so nothing else waits)
    closes the socket under that peer, which fails with "connectFullMesh failed: Connection closed by
    peer" (seen in this suite, 3 launches in 40 under load).  So each member counts itself in the
    group's store once back from ``new_group`` and waits, under the wrapper's timeout, for every member's
    count: a barrier through the store (as torch's own after ``new_group`` with
    ``TORCH_DIST_INIT_BARRIER=1``), not a collective on the new group, which would add its traffic to
    the group's first moments.  NCCL's communicators connect at their first collective: left to it.
    """
    group = as_member(dist.new_group(ranks, timeout=model._gf_watchdog.timeout, use_local_synchronization=True), ranks)
    if "gloo" in str(dist.get_backend(group)):
        _joined(group, len(ranks), model._gf_watchdog.timeout.total_seconds())
    return group


def _joined(group: dist.ProcessGroup, members: int, timeout_s: float) -> None:
    """Wait until every one of the group's ``members`` has counted itself in (``RuntimeError`` after ``timeout_s``).

    The count only grows: a later group that gets this one's name (torch names groups by their ranks, and a
    name is free again once its group is destroyed) waits for the next multiple of ``members``.
    """
    from torch.distributed.distributed_c10d import _get_process_group_store  # noqa: PLC0415

    store = _get_process_group_store(group)
    key = "gradientflow/joined"
    arrived = store.add(key, 1)
    target = -(-arrived // members) * members  # every member of this generation
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while arrived < target:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"gradientflow: {target - arrived} of the {members} members of a new process group did not join it "
                f"within the timeout of {timeout_s:g} s: a rank stalled or died while building the model. "
                "Restart the job."
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
        arrived = store.add(key, 0)


def node_groups(model: DistributedDataParallel) -> NodeGroups | None:
    """Two-level's groups for ``model.config.topology`` (resolved), ``None`` when it is flat.

    Three groups per rank, one per stage (:mod:`gradientflow.comm.two_level`): the reduce-scatter and
    the all-gather over the ranks of its node, and the exchange between nodes over the ranks with its
    local index.
    """
    topo = resolve_layout(model.config, model.process_group)
    if not topo.two_level:
        return None
    refs = model.__dict__.get("_gf_node_groups")
    held = [r() for r in refs[1:]] if refs is not None and refs[0] == topo else []
    if len(held) != 3 or any(g is None for g in held):
        ranks = dist.get_process_group_ranks(model.process_group)
        rank = dist.get_rank(model.process_group)
        g, node, local = topo.per_node, topo.node_of(rank), topo.local_of(rank)
        mine = ranks[node * g : (node + 1) * g]
        across = [ranks[n * g + local] for n in range(topo.nodes)]
        held = [_new_group(model, r) for r in (mine, mine, across)]
        model._gf_node_groups = (topo, *(weakref.ref(h) for h in held))
        logger.info("gradientflow: two-level synchronisation, %s (node %d, local rank %d)", topo.name, node, local)
    rank = dist.get_rank(model.process_group)
    rs, ag, inter = held
    assert rs is not None and ag is not None and inter is not None
    return NodeGroups(topo, topo.local_of(rank), topo.node_of(rank), rs, ag, inter, timeout=model._gf_watchdog.timeout)
