"""The top-k outer exchange (``outer_compression="indexed-topk-2bit"`` / ``"indexed-topk-3bit"``): each replica sends
its own top chunks of the pseudo-gradient, with their indices, in few-bit blocks; every replica decodes every message;
what a replica did not send stays in its own parameters.

Per rank, on its shard ``x`` (the pseudo-gradient divided by the replicas ``M``; on nodes of several ranks the
shard of :class:`.exchange.Average`):

1. each chunk of :data:`~gradientflow.outer_options.TOPK_CHUNK` elements of ``x`` (one quantiser block, one scale)
   scored by its L1; the top ``k = ceil(density * chunks)``, in index order;
2. the message: the ``k`` indices (int32), then the chunks' codes and bf16 scales (:func:`gradientflow.comm.quantize
   .quantize`), padded to 4 bytes; ``e := x - decoded(own message)``, what this replica keeps: an unsent chunk
   whole, a sent one its quantisation error;
3. one all-gather of the messages (``k`` is a function of the shard's size: one length on every rank);
4. the mean: every message decoded and added at its indices, in rank order, from zeros: the same bits on every rank.

Nothing is lost: summed over the replicas, ``sum_r e_r + mean == sum_r x_r`` up to fp32 rounding (the sender's
decoded values are the receivers': both decode the bf16 scale as sent).  The outer loop sets each replica to the new
synchronised parameters minus ``M e_r`` (:mod:`.loop`): the replica keeps its unsent drift in its parameters, and
its next pseudo-gradient, measured from the synchronised parameters, carries it again.  So no residual is stored
between syncs.

Why the unsent drift stays in the parameters, not in a residual beside parameters reset to the synchronised ones
(error feedback as the quantised exchange keeps it): a reset throws away, on every chunk no replica sent, the H
inner steps of every replica; they re-learn part of that drift, and the residual re-sends it syncs later on top.
Measured (docs/results/fewer-syncs.md, AdamW transformer, H = 30, density 0.1, 1,000 steps): 1.59x DDP's final
loss with the reset, against 1.05x for the 3-bit exchange, which sends every coordinate; the replicas keeping
their drift close most of that gap.

Why each replica picks its own chunks, not CSC's agreed ones: the per-step top-k recipes sum one fp32 score per chunk
first so that every rank sends the same chunks through an allreduce.  At an outer sync those scores alone would cost
4 bytes per 128 elements, more than the chunks they select at density 0.1 in 2 bits (0.1 x 34 bytes per 128).  Here
a chunk costs its index (4 bytes) only when it is sent.  The price: an all-gather, whose bytes grow with the number of
replicas (each receives ``M - 1`` messages), where an allreduce's do not; fewer syncs has few replicas (nodes).
SparseLoCo (arXiv 2508.15706) makes the same choice with single coordinates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_single
from ..comm.quantize import dequantize, quantize, wire_bytes
from ..diagnostics.watchdog import Watchdog
from ..exchange.selection import n_selected
from ..options_base import Quantizer

INDEX_BYTES = 4
"""A sent chunk's index: int32 (a shard of up to 2**31 chunks)."""


def message_layout(n: int, density: float, q: Quantizer) -> tuple[int, int]:
    """``(k, bytes)``: the chunks an ``n``-element shard (whole blocks) sends and its message's length (indices,
    codes, scales, padded to 4 bytes so that every message of an all-gather starts int32-aligned)."""
    k = n_selected(density, n // q.block)
    raw = INDEX_BYTES * k + wire_bytes(k * q.block, q.bits, q.block)
    return k, -(-raw // 4) * 4


def encode(v: torch.Tensor, density: float, q: Quantizer) -> torch.Tensor:
    """Steps 1-2 of the module docstring on ``v`` (fp32, 1-D, whole blocks): returns the message (uint8); ``v``
    becomes what is not delivered (``v`` minus the message decoded), in place: a sync holds no second copy."""
    k, length = message_layout(v.numel(), density, q)
    chunks = v.view(-1, q.block)
    # the chunks in index order: the receivers' index_add_ then writes rows in one sweep, and ties in the scores
    # go the same way on every rank's copy of the message
    # each chunk's L1 as one reduction: abs().sum(1) would hold a copy of the shard for the scores
    idx = torch.topk(torch.linalg.vector_norm(chunks, ord=1, dim=1), k, sorted=False).indices.sort().values
    rows = chunks.index_select(0, idx).reshape(-1)
    message = torch.zeros(length, dtype=torch.uint8, device=v.device)
    message[: INDEX_BYTES * k].view(torch.int32).copy_(idx)
    codes = message[INDEX_BYTES * k : INDEX_BYTES * k + wire_bytes(rows.numel(), q.bits, q.block)]
    err = torch.empty_like(rows)
    quantize(rows, codes, q.bits, q.block, err=err, levels=q.levels)
    chunks.index_copy_(0, idx, err.view(k, q.block))  # an unsent chunk stays whole, a sent one its quantisation error
    return message


def decode_sum(gathered: torch.Tensor, n: int, density: float, q: Quantizer, out: torch.Tensor) -> torch.Tensor:
    """Step 4: ``out`` (``n`` fp32) := the sum of every replica's decoded chunks, rank by rank from zeros."""
    k, length = message_layout(n, density, q)
    out.zero_()
    if not length:  # an empty shard (a rank of the node holding no row of the fragment's parameters): no message
        return out
    rows = out.view(-1, q.block)
    for r in range(gathered.numel() // length):
        message = gathered[r * length : (r + 1) * length]
        idx = message[: INDEX_BYTES * k].view(torch.int32).long()
        codes = message[INDEX_BYTES * k : INDEX_BYTES * k + wire_bytes(k * q.block, q.bits, q.block)]
        values = dequantize(codes, k * q.block, q.bits, q.block, q.levels)
        rows.index_add_(0, idx, values.view(k, q.block))  # one rank's indices are distinct: no two adds race
    return out


class TopChunks:
    """One top-k exchange posted: the message encoded, what this replica keeps (``kept``: ``e`` of step 2, ``x``
    itself, overwritten), and the all-gather started (:meth:`finish` waits)."""

    def __init__(self, x: torch.Tensor, density: float, q: Quantizer, group: dist.ProcessGroup, parties: int) -> None:
        self.n, self.density, self.q = x.numel(), density, q
        self.message = encode(x, density, q)
        self.kept = x  # now what this replica did not deliver
        self.gathered = torch.empty(parties * self.message.numel(), dtype=torch.uint8, device=x.device)
        self.work = all_gather_single(self.gathered, self.message, group=group, async_op=True)

    @property
    def payload_bytes(self) -> int:
        return self.message.numel()

    def finish(self, out: torch.Tensor, watchdog: Watchdog, what: str) -> torch.Tensor:
        """Wait for the all-gather (``CommunicationError`` past the timeout), then ``out`` := the sum."""
        watchdog.wait(self.work, what, self.gathered.numel())
        return decode_sum(self.gathered, self.n, self.density, self.q, out)
