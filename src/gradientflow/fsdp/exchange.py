"""The reduction between nodes of one FSDP module's gradient shard, by recipe.

FSDP's reduce-scatter inside the node leaves each rank the node's average of its shard (``1/G`` of the module's
gradients, in ``reduce_dtype``); what remains is the average of that shard over the ``M`` nodes, among the ranks
holding the same shard (the mesh's ``replicate`` group).  Torch's HSDP all-reduces it in ``reduce_dtype``; here
the recipe does, in place (the all-reduce hook's contract: torch then views the same tensor as the sharded
``.grad``):

- :func:`dense_exchange` (``"none"``, ``"fp16"``, ``"bf16"``, and ``"auto"`` before its first optimizer step):
  the shard in the wire dtype, one all-reduce;
- :class:`QuantizedShard` (the ``"3bit"`` family): the shard in ``bits``-bit blocks through the quantised
  exchange of the DDP recipe (:class:`gradientflow.comm.quantized_ring.QuantizedRing`: one exchange of whole
  quantised contributions between two nodes, a direct reduce-scatter and an allgather of the owners' bytes from
  three), with error feedback on the shard: the residual is ``1/G`` of the model per rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.precision import from_wire, to_wire
from ..diagnostics.watchdog import Watchdog
from ..exchange import error_feedback
from ..exchange.quantized import QuantizedExchange
from ..options_base import Quantizer

_AVG_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
"""Reduce dtypes torch's HSDP all-reduces with ``ReduceOp.AVG`` (no overflow risk: the backend divides)."""


@dataclass(frozen=True)
class Sent:
    """One exchange's bytes: ``payload`` handed to the backend (one copy of the shard on the wire), ``sent`` put on
    the link by this rank."""

    payload: int
    sent: int


