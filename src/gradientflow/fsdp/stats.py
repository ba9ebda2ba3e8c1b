"""What crossed between nodes: per module and exchange (:class:`ExchangeCounters`), summed over a model
(:func:`comm_stats`).

Bytes as the DDP wrapper counts them (:class:`gradientflow.diagnostics.stats.StepStats`): ``payload_bytes``, one
copy of the exchanged shards in their wire format (what the exchange hands to the backend); ``dense_bytes``, the
same shards in fp32 (what torch's HSDP hands over with an fp32 ``reduce_dtype``); ``sent_bytes``, what this rank
put on the link between nodes (the quantised exchange counts its messages; a dense all-reduce is counted as a
ring's ``2 (M-1)/M`` of its payload), and ``dense_sent_bytes``, a dense fp32 ring's.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch.nn as nn

from .counters import Counts, comms
from .outer import outer_of


def comm_stats(model: nn.Module, total: bool = False) -> dict[str, Any]:
    """The counters of the last exchange of every module of ``model`` (``total=True``: summed since construction),
    added up: one optimizer step's traffic between nodes when each module exchanged once; with the recipe each
    module runs (``compression``: one name, or a sorted list where they differ; under ``"auto"``
    ``compression_auto``: why it runs that), the mesh (``nodes``,
    ``ranks_per_node``), ``held_micro_steps`` (reduce-scatters kept for a later exchange) and ``state_bytes`` (what
    the recipes hold between steps on this rank: residuals, ``q``, held shards).  With ``sync_every > 1``
    (:mod:`.outer`) also the outer loop's keys, as the DDP wrapper's ``comm_stats()`` names them
    (``outer_payload_bytes``, ``outer_inter_node_bytes``, ``outer_state_bytes``: this rank's anchor, momentum and
    residual shards, ...), its bytes since construction whatever ``total``; ``payload_bytes`` and ``sent_bytes`` are
    then the outer syncs' (the last step's, or every one's with ``total``) and ``dense_bytes`` torch HSDP's over the
    same steps, as the DDP wrapper counts them."""
    found = list(comms(model))
    if not found:
        raise ValueError(
            "gradientflow.fsdp.comm_stats: no module of this model was sharded by gradientflow.fsdp.fully_shard"
        )
    out = Counts()
    for _, comm in found:
        out.add(comm.counters.total if total else comm.counters.last)
    recipes = sorted({comm.recipe for _, comm in found})
    first = found[0][1]
    # "auto": what it picked and why, as the DDP wrapper's comm_stats() says (every module switches alike: one reason)
    why = sorted({comm.auto_reason for _, comm in found if comm.requested == "auto"})
    reason = {"compression_auto": why[0] if len(why) == 1 else why} if why else {}
    loop = outer_of([comm for _, comm in found])  # sync_every > 1: the outer keys, the DDP wrapper's names
    if loop is not None:  # between nodes only the outer syncs: theirs are the bytes to the exchange between nodes
        sent = loop.loop.sent if total else loop.loop.last
        out.payload_bytes, out.sent_bytes = sent.payload, sent.inter
        out.dense_bytes = loop.dense_bytes * (loop.loop.steps_here if total else 1)  # torch HSDP's, same steps
    return {
        **reason,
        **(loop.stats() if loop is not None else {}),
        **asdict(out),
        "held_micro_steps": sum(comm.counters.held for _, comm in found),
        "state_bytes": sum(comm.state_bytes() for _, comm in found),
        "compression": recipes[0] if len(recipes) == 1 else recipes,
        "nodes": first.mesh.nodes,
        "ranks_per_node": first.mesh.per_node,
    }
