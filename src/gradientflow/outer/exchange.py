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
  of the contributions;
- top-k (``"indexed-topk-2bit"``, ``"indexed-topk-3bit"``): :class:`.sparse.TopChunks`, each replica's own top chunks
  with their indices in few-bit blocks, all-gathered; what a replica did not deliver (``kept``, in the parameters'
  units: ``M`` times the exchange's ``e``, gathered inside the node like the mean) is returned, not stored: the outer
  loop leaves it in the replica's parameters (:mod:`.sparse` says why), so nothing stays between syncs.

Nothing persistent changes unless the exchange completed: the ring writes a copy of the residual, which
replaces it only at the end (a rank lost mid-exchange leaves every rank's state as before the sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import mechanisms
from ..comm.collectives import PendingAllreduce, all_gather_single, start_allreduce
from ..diagnostics.watchdog import Watchdog
from ..exchange import error_feedback
from ..exchange.quantized import QuantizedExchange
from ..exchange.ring import Ring
from ..outer_options import OuterExchange
from .sparse import TopChunks


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
    and its size; ``parties``: the divisor ``M`` (the group's size unless given)."""

    def __init__(
        self,
        spec: OuterExchange,
        group: dist.ProcessGroup,
        watchdog: Watchdog,
        fragments: int,
        node: dist.ProcessGroup | None = None,
        local: int = 0,
        per_node: int = 1,
        parties: int | None = None,
    ) -> None:
        self.spec, self.group, self.watchdog, self.node = spec, group, watchdog, node
        self.local, self.per_node = local, per_node
        # M, the replicas whose pseudo-gradients are averaged: the group's size, or fewer where some send zeros
        # (a replica that joined at this sync: :mod:`.membership`)
        self.parties = parties if parties is not None else dist.get_world_size(group)
        self.residuals: list[torch.Tensor | None] = [None] * fragments  # the quantised exchange's, per fragment
        # the quantised exchange (its quantiser; no warm-up, no preconditioner: the outer rows have neither)
        self.quantized = QuantizedExchange(spec.quantizer, group, watchdog) if spec.quantizer is not None else None
        self.form: type[Flight] = mechanisms.builder(spec.mechanism, "outer")  # a Flight class: the mechanism's form

    def shard(self, n: int) -> int:
        """Elements of this rank's shard of an ``n``-element fragment (whole blocks when quantised)."""
        unit = self.spec.quantizer.block if self.spec.quantizer is not None else 1
        units = -(-n // unit)
        return -(-units // self.per_node) * unit

    @property
    def keeps_unsent(self) -> bool:
        """The top-k exchange: the second value :meth:`average` returns is what this replica did not deliver, for
        its parameters (:meth:`commit` stores nothing of it)."""
        return self.form.keeps_unsent

    def average(self, x: torch.Tensor, fragment: int, what: str) -> tuple[Sent, torch.Tensor | None]:
        """``x`` in place: its mean over the replicas (should it raise, ``x`` is left divided or half-exchanged: the
        caller's scratch, never its state).  Returns the bytes and the fragment's new residual (quantised;
        ``None`` for dense), which the caller installs with :meth:`commit` once everything else succeeded; for the
        top-k exchange (:attr:`keeps_unsent`) instead what this replica did not deliver, ``x``'s length."""
        return self.start(x, fragment, what).finish()

    def start(self, x: torch.Tensor, fragment: int, what: str) -> Flight:
        """Post the exchange between replicas of ``x`` and return without waiting (streaming's overlap): the
        :class:`Flight` finishes it, and only then is ``x`` the mean (the all-gather inside the node, on nodes of
        several ranks, is posted by :meth:`Flight.finish`, a step every rank of the node reaches in the same order).
        Until then ``x`` is the exchange's working buffer: not to be read or written."""
        return self.form(self, x, fragment, what)

    def commit(self, fragment: int, residual: torch.Tensor | None) -> None:
        if residual is not None and not self.keeps_unsent:
            self.residuals[fragment] = residual


class Flight:
    """One outer exchange posted between the replicas, not finished: :meth:`poll` advances it without blocking,
    :meth:`finish` waits for it, all-gathers the averaged shards inside the node and writes the mean into ``x``.
    Nothing of the exchange's state (the residual) changes before :meth:`Average.commit`.

    The base holds what every mechanism shares (this rank's shard of ``x``, padded to whole shards; the bytes; the
    all-gather inside the node); each mechanism's outer form (:mod:`gradientflow.mechanisms`, door ``"outer"``) is a
    subclass that posts its exchange of :attr:`mine` in :meth:`post` and completes it in :meth:`complete`."""

    keeps_unsent = False
    """Whether :meth:`finish`'s second value is what this replica did not deliver (kept in its parameters) rather
    than a residual to commit."""

    def __init__(self, avg: Average, x: torch.Tensor, fragment: int, what: str) -> None:
        self.avg, self.x, self.what = avg, x, what
        n = x.numel()
        self.s = s = avg.shard(n)
        self.full = x
        if s * avg.per_node != n:  # padded to whole shards: the pad is zeros on every rank, sums to zeros
            self.full = torch.zeros(s * avg.per_node, dtype=x.dtype, device=x.device)
            self.full[:n].copy_(x)
        self.mine = self.full[avg.local * s : (avg.local + 1) * s]
        self.sent = Sent()
        self.err: torch.Tensor | None = None
        self.post(fragment)

    def post(self, fragment: int) -> None:
        """Post the exchange of :attr:`mine` between the replicas (the mechanism's)."""
        raise NotImplementedError

    def poll(self) -> None:
        """Advance the exchange's rounds that can go (never blocks; a dense allreduce runs by itself)."""

    def complete(self) -> None:
        """Wait for the exchange (bounded by the watchdog's timeout: ``CommunicationError`` naming the peer) and
        leave the mean of this rank's shard in :attr:`mine` (the mechanism's)."""
        raise NotImplementedError

    def finish(self) -> tuple[Sent, torch.Tensor | None]:
        """Wait for the exchange, then the all-gather inside the node; ``x`` is then the mean.  Returns the bytes and
        the new residual (top-k: what this replica did not deliver, :meth:`Average.average`)."""
        self.complete()
        return self.gathered()

    def gathered(self) -> tuple[Sent, torch.Tensor | None]:
        """After :meth:`complete`: the all-gather inside the node, ``x`` the mean; what :meth:`finish` returns.  Apart
        from it for replicas that come and go (:mod:`.membership`): every rank of a replica of several ranks decides
        whether the sync is applied (torchft's ``should_commit``) between the two, so that none of them waits in the
        all-gather for a rank whose exchange between replicas failed."""
        n, sent = self.x.numel(), self.sent
        full = self.full if self.avg.node is None else self._gather(self.mine, "the mean", sent)
        if full is not self.x:
            self.x.copy_(full[:n])
        return sent, self.err

    def _gather(self, shard: torch.Tensor, name: str, sent: Sent) -> torch.Tensor:
        """This rank's ``shard`` (fp32) all-gathered inside the node, the ranks' in local order (``shard`` itself
        without a node group)."""
        avg = self.avg
        if avg.node is None:
            return shard
        gathered = torch.empty(shard.numel() * avg.per_node, dtype=shard.dtype, device=shard.device)
        work = all_gather_single(gathered, shard, group=avg.node, async_op=True)  # a view is read, never written
        avg.watchdog.wait(work, f"{self.what}: all-gather of {name} inside the node", shard.numel() * 4)
        sent.intra += (avg.per_node - 1) * shard.numel() * 4
        return gathered


@mechanisms.form("dense", "outer")
class DenseFlight(Flight):
    """A SUM allreduce of ``x / M`` in the row's wire dtype."""

    def post(self, fragment: int) -> None:
        avg, dtype = self.avg, self.avg.spec.wire_dtype
        # divided in place: ``mine`` is the caller's pseudo-gradient, which finish() overwrites with the mean anyway
        self.wire = self.mine.div_(avg.parties) if dtype is None else self.mine.div_(avg.parties).to(dtype)
        self.work: PendingAllreduce = start_allreduce(self.wire, group=avg.group, watchdog=avg.watchdog, what=self.what)
        nbytes = self.wire.numel() * self.wire.element_size()
        self.sent.payload += nbytes
        self.sent.inter += 2 * (avg.parties - 1) * nbytes // avg.parties  # a ring allreduce's share per rank

    def complete(self) -> None:
        self.work.wait()
        self.mine.copy_(self.wire)


@mechanisms.form("quantized", "outer")
class QuantizedOuterFlight(Flight):
    """The quantised exchange (:class:`gradientflow.exchange.quantized.QuantizedExchange`) of ``x / M`` with the
    fragment's residual carried; the new residual is a copy, installed by :meth:`Average.commit`."""

    def post(self, fragment: int) -> None:
        avg = self.avg
        assert avg.quantized is not None
        old = avg.residuals[fragment]
        self.err = error_feedback.zeros_like(self.mine) if old is None else old.clone()  # old stays until commit()
        self.wire = self.mine.div_(avg.parties)  # in place: one copy of the fragment less while a sync runs
        self.ring: Ring = avg.quantized.start(self.wire, self.err, self.what)

    def poll(self) -> None:
        self.ring.poll()  # a failure is named by the exchange (gradientflow.exchange.ring)

    def complete(self) -> None:
        avg = self.avg
        self.ring.wait()
        self.ring.complete()
        self.sent.payload += self.ring.payload_bytes if avg.parties > 1 else 0
        self.sent.inter += self.ring.sent_bytes
        self.mine.copy_(self.wire)


@mechanisms.form("indexed-topk", "outer")
class TopkFlight(Flight):
    """Each replica's own top chunks (:class:`.sparse.TopChunks`); what it did not deliver is handed back for its
    parameters (:attr:`keeps_unsent`)."""

    keeps_unsent = True

    def post(self, fragment: int) -> None:
        avg = self.avg
        q, density = avg.spec.quantizer, avg.spec.density
        assert q is not None and density is not None
        self.pair: torch.Tensor | None = None  # on a node: [the mean, what stays], this rank's shard of each
        # the scaled shard becomes what stays (encoded in place); on a node it is the second row of the pair
        # the node's ranks all-gather at the end, the mean the first: one round, no copy to build the pair
        if avg.node is None:
            scaled = self.mine.div(avg.parties)
        else:
            self.pair = torch.empty(2, self.s, dtype=self.x.dtype, device=self.x.device)
            scaled = torch.div(self.mine, avg.parties, out=self.pair[1])
        self.topk: TopChunks | None = TopChunks(scaled, density, q, avg.group, avg.parties)

    def complete(self) -> None:
        avg, sent, topk = self.avg, self.sent, self.topk
        assert topk is not None
        topk.finish(self.mine if self.pair is None else self.pair[0], avg.watchdog, self.what)
        sent.payload += topk.payload_bytes if avg.parties > 1 else 0
        sent.inter += (avg.parties - 1) * topk.payload_bytes  # its message to each other replica
        topk.kept.mul_(avg.parties)  # what stays, in the parameters' units (on a node: the pair's row 1)

    def gathered(self) -> tuple[Sent, torch.Tensor | None]:
        avg, sent, topk = self.avg, self.sent, self.topk
        assert topk is not None
        n = self.x.numel()
        if self.pair is None:
            kept = topk.kept
        else:  # the mean and what stays, gathered inside the node: rank l's at [l, 0], [l, 1]
            pairs = self._gather(self.pair.view(-1), "the mean and what stays", sent).view(avg.per_node, 2, self.s)
            self.pair = self.topk = topk = None  # this rank's pair is in ``pairs`` now: freed before the copy below
            self.full.view(avg.per_node, self.s).copy_(pairs[:, 0])
            kept = pairs[:, 1].reshape(-1)
        self.err = kept[:n]
        if self.full is not self.x:
            self.x.copy_(self.full[:n])
        return sent, self.err
