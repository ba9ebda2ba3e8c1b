"""The top-k recipes (``"topk-fp16"``, ``"topk-3bit"``) on one FSDP module's gradient shard: CSC between nodes.

DDP's CSC (:mod:`gradientflow.strategies.csc`) cuts the whole gradient pool into chunks; here the pool is this
rank's shard of the module (the reduce-scatter's output inside the node), and the ranks holding the same shard on
the other nodes (the mesh's ``replicate`` group) pick the same chunks of it.  Per exchange:

1. ``v += t / M``: the node's contribution joins the residual (fp32, the shard padded to whole chunks), which holds
   every chunk not sent yet;
2. the L1 norm of each chunk of ``v`` (:func:`~gradientflow.exchange.selection.chunk_scores`), SUM-all-reduced
   over the nodes, and the top ``ceil(density * chunks)`` of them, the same on every node
   (:func:`~gradientflow.exchange.selection.select_chunks`); chunks holding a 1-D parameter (biases, norms: a few
   elements that move every step) are always among them, as DDP's ``dense_1d``;
3. the selected rows of ``v``: ``"topk-fp16"`` casts them to fp16 and all-reduces (the rounding stays in ``v``),
   ``"topk-3bit"`` sends them through the quantised exchange (:class:`~gradientflow.comm.quantized_ring.
   QuantizedRing`, error feedback: each row's quantisation error stays in ``v``);
4. the shard gets the summed rows and zeros elsewhere; the sent rows of ``v`` keep only what the wire lost.

Nothing is lost, only delayed: summed over the nodes, ``sum(v before) + sum(t / M) == result + sum(v after)``, to
fp32 rounding.  The density ramps from dense as DDP's does (:func:`~gradientflow.exchange.selection.density_at`
over ``warmup_steps``); a step of the ramp that would be no fewer bytes than a dense one is sent dense (the wire
dtype's all-reduce, ``v`` untouched).  The optimizer's own momentum is kept (no momentum correction: the
recommended recipe, as for DDP).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config import GradientFlowConfig
from ..diagnostics.watchdog import Watchdog
from ..exchange import error_feedback
from ..exchange.quantized import QuantizedExchange
from ..exchange.selection import chunk_scores, dense_from, density_at, n_selected, select_chunks
from .exchange import Finish, Sent, clean_state, on_default_stream, post_dense, rescale_state, ring_allreduce_bytes


def forced_chunks(sizes: list[tuple[int, bool]], chunk_size: int, n_chunks: int) -> torch.Tensor:
    """The chunks sent every step: those holding any element of a 1-D parameter.  ``sizes``: each parameter's
    (elements of its padded dim-0 shard, whether it is 1-D), in the shard's order (torch's reduce-scatter layout)."""
    forced = torch.zeros(n_chunks, dtype=torch.bool)
    start = 0
    for numel, one_d in sizes:
        if one_d and numel:
            forced[start // chunk_size : -(-(start + numel) // chunk_size)] = True
        start += numel
    return forced


class TopkShard:
    """The top-k recipe's state on this rank's shard of one module: the residual ``err`` (``v``, fp32, padded to whole
    chunks; in units of the contribution ``t / M``) and the count of exchanges (the density ramp's).  ``sq`` is
    always ``None`` (no preconditioner: the checkpoint's contract with :class:`.exchange.QuantizedShard`)."""

    sq = None

    def __init__(
        self, numel: int, device: torch.device, config: GradientFlowConfig, sizes: list[tuple[int, bool]]
    ) -> None:
        assert config.density is not None and isinstance(config.chunk_size, int), "a resolved top-k config"
        self.numel, self.chunk = numel, config.chunk_size
        self.n_chunks = -(-numel // self.chunk)
        self.err = error_feedback.zeros(self.n_chunks * self.chunk, device)
        self.density, self.warmup_steps = float(config.density), config.warmup_steps
        self.quantizer = config.quantizer() if config.mechanism == "topk-quantized" else None
        self.exchange: QuantizedExchange | None = None  # "topk-3bit": its rows' exchange, made at the first one
        # a dense step's wire, and the sparse rows' for "topk-fp16"; "topk-3bit"'s dense ramp steps go in fp32
        self.wire = config.wire_dtype if self.quantizer is None else None
        itemsize = (self.wire or torch.float32).itemsize
        self.dense_from = dense_from(self.chunk, itemsize)
        empty = torch.zeros(self.n_chunks, dtype=torch.bool)
        self.forced = (forced_chunks(sizes, self.chunk, self.n_chunks) if config.dense_1d else empty).to(device)
        self.step = 0

    def resume(self, step: int) -> None:
        """Continue a checkpoint's count of exchanges (the residual was loaded in place)."""
        self.step = step

    def ensure_sq(self) -> None:
        """No preconditioner here (see the class docstring)."""

    def rescale(self, scale: float | torch.Tensor) -> None:
        """``v`` into units of the loss scale ``scale`` (:meth:`.exchange.QuantizedShard.rescale`)."""
        rescale_state(self.err, None, scale)

    def clean(self) -> None:
        """Non-finite entries of ``v`` reset to 0 (a ``GradScaler``'s overflowing step)."""
        clean_state(self.err, None)

    def reduce(self, t: torch.Tensor, group: dist.ProcessGroup, watchdog: Watchdog) -> Sent:
        """:meth:`post`, waited for at once."""
        return self.post(t, group, watchdog)()

    def post(self, t: torch.Tensor, group: dist.ProcessGroup, watchdog: Watchdog) -> Finish:
        """Post ``t`` <- the average over ``group`` of every node's ``t``, the top chunks of ``t / M + v`` sent, the
        rest (and what the wire lost) kept in ``v`` for the next exchange (the module docstring's steps).  The chunks'
        scores are waited for here (every node must pick the same chunks before it sends them); the chunks' own
        exchange, the bulk of the bytes, is what the returned :data:`Finish` waits for."""
        if t.numel() != self.numel:
            raise RuntimeError(
                f"gradientflow.fsdp: the module's gradient shard has {t.numel()} elements this step, its residual "
                f"{self.numel}: fully_shard sets set_reduce_scatter_unused_params(True) for this; do not turn it off."
            )
        density = density_at(self.step, self.density, self.warmup_steps)
        self.step += 1
        if density >= self.dense_from:  # the ramp's first steps: a dense step is no more bytes
            return post_dense(t, group, self.wire, watchdog)
        with on_default_stream(t):  # CUDA: every op of the exchange on one stream (see on_default_stream)
            nodes = dist.get_world_size(group)
            v = self.err
            v[: self.numel].add_(t, alpha=1.0 / nodes)  # the contribution joins the residual (t in reduce_dtype)
            rows = v.view(self.n_chunks, self.chunk)
            scores = chunk_scores(rows)
            work = dist.all_reduce(scores, group=group, async_op=True)
            watchdog.wait(work, "FSDP top-k chunk scores between nodes", scores.numel() * 4)
            scores[self.forced] = math.inf  # after the sum: every node forces the same chunks (the same layout)
            picked = select_chunks(scores, n_selected(density, self.n_chunks))
            sent_rows = rows.index_select(0, picked)  # a copy: v's rows are rewritten below
            score_bytes = scores.numel() * 4
            if self.quantizer is None:
                wire = sent_rows.to(self.wire) if self.wire is not None else sent_rows.clone()
                rows.index_copy_(0, picked, sent_rows - wire.float())  # what fp16 rounded off stays in v
                work = dist.all_reduce(wire, group=group, async_op=True)
            else:
                lost = error_feedback.zeros_like(sent_rows)
                if self.exchange is None:  # the quantised exchange's, between the nodes (no warm-up, no carry)
                    self.exchange = QuantizedExchange(self.quantizer, group, watchdog)
                ring = self.exchange.start(
                    sent_rows.view(-1),
                    lost.view(-1),
                    "FSDP top-k chunks between nodes (quantised exchange)",
                    carry=False,
                )

        def finish() -> Sent:
            with on_default_stream(t):
                if self.quantizer is None:
                    nbytes = wire.numel() * wire.element_size()
                    watchdog.wait(work, "FSDP top-k chunks between nodes", nbytes)
                    total = wire.float()
                    payload, sent = nbytes, ring_allreduce_bytes(nbytes, nodes)
                else:
                    ring.wait()
                    ring.complete()
                    rows.index_copy_(0, picked, lost)  # each sent row's quantisation error stays in v
                    total = sent_rows
                    payload, sent = ring.payload_bytes, ring.sent_bytes
                out = torch.zeros_like(rows)
                out.index_copy_(0, picked, total)
                t.copy_(out.view(-1)[: self.numel])
            return Sent(payload + score_bytes, sent + ring_allreduce_bytes(score_bytes, nodes))

        return finish
