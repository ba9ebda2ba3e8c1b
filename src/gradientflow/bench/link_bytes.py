"""The bytes that really crossed each node's link, from the kernel's counters, beside the engine's count.

On an emulated cluster every node is a network namespace whose only way out is one veth (its
"link"); the ranks of a node reach each other at the node's own address, which the kernel delivers
through the namespace's loopback, so only traffic between nodes is counted on the link.  A worker
reads ``/sys/class/net/<link>/statistics/{tx,rx}_bytes`` (inside its namespace, ``ip netns exec``
mounts that namespace's sysfs) between two barriers before a timed step (so that no node starts sending
before every node has read: a node leaving a barrier first would send into the other's "before" reading,
which undercounted a node's received bytes by 8% once) and right after a barrier that follows it: setup,
warm-up and the other modes' steps fall outside, and what is left is the step's traffic plus the
barriers' few hundred bytes, headers and ACKs included (the
kernel counts frames, not payload).  The engine's own count is ``comm_stats()['payload_bytes']`` (and
``inter_node_bytes`` where the engine reports it) summed over the node's ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

NODE_ENV = "GF_BENCH_NODE"
"""Set for every rank of a launch of nodes: the node (namespace) its torchrun runs on.  With c10d the
node ranks are handed out in the order the nodes join, so a rank's group rank does not say which
namespace it is in; the link counters are read per namespace."""
LINK_ENV = "GF_BENCH_LINK"
"""Set on an emulated cluster: the node's link interface, whose kernel counters the workers read."""
ENGINE_KEYS = ("payload_bytes", "inter_node_bytes")
"""The engine's byte counters summed per node (``inter_node_bytes`` only where ``comm_stats()`` has it)."""


class LinkCounter:
    """The transmit and receive byte counters of one interface of this process's network namespace."""

    def __init__(self, ifname: str, root: Path = Path("/sys/class/net")) -> None:
        self.ifname = ifname
        self._tx = root / ifname / "statistics" / "tx_bytes"
        self._rx = root / ifname / "statistics" / "rx_bytes"
        if not self._tx.exists():
            raise ValueError(f"no interface {ifname!r} in this network namespace ({self._tx} is missing)")

    @classmethod
    def from_env(cls) -> LinkCounter | None:
        """The counter of the link named by :data:`LINK_ENV`, or None (loopback: no link to count)."""
        name = os.environ.get(LINK_ENV)
        return cls(name) if name else None

    def read(self) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) now."""
        return int(self._tx.read_text()), int(self._rx.read_text())


def open_window(link: LinkCounter | None, counted: bool) -> tuple[int, int] | None:
    """Before a timed step: a barrier, this node's counters, and where links are counted a second barrier, so that
    no node sends the step's first byte before every node has read (a node leaving the first barrier early would
    send into the other's reading).  Every rank calls it, with the same ``counted``."""
    import torch.distributed as dist

    dist.barrier()
    before = link.read() if link else None
    if counted:
        dist.barrier()
    return before


def close_window(link: LinkCounter | None, counted: bool, before: tuple[int, int] | None) -> list[int] | None:
    """After the step: where links are counted, a barrier (then every node's step is done and the link carried all
    of its bytes) and this node's ``[tx, rx]`` since :func:`open_window`; ``None`` where nothing is counted."""
    import torch.distributed as dist

    if not counted:
        return None
    dist.barrier()
    return [b - a for a, b in zip(before, link.read())] if link and before else None


def node_of_rank() -> int:
    """This rank's node: :data:`NODE_ENV` where the launch set it, else 0 (one torchrun, one node)."""
    return int(os.environ.get(NODE_ENV, "0"))


def per_node(ranks: list[dict[str, Any]], where: list[int], n: int) -> list[dict[str, Any]]:
    """One variant's per-node series over its first ``n`` steps.

    ``ranks``: the variant's record of each rank (``link``: per step ``[tx, rx]`` or None, read by the
    node's local rank 0 alone; ``stats``: per step the engine's counters); ``where``: each rank's node.
    Per node: ``tx_bytes`` / ``rx_bytes`` per step (None off an emulated cluster) and each of
    :data:`ENGINE_KEYS` summed over the node's ranks (None where a rank lacks it)."""
    out = []
    for node in sorted(set(where)):
        mine = [r for r, w in zip(ranks, where) if w == node]
        links = [r["link"] for r in mine if r.get("link")]
        rec: dict[str, Any] = {"node": node, "ranks": len(mine)}
        rec["tx_bytes"] = [links[0][s][0] for s in range(n)] if links and len(links[0]) >= n else None
        rec["rx_bytes"] = [links[0][s][1] for s in range(n)] if links and len(links[0]) >= n else None
        for key in ENGINE_KEYS:
            have = all(len(r["stats"]) >= n and all(key in st for st in r["stats"][:n]) for r in mine)
            rec[key] = [sum(r["stats"][s][key] for r in mine) for s in range(n)] if have and n else None
        out.append(rec)
    return out


def _median(xs: list[float] | None) -> float | None:
    return float(np.median(np.asarray(xs))) if xs else None


def link_summary(nodes: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A report row's link fields: per node the medians per step (``link_nodes``), and over the nodes the
    largest of each (``link_tx_bytes``, ``link_rx_bytes``, ``node_payload_bytes``, ``node_inter_node_bytes``):
    the busiest link is the one that sets the pace.  Empty without per-node data."""
    if not nodes:
        return {}
    rows = [
        {
            "node": rec["node"],
            "ranks": rec["ranks"],
            "tx_bytes": _median(rec.get("tx_bytes")),
            "rx_bytes": _median(rec.get("rx_bytes")),
            "payload_bytes": _median(rec.get("payload_bytes")),
            "inter_node_bytes": _median(rec.get("inter_node_bytes")),
        }
        for rec in nodes
    ]

    def most(key: str) -> float | None:
        vals = [r[key] for r in rows if r[key] is not None]
        return max(vals) if vals else None

    return {
        "link_nodes": rows,
        "link_tx_bytes": most("tx_bytes"),
        "link_rx_bytes": most("rx_bytes"),
        "node_payload_bytes": most("payload_bytes"),
        "node_inter_node_bytes": most("inter_node_bytes"),
    }
