"""The outer exchange: the pseudo-gradient averaged across the replicas, dense or quantised with error feedback.

A replica is a node (ranks inside a node hold the same parameters: their gradients are averaged densely every
step) or, on a flat layout, a rank.  The pseudo-gradient is the same on every rank of a node, so no rank sends
its node's copy twice: local rank l exchanges only shard l (``ceil(n / G)`` elements; whole quantisation blocks
for the quantised exchange) with the ranks of local index l on the other nodes, then the node's ranks all-gather
the averaged shards.  Between nodes goes one copy of the pseudo-gradient per node, in the recipe's bytes.

- dense (``"none"``: fp32, ``"fp16"``, ``"bf16"``): a SUM allreduce of ``x / M`` in the wire dtype;
- quantised (``"3bit"``, any width of the family): :class:`gradientflow.comm.quantized_ring.QuantizedRing` with
  ``carry=True``, its residual kept per fragment (per rank: its shard's) between outer syncs, so what one sync
  did not send is added to the next: summed over replicas, residuals plus ``M`` times the average equal the sum
  of the contributions.

Nothing persistent changes unless the exchange completed: the ring writes a copy of the residual, which
replaces it only at the end (a rank lost mid-exchange leaves every rank's state as before the sync).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_single, start_allreduce
from ..comm.quantized_ring import QuantizedRing
from ..config import OuterExchange
from ..diagnostics.watchdog import Watchdog


@dataclass
class Sent:
    """One exchange's bytes: ``payload`` handed to the exchange between replicas (as ``payload_bytes`` counts),
    ``inter`` sent by this rank to other replicas (as ``inter_node_bytes`` counts), ``intra`` sent inside its node."""

    payload: int = 0
    inter: int = 0
    intra: int = 0


class Average:
    """``average(x, f)``: ``x`` (fp32, 1-D, the same on every rank of a node) becomes its mean over the replicas.

    ``group``: the replicas' group (flat: every rank; nodes: the ranks of this local index); ``node``: the node's
    group for the all-gather (``None``: one rank per replica), ``local`` / ``per_node`` this rank's index in it
    and its size."""

    def __init__(
        self,
        spec: OuterExchange,
        group: dist.ProcessGroup,
        watchdog: Watchdog,
        fragments: int,
        node: dist.ProcessGroup | None = None,
        local: int = 0,
        per_node: int = 1,
    ) -> None:
        self.spec, self.group, self.watchdog, self.node = spec, group, watchdog, node
        self.local, self.per_node = local, per_node
        self.parties = dist.get_world_size(group)
        self.residuals: list[torch.Tensor | None] = [None] * fragments  # the quantised exchange's, per fragment

    def shard(self, n: int) -> int:
        """Elements of this rank's shard of an ``n``-element fragment (whole blocks when quantised)."""
        unit = self.spec.quantizer.block if self.spec.quantizer is not None else 1
        units = -(-n // unit)
        return -(-units // self.per_node) * unit

    def average(self, x: torch.Tensor, fragment: int, what: str) -> tuple[Sent, torch.Tensor | None]:
        """``x`` in place: its mean over the replicas.  Returns the bytes and the fragment's new residual (quantised;
        ``None`` for dense), which the caller installs with :meth:`commit` once everything else succeeded."""
        n = x.numel()
        s = self.shard(n)
        full = x
        if s * self.per_node != n:  # padded to whole shards: the pad is zeros on every rank, sums to zeros
            full = torch.zeros(s * self.per_node, dtype=x.dtype, device=x.device)
            full[:n].copy_(x)
        mine = full[self.local * s : (self.local + 1) * s]
        sent = Sent()
        residual = None
        if self.spec.quantizer is None:
            self._dense(mine, what, sent)
        else:
            residual = self._quantized(mine, fragment, what, sent)
        if self.node is not None:
            gathered = torch.empty_like(full)
            work = all_gather_single(gathered, mine.clone(), group=self.node, async_op=True)
            self.watchdog.wait(work, f"{what}: all-gather inside the node", s * 4)
            sent.intra += (self.per_node - 1) * s * 4
            full = gathered
        if full is not x:
            x.copy_(full[:n])
        return sent, residual

    def commit(self, fragment: int, residual: torch.Tensor | None) -> None:
        if residual is not None:
            self.residuals[fragment] = residual

    def _dense(self, mine: torch.Tensor, what: str, sent: Sent) -> None:
        dtype = self.spec.wire_dtype
        wire = mine.div(self.parties) if dtype is None else mine.div(self.parties).to(dtype)
        start_allreduce(wire, group=self.group, watchdog=self.watchdog, what=what).wait()
        mine.copy_(wire)
        nbytes = wire.numel() * wire.element_size()
        sent.payload += nbytes
        sent.inter += 2 * (self.parties - 1) * nbytes // self.parties  # a ring allreduce's share per rank

    def _quantized(self, mine: torch.Tensor, fragment: int, what: str, sent: Sent) -> torch.Tensor:
        q = self.spec.quantizer
        assert q is not None
        old = self.residuals[fragment]
        err = torch.zeros_like(mine) if old is None else old.clone()  # the old one stays until commit()
        x = mine.div(self.parties)
        t0 = time.perf_counter()
        ring = QuantizedRing(
            x, err, self.group, bits=q.bits, block=q.block, timeout=self.watchdog.timeout, levels=q.levels, carry=True
        )
        try:
            ring.wait()
        except RuntimeError as exc:
            raise self.watchdog.failure(what, ring.payload_bytes, exc, time.perf_counter() - t0) from exc
        mine.copy_(x)
        sent.payload += ring.payload_bytes if self.parties > 1 else 0
        sent.inter += ring.sent_bytes
        return err
