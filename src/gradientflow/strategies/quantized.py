"""Quantised error-feedback synchronisation: every coordinate, every step, in a few bits.

The recipe for adaptive optimizers (Adam, AdamW): sparsification (CSC) delays most coordinates
and Adam's per-coordinate normalisation turns those delays into a quality loss; quantisation
sends every coordinate every step, coarsely, and error feedback makes the coarseness unbiased
over time.  Per synchronised step and bucket (launched as buckets become ready, as dense does):

  1. Contribution: ``x = g / N + e``, the bucket's local gradient pre-divided by the world size
     (folded into the copy of a fresh gradient, :meth:`QuantizedSync.take_fresh`) plus this
     rank's error-feedback residual ``e`` (fp32; in units of the loss scale, like CSC's).
  2. A quantised ring allreduce of ``x`` (:class:`~gradientflow.comm.quantized_ring.QuantizedRing`:
     a direct reduce-scatter of quantised contributions to each segment's owner, which quantises the
     sum once, then an allgather of the owner's bytes), which
     leaves the decoded average in the pool on every rank (the same bytes decoded the same way:
     identical on all ranks) and the quantisation error of everything this rank quantised in ``e``
     (two ranks: one exchange of whole quantised contributions, the same bytes, no requantised sum).
     Nothing is lost: ``sum over ranks of e + N * result == sum of the ranks' x``.
  3. Every rank posts its point-to-point messages in the same order: with two ranks each ring is
     one exchange, started as its bucket is launched (all of a step's in flight at once); from three
     ranks the rings run one after another, in bucket order.  The engine's :meth:`progress` calls
     between gradient hooks advance them while backward goes on, and :meth:`finish` drives the rest.

Bytes per step: ``bits/8 + 2/block`` per gradient (3 bits, 128-element blocks: 0.0977 of fp32),
``2 (N-1)/N`` times of it per rank, as a dense ring.  No host read on the step's path.

Two options for fewer bits (``compression="q2npw20"``, docs/results/adamw.md "Below 0.07 of the bytes"):

- ``warmup``: the first ``warmup`` quantised steps run the default quantiser (3 bits, fitted levels): at 2 bits
  the early steps, while the loss falls fastest, cost most of the quality, and 3 bits there cost little of
  the run's bytes;
- ``precondition``: each coordinate is divided by ``r = sqrt(q)`` before the ring and its result and error
  multiplied back after, ``q`` an EMA (``precondition.PRECONDITION_BETA``) of the squared synchronised gradient.
  Adam divides each coordinate's step by its own RMS, so it sees a coordinate's quantisation noise relative
  to that RMS, where a max-abs block leaves its small coordinates the noise of its largest.  ``q`` is
  computed from the ring's result, bit-identical on every rank, so ranks agree on ``r`` without a byte.
  ``q`` is kept from the first quantised step on, the warm-up's included (started after the warm-up instead,
  AdamW lost quality: docs/results/benchmarks.md, "Figures behind the code's comments"), and floored per window of
  coordinates (:mod:`.precondition`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..comm.precision import divide, loss_scale
from ..comm.two_level import NodeGroups
from ..diagnostics.stats import StepStats
from ..diagnostics.watchdog import Watchdog
from ..engine.pool import Bucket, GradPool, Layout
from ..engine.protocol import SyncStrategy
from ..exchange.error_feedback import Residuals, ShardResiduals, residual_state, validate_residual_state
from ..exchange.precondition import Root, ema_update
from ..exchange.quantized import QuantizedExchange
from ..exchange.ring import Ring, guarded
from ..options_base import Quantizer
from .quantized_nodes import TWO_LEVEL, NodeQuantizer, start_two_level


class _Pending:
    """One launched bucket: its pool slice, its fp32 contribution, its residual slice, its exchange once started."""

    def __init__(self, bucket: Bucket, flat: torch.Tensor, err: torch.Tensor, divided: bool) -> None:
        self.bucket, self.flat, self.err, self.divided = bucket, flat, err, divided
        self.x: torch.Tensor | None = None
        self.flight: Ring | None = None


class QuantizedSync(SyncStrategy):
    """Block-quantised (``bits``, ``block``) ring allreduce with per-rank error feedback."""

    def __init__(
        self,
        pool: GradPool,
        *,
        group: dist.ProcessGroup,
        world_size: int,
        bits: int,
        block: int,
        shapes: Sequence[torch.Size],
        watchdog: Watchdog | None = None,
        clip: float = 0.0,
        levels: str = "fitted",
        precondition: bool = False,
        warmup: int = 0,
        nodes: NodeGroups | None = None,
    ) -> None:
        self.group, self.world_size = group, world_size
        self.quantizer = Quantizer(bits, block, levels, precondition, warmup, clip)
        # the flat exchange (this quantiser, the warm-up's count, failures named); two-level sends through NodeQuantizer
        self.exchange = QuantizedExchange(self.quantizer, group, watchdog)
        self.sq: Residuals | None = None  # precondition's EMA of the squared result, in units of the scale²
        self.watchdog = watchdog
        self._shapes = list(shapes)
        self.pool = pool
        self.res: Residuals | ShardResiduals | None = None  # allocated at the first step (two-level: 1/G the size)
        self._scaler: Any = None
        self._queue: deque[_Pending] = deque()
        self._in_step = False
        # Nodes of several ranks: the ring between nodes only, on each rank's shard (quantized_nodes.py)
        self._nodes = NodeQuantizer(nodes, block, watchdog) if nodes is not None else None
        self.topology = nodes.topology.name if nodes is not None else "flat"
        # Two-level, after the pool was re-laid out (or a residual loaded with some off this rank's shards): the
        # residual in the pool's layout, added whole to the next step's contributions (before the
        # reduce-scatter), then dropped: a full-size transient for one step.
        self._fold: Residuals | None = None

    # ---- layout and state -----------------------------------------------------------------
    def relayout(self, old_layout: Layout, new_pool: GradPool) -> None:
        self.pool = new_pool
        if isinstance(self.res, ShardResiduals) and self._nodes is not None:
            # the buckets' shards now cover other elements: the residual goes into the next step's contribution
            self._fold = self._full_residual().moved_to(new_pool.layout)
            self.res = self._nodes.residuals(new_pool.layout)
            self.res.store.scale = self._fold.scale
        elif isinstance(self.res, Residuals):
            self.res = self.res.moved_to(new_pool.layout)
        if self.sq is not None:
            self.sq = self.sq.moved_to(new_pool.layout)

    def has_state(self) -> bool:
        return self.res is not None

    def register_grad_scaler(self, scaler: Any) -> None:
        """Keep the residual in units of ``scaler``'s loss scale (and clean it after an overflow)."""
        self._scaler = scaler

    # ---- per step -------------------------------------------------------------------------
    def take_fresh(self, grad: torch.Tensor, out: torch.Tensor) -> bool:
        """Step 1's division, folded into the copy of a fresh gradient into the pool."""
        divide(grad, self.world_size, None, out=out)
        return True

    def _full_residual(self) -> Residuals:
        """The residual in the pool's layout (two-level: the shards expanded, plus a pending fold); new memory."""
        assert self.res is not None
        return self.res.expanded(plus=self._fold) if isinstance(self.res, ShardResiduals) else self.res

    def _begin_step(self) -> None:
        if self.res is None and self._nodes is not None:
            self.res = self._nodes.residuals(self.pool.layout)
        elif self.res is None:
            self.res = Residuals(self.pool.layout, 1, False, self._shapes)
        scale = loss_scale(self._scaler)
        self.res.rescale(scale)
        if self._fold is not None:
            self._fold.rescale(scale)
        if self.quantizer.precondition:
            if self.sq is None:
                self.sq = Residuals(self.pool.layout, 1, False, self._shapes)
            self.sq.rescale(scale * scale)
        if self._scaler is not None:
            self.res.clean()  # an overflowed step left NaN in the blocks it touched
            if self._fold is not None:
                self._fold.clean()
            if self.sq is not None:
                self.sq.clean()
        self._in_step = True

    def launch(self, bucket: Bucket, flat: torch.Tensor, stats: StepStats, divided: bool = False) -> None:
        """Queue the bucket's ring; start it at once if no earlier ring of this step is still running."""
        if not self._in_step:
            self._begin_step()
        assert self.res is not None  # allocated by _begin_step
        if self._nodes is not None:
            self._launch_two_level(bucket, flat, divided, stats)
            return
        err = self.res.v[bucket.pool][bucket.start : bucket.end]
        p = _Pending(bucket, flat, err, divided)
        self._queue.append(p)
        if self.world_size == 2:
            # One round per ring (the exchange): every rank posts its rings' messages in launch order,
            # so they may all be in flight at once and the wire never waits for an earlier bucket's
            # decode.  From 3 ranks a ring has two rounds, posted as messages arrive: one at a time, so
            # every rank posts the same sequence.
            self._start(p, stats)
        self.progress(stats)

    def _start(self, p: _Pending, stats: StepStats) -> None:
        """Step 1 (``x = g/N + e``, in the pool slice itself for an fp32 pool) and the ring's first message."""
        if p.flat.dtype == torch.float32:
            p.x = p.flat
        else:  # 16-bit pool: the contribution is built in fp32 (err is fp32)
            p.x = p.flat.float()
        if not p.divided:
            divide(p.x, self.world_size, None)
        b = p.bucket
        sq = self.sq.v[b.pool][b.start : b.end] if self.sq is not None else None
        p.flight = self.exchange.start(p.x, p.err, f"bucket {b.index} (quantised ring)", sq=sq)
        stats.record_collective(p.flight.payload_bytes)

    def _launch_two_level(self, bucket: Bucket, flat: torch.Tensor, divided: bool, stats: StepStats) -> None:
        """The bucket's contribution ``g / N`` into the two-level pipeline (the residual is added to the node sum
        of its shard, between nodes)."""
        assert self._nodes is not None and isinstance(self.res, ShardResiduals)
        err, _ = self.res.shard(bucket)
        x = flat if flat.dtype == torch.float32 else flat.float()
        if not divided:
            divide(x, self.world_size, None)
        if self._fold is not None:  # residual off the shards: into the contribution (node-summed by the reduce-scatter)
            x.add_(self._fold.v[bucket.pool][bucket.start : bucket.end])
        root = None
        if self.exchange.preconditions:
            assert self.sq is not None  # allocated by _begin_step
            root = Root(self.sq.v[bucket.pool][bucket.start : bucket.end])
        bits, levels = self._quantizer()
        args = {"bits": bits, "block": self.quantizer.block, "clip": self.quantizer.clip, "levels": levels}

        def delivered(result: torch.Tensor) -> None:
            if self.sq is not None:
                ema_update(self.sq.v[bucket.pool][bucket.start : bucket.end], result)
            if result.data_ptr() != flat.data_ptr() or result.dtype != flat.dtype:
                flat.copy_(result)

        start_two_level(self._nodes, x, err, root, args, stats, f"bucket {bucket.index} (quantised)", delivered)
        self.progress(stats)

    def _quantizer(self) -> tuple[int, str]:
        """This step's bits and levels: the default quantiser's for the first ``warmup`` steps."""
        return self.exchange.widths()

    @property
    def warmup(self) -> int:
        """The first steps sent at the default 3 bits (``"auto"``'s width decision reads it at their end)."""
        return self.quantizer.warmup_steps

    def _width(self) -> list[int]:
        """The quantiser a checkpoint records: [bits, block]."""
        return [self.quantizer.bits, self.quantizer.block]

    @property
    def step(self) -> int:
        """Synchronised steps done (the warm-up's count), the exchange's."""
        return self.exchange.step

    @step.setter
    def step(self, value: int) -> None:
        self.exchange.step = value

    def _complete(self, p: _Pending, stats: StepStats) -> None:
        stats.record_done(time.perf_counter())
        assert p.x is not None and p.flight is not None  # started by _start
        p.flight.complete()
        if p.x is not p.flat:
            p.flat.copy_(p.x)

    def progress(self, stats: StepStats) -> None:
        """Advance the running ring as far as its messages allow; start the next; never wait."""
        t0 = time.perf_counter()
        if self._nodes is not None:
            guarded(self.watchdog, TWO_LEVEL, self._nodes.progress, t0)
            stats.phase("pack", t0)
            return
        while self._queue:
            p = self._queue[0]
            if p.flight is None:
                self._start(p, stats)
            if not self._run(p, block=False):
                break
            self._queue.popleft()
            self._complete(p, stats)
        stats.phase("pack", t0)

    def _run(self, p: _Pending, block: bool) -> bool:
        assert p.flight is not None  # started by _start
        if block:
            p.flight.wait()
            return True
        return p.flight.poll()

    def finish(self, stats: StepStats) -> None:
        """End of backward: run every queued ring to the end; the pool holds the decoded average."""
        if not self._in_step:
            self._begin_step()  # no parameters launched: still a step (counts, rescale)
        if self._nodes is not None:
            t0 = time.perf_counter()
            guarded(self.watchdog, TWO_LEVEL, self._nodes.drain, t0)
            stats.phase("wire_wait", t0)
        while self._queue:
            p = self._queue[0]
            if p.flight is None:
                self._start(p, stats)
            t0 = time.perf_counter()
            self._run(p, block=True)
            stats.phase("wire_wait", t0)
            self._queue.popleft()
            self._complete(p, stats)
        self._in_step = False
        self._fold = None  # every bucket launched: the folded residual went into this step's contributions
        stats.extra.update(quant_bits=self._quantizer()[0], quant_block=self.quantizer.block)
        self.exchange.advance()

    def untouched(self, params: Sequence[int]) -> list[int]:
        """Unused parameters whose delivered average is exactly 0 (a residual may deliver something).

        A host read per such parameter, only on steps where some parameter was unused everywhere.
        """
        views = self.pool.views
        return [i for i in params if not bool(views[i].any())]

    # ---- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The residual (unpadded, unscaled, in the current pool layout), the quantiser and the step."""
        sizes = [b.numel() for b in self.pool.buffers]
        sq = self.sq.unscaled("v") if self.sq is not None else None
        state = {"step": self.step, "quantizer": self._width(), "sq": sq, "shard_layout": self.topology}
        # two-level: flat's format, the shards expanded into the pool's layout (a transient while saving)
        return {**state, **residual_state(self._full_residual() if self.res is not None else None, 1, sizes)}

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"step", "quantizer"} - set(state)
        if missing:
            raise ValueError(f"gradientflow quantised: the communication state lacks {sorted(missing)} (truncated?)")
        if list(state["quantizer"]) != self._width():
            raise ValueError(
                f"gradientflow quantised: the checkpoint was saved with bits, block = {list(state['quantizer'])}, "
                f"this model has {self._width()}. Resume with the same compression."
            )
        saved = state.get("shard_layout", "flat")  # saved before layouts were recorded: flat
        if saved != self.topology and state.get("v") is not None:
            raise ValueError(
                f"gradientflow quantised: the communication state was saved on the node layout topology={saved!r}, "
                f"this model runs topology={self.topology!r}; each rank's residual belongs to its shard of its node's "
                f"sum, so it cannot move to another layout. Resume with topology={saved!r}, or start the "
                "communication state afresh (skip load_comm_state_dict)."
            )
        sizes = [b.numel() for b in self.pool.buffers]
        validate_residual_state(state, 1, sizes, False)
        sq = state.get("sq")
        if (
            self.quantizer.precondition
            and state["v"] is not None
            and (sq is None or len(sq) != len(sizes) or any(t.numel() != n for t, n in zip(sq, sizes)))
        ):
            raise ValueError(
                "gradientflow quantised: this model preconditions (compression='q...p') but the checkpoint has no "
                "matching preconditioner state (saved without 'p', or from another model). Resume with the same "
                "compression."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validate_state_dict(state)
        self.res = None
        self._fold = None
        if state["v"] is not None:
            self.res = Residuals(self.pool.layout, 1, False, self._shapes)
            self.res.load(state)
            if self._nodes is not None:  # keep this rank's shards; anything off them goes into the next step
                full, self.res = self.res, self._nodes.residuals(self.pool.layout)
                if self.res.take(full):
                    self._fold = full
        self.sq = None
        if self.quantizer.precondition and state["v"] is not None:
            self.sq = Residuals(self.pool.layout, 1, False, self._shapes)
            self.sq.load({"v": state["sq"]})
        self.exchange.step = int(state["step"])