def ring_allreduce_bytes(nbytes: int, nodes: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``nodes`` ranks: ``2 (M-1)/M`` of them (what
    a dense exchange's link carries; NCCL's and Gloo's ring algorithms)."""
    return 2 * (nodes - 1) * nbytes // nodes


Finish = Callable[[], Sent]
"""A posted exchange: called once, it waits for the messages and leaves the result in the tensor it was posted on."""


def post_dense(t: torch.Tensor, group: dist.ProcessGroup, wire: torch.dtype | None, watchdog: Watchdog) -> Finish:
    """Post ``t`` <- its average over ``group``, on a ``wire`` dtype wire (``None``: ``t``'s own dtype, as torch's
    HSDP: ``ReduceOp.AVG`` where torch uses it, so ``"none"`` reduces exactly as torch does); the returned
    :data:`Finish` waits for it."""
    nodes = dist.get_world_size(group)
    if wire is None or wire == t.dtype:
        if t.dtype in _AVG_DTYPES:
            work = dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group, async_op=True)
        else:  # fp16: divided first, so that M nodes' sum cannot overflow
            t.div_(nodes)
            work = dist.all_reduce(t, group=group, async_op=True)
        on_wire = t
    else:  # divided before the cast (precision.to_wire): a 16-bit wire cannot overflow
        on_wire = to_wire(t, wire, nodes)
        work = dist.all_reduce(on_wire, group=group, async_op=True)
    nbytes = on_wire.numel() * on_wire.element_size()

    def finish() -> Sent:
        watchdog.wait(work, "FSDP shard all-reduce between nodes", nbytes)
        from_wire(t, on_wire)
        return Sent(nbytes, ring_allreduce_bytes(nbytes, nodes))

    return finish


def dense_exchange(t: torch.Tensor, group: dist.ProcessGroup, wire: torch.dtype | None, watchdog: Watchdog) -> Sent:
    """:func:`post_dense`, waited for at once."""
    return post_dense(t, group, wire, watchdog)()


@contextlib.contextmanager
def on_default_stream(t: torch.Tensor) -> Iterator[None]:
    """On a CUDA device, run the quantised exchange on the default stream, ordered after the hook's stream (where
    ``t`` was written) and before what the hook's stream does next.

    The exchange's messages are waited for by a waiter thread (:mod:`gradientflow.comm.waiter`), and NCCL's
    ``Work.wait()`` orders the *waiting thread's* current stream after the messages: the default stream there.
    Torch runs the hook on its all-reduce stream; decoding on that stream would not wait for the bytes."""
    if t.device.type != "cuda":
        yield
        return
    hook_stream, default = torch.cuda.current_stream(t.device), torch.cuda.default_stream(t.device)
    default.wait_stream(hook_stream)
    with torch.cuda.stream(default):
        yield
    hook_stream.wait_stream(default)


class QuantizedShard:
    """The quantised recipe's state on this rank's shard of one module: the error-feedback residual ``err`` (fp32,
    the shard's size; in units of the contribution ``t / M``), the preconditioner's ``q`` (``sq``) and the
    exchange (:class:`gradientflow.exchange.quantized.QuantizedExchange`: the quantiser, the count of exchanges for
    the warm-up, failures named by ``watchdog``) over the ``group`` of ranks holding the same shard."""

    def __init__(
        self, numel: int, device: torch.device, precondition: bool, group: dist.ProcessGroup, watchdog: Watchdog
    ) -> None:
        self.err = error_feedback.zeros(numel, device)
        self.sq = error_feedback.zeros(numel, device) if precondition else None
        self.group, self.watchdog = group, watchdog
        self.exchange: QuantizedExchange | None = None  # made at the first exchange, with the recipe's quantiser
        self._resumed = 0

    @property
    def step(self) -> int:
        """Exchanges done (the warm-up's count; a checkpoint's)."""
        return self.exchange.step if self.exchange is not None else self._resumed

    def resume(self, step: int) -> None:
        """Continue a checkpoint's count of exchanges (the residual and ``q`` were loaded in place)."""
        self._resumed = step
        if self.exchange is not None:
            self.exchange.step = step

    def ensure_sq(self) -> None:
        """Keep ``q`` from now on (a switch to a preconditioned recipe)."""
        if self.sq is None:
            self.sq = error_feedback.zeros(self.err.numel(), self.err.device)

    def rescale(self, scale: float | torch.Tensor) -> None:
        """The residual (and ``q``) multiplied into units of the loss scale ``scale`` (a ``GradScaler``'s: a power
        of two, so exact): the contribution is the scaled gradient, and the residual must be in its units."""
        rescale_state(self.err, self.sq, scale)

    def clean(self) -> None:
        """Non-finite entries of the residual and ``q`` reset to 0 (a ``GradScaler``'s overflowing step)."""
        clean_state(self.err, self.sq)

    def reduce(self, t: torch.Tensor, quantizer: Quantizer) -> Sent:
        """:meth:`post`, waited for at once."""
        return self.post(t, quantizer)()

    def post(self, t: torch.Tensor, quantizer: Quantizer) -> Finish:
        """Post ``t`` <- the average over the group of every rank's ``t``, each quantised with its residual added
        (``carry``); the returned :data:`Finish` waits for it, and the quantisation error stays in :attr:`err` for
        the next exchange.  Nothing is lost: ``sum over ranks of (t / M + err before) == result + sum over ranks of
        err after``, to fp32 rounding."""
        if t.numel() != self.err.numel():
            raise RuntimeError(
                f"gradientflow.fsdp: the module's gradient shard has {t.numel()} elements this step, its residual "
                f"{self.err.numel()}: a parameter got no gradient and FSDP left it out of the reduce-scatter. "
                "fully_shard sets set_reduce_scatter_unused_params(True) for this; do not turn it off."
            )
        if self.exchange is None:
            self.exchange = QuantizedExchange(quantizer, self.group, self.watchdog)
            self.exchange.step = self._resumed
        exchange = self.exchange
        exchange.quantizer = quantizer  # "auto" switches recipe between exchanges
        with on_default_stream(t):  # CUDA: every op of the exchange on one stream (see on_default_stream)
            x = t if t.dtype == torch.float32 else t.float()  # a 16-bit reduce_dtype: the contribution in fp32
            x.div_(exchange.parties)  # each node contributes t / M: the ring's sum is the average
            sq = self.sq if quantizer.precondition else None
            flight = exchange.start(x, self.err, "FSDP shard between nodes (quantised exchange)", sq=sq)

        def finish() -> Sent:
            with on_default_stream(t):
                flight.wait()
                flight.complete()
                if x is not t:
                    t.copy_(x)
            exchange.advance()
            return Sent(flight.payload_bytes, flight.sent_bytes)

        return finish


def rescale_state(err: torch.Tensor, sq: torch.Tensor | None, scale: float | torch.Tensor) -> None:
    """``err`` times ``scale``, ``q`` (squared gradients) times ``scale**2``; nothing for a scale of 1."""
    if isinstance(scale, float) and scale == 1.0:
        return
    err.mul_(scale)
    if sq is not None:
        sq.mul_(scale * scale)


def clean_state(err: torch.Tensor, sq: torch.Tensor | None) -> None:
    """Non-finite entries of ``err`` and ``sq`` reset to 0, in place (what DDP's residuals do after an overflow)."""
    for buf in (err, *([sq] if sq is not None else [])):
        torch.nan_to_num_(buf, nan=0.0, posinf=0.0, neginf=0.0)
