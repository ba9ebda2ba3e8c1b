"""Ranks must agree: options and model at construction, step and buckets per step, finite gradients.

Three checks, each ending in the same error on every rank (so nobody is left waiting):

* :func:`check_same_setup` (always, at construction): one fixed-size allgather of a hash of every
  option that must agree (:data:`~gradientflow.config.LOCAL_OPTIONS` are the exceptions) and of
  the model's signature (names, shapes, dtypes of parameters and buffers).  Only when the hashes
  differ are the details gathered, to name the option (or tensor), the rank and both values.
* :class:`StepCheck` (``check_consistency=True``): launched at the start of every synchronised
  backward, verified at its end, one int64 MAX-allreduce of ``[x, -x]`` for x = (forward passes so
  far, synchronised steps so far, buckets, layout hash): MAX of x and MAX of -x give max and min of
  every field at once.
* :class:`FiniteCheck` (``check_finite=True``): every bucket is screened before it is handed to
  the wire; after the step, one int64 MAX-allreduce of a per-rank slot (first bad parameter + 1)
  tells every rank which rank produced a non-finite gradient, and in which parameter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config import LOCAL_OPTIONS, GradientFlowConfig
from ..diagnostics.errors import ConsistencyError
from ..diagnostics.watchdog import Watchdog
from .pool import Bucket, Layout

logger = logging.getLogger(__name__)

Signature = list[tuple[str, tuple[int, ...], str]]


# ---- construction: options and model, one exchange ---------------------------------------------
def _canonical(value: Any) -> Any:
    """Equal values get equal reprs: ``25`` and ``25.0`` are the same θ on two ranks."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(v) for v in value)
    return repr(value)


def agreed_options(config: GradientFlowConfig) -> dict[str, Any]:
    """Every option that must be equal on all ranks, by name (new options are included by default)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in LOCAL_OPTIONS}


def _digest(obj: Any) -> int:
    # repr of ints, floats, strings, bools, None and tuples of them is identical in every process
    # (unlike hash() of a str, which is salted per process).
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little", signed=True)


def check_same_setup(
    config: GradientFlowConfig,
    signature: Signature,
    group: dist.ProcessGroup,
    watchdog: Watchdog,
    device: torch.device,
) -> None:
    """Raise ``ValueError`` on every rank if ranks were built with different options or models.

    1. Hash (options that must agree, model signature) to one int64 per rank; allgather them
       (bounded by the watchdog's timeout).
    2. All equal: done.  Otherwise every rank sees the same mismatch, so all of them gather the
       details with ``all_gather_object`` (the peers have just answered, so this cannot hang on a
       dead one) and raise the same error: options first, then the model.
    """
    world = dist.get_world_size(group)
    options = agreed_options(config)
    canonical = {name: _canonical(value) for name, value in options.items()}
    mine = torch.tensor([_digest(("gradientflow setup v1", canonical, signature))], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    watchdog.wait(work, "option and model fingerprint exchange", 8)
    if all(int(g) == int(mine) for g in gathered):
        return
    details: list[Any] = [None] * world
    dist.all_gather_object(details, (options, signature), group=group)
    ref_options, ref_signature = details[0]
    for rank, (opts, _) in enumerate(details[1:], start=1):
        for name in ref_options:
            if _canonical(opts.get(name)) != _canonical(ref_options[name]):
                if name == "topology":  # resolved from each rank's torchrun variables: say what to pass
                    raise ValueError(
                        f"gradientflow: ranks resolved different node layouts: topology={ref_options[name]!r} on "
                        f"rank 0 but {opts.get(name)!r} on rank {rank} (torchrun's LOCAL_WORLD_SIZE differs between "
                        "nodes?). Pass topology='flat' (one exchange over every rank) or the same topology='MxG' on "
                        "every rank."
                    )
                raise ValueError(
                    f"gradientflow: ranks were built with different options: {name}={ref_options[name]!r} on "
                    f"rank 0 but {name}={opts.get(name)!r} on rank {rank}. Pass the same {name} on every rank "
                    "(only timeout, trace_path and trace_steps may differ)."
                )
    for rank, (_, sig) in enumerate(details[1:], start=1):
        _compare_models(ref_signature, sig, rank)
    raise ValueError("gradientflow: ranks disagree on their setup (different gradientflow versions?)")


def _compare_models(reference: Signature, other: Signature, rank: int) -> None:
    """Raise naming the first difference between rank 0's model signature and ``rank``'s."""
    if other == reference:
        return
    for k, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            raise ValueError(
                f"gradientflow: ranks wrap different models. Entry {k}: rank 0 has {a[0]} "
                f"{list(a[1])} {a[2]}, rank {rank} has {b[0]} {list(b[1])} {b[2]}. "
                "Build the same model (same parameters, shapes and dtypes) on every rank."
            )
    raise ValueError(
        f"gradientflow: ranks wrap different models: rank 0 has {len(reference)} parameters and "
        f"buffers, rank {rank} has {len(other)}. Build the same model on every rank."
    )


# ---- per step: same step, same buckets ----------------------------------------------------------
def layout_hash(layout: Layout) -> int:
    """A 62-bit hash of the bucket boundaries (tuples of ints hash the same in every process)."""
    return hash(tuple((b.pool, b.start, b.end) for b in layout.buckets)) & ((1 << 62) - 1)


_FIELDS = (
    (
        "forward passes run so far",
        "a rank ran a forward/backward pass inside no_sync() (or skipped one) while "
        "the others synchronised. Enter and leave no_sync() on every rank together, with the same number of passes",
    ),
    ("synchronised steps so far", "a rank skipped a synchronised backward (or ran an extra one)"),
    ("gradient buckets", "ranks cut the gradient pool differently (different models or options)"),
    ("bucket layout hash", "ranks cut the gradient pool differently (different models or options)"),
)


class StepCheck:
    """``check_consistency=True``: every rank synchronises the same step with the same buckets.

    The engine counts forward passes with gradients (``passes``, no_sync passes included).

    1. :meth:`start`, at the start of each synchronised backward (before any bucket), launches
       the MAX-allreduce of ``[x, -x]``.  It is the first collective of the backward on every
       rank, so it always meets the other ranks' check.
    2. :meth:`verify`, once backward has launched every bucket and before the strategy's
       ``finish``, waits for it: by then the exchange has long completed, so the check never
       holds backward up, and a rank that is late (skew) costs nothing extra.  The buckets were
       launched before the verdict, but they pair up correctly (ranks share one layout: the
       model, θ and the re-layout are agreed), so the engine still finishes the step on every
       rank (same verdict everywhere) and then raises: nothing hangs and the group stays usable.
    3. On a difference, every rank allgathers x to name who differs.

    A rank alone in ``no_sync()`` does not start a check that step; its next synchronised
    backward meets the others' check with one pass more, and every rank raises.  Were it never
    to synchronise again, the others' wait times out and the watchdog names it.
    """

    def __init__(self, watchdog: Watchdog, device: torch.device) -> None:
        self.watchdog = watchdog
        self.passes = 0
        self._device = device
        self._layout: Layout | None = None
        self._hash = 0
        self._pending: tuple[Any, torch.Tensor, list[int] | None, float] | None = None

    def start(self, layout: Layout) -> None:
        """Step 1: launch the exchange of (passes, step, buckets, layout hash)."""
        if layout is not self._layout:
            self._layout, self._hash = layout, layout_hash(layout)
        x = [self.passes, self.watchdog.step, len(layout.buckets), self._hash]
        t = torch.tensor(x + [-v for v in x], dtype=torch.int64, device=self._device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.watchdog.group, async_op=True)
        self._pending = (work, t, x, time.perf_counter())

    def start_neutral(self) -> None:
        """Step 1 for a rank that has joined (uneven inputs, ``model.join()``): it takes part in the
        exchange with the smallest value in both halves, so only the ranks still training are compared."""
        k = len(_FIELDS)
        low = torch.iinfo(torch.int64).min
        t = torch.full((2 * k,), low, dtype=torch.int64, device=self._device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.watchdog.group, async_op=True)
        self._pending = (work, t, None, time.perf_counter())

    def verify(self) -> ConsistencyError | None:
        """Steps 2-3: the verdict of the last :meth:`start` (``None``: all ranks agree).

        Raises :class:`CommunicationError` when the exchange does not complete in time.
        """
        if self._pending is None:
            return None
        work, t, x, t0 = self._pending
        self._pending = None
        self.watchdog.wait(work, "step check", t.numel() * 8)
        if x is None:  # a joined rank's neutral share: the verdict is the training ranks'
            return None
        k = len(x)
        high, low = t[:k].tolist(), [-v for v in t[k:].tolist()]
        trace = self.watchdog.trace
        if trace is not None and trace.active:
            trace.complete("step check", "check", t0, time.perf_counter())
        if high == low:
            return None
        # 3. Every rank saw the same difference, so every rank joins this gather.
        mine = torch.tensor(x, dtype=torch.int64, device=self._device)
        world = self.watchdog.world_size
        gathered = [torch.empty_like(mine) for _ in range(world)]
        work = dist.all_gather(gathered, mine, group=self.watchdog.group, async_op=True)
        self.watchdog.wait(work, "step check details", 8 * k * world)
        per_rank = [g.tolist() for g in gathered]
        lines = []
        for f, (label, why) in enumerate(_FIELDS):
            if high[f] != low[f]:
                values = ", ".join(f"rank {r}: {v[f]}" for r, v in enumerate(per_rank))
                lines.append(f"{label} differ ({values}): {why}.")
        return ConsistencyError(
            f"gradientflow: step {self.watchdog.step} (check_consistency=True): ranks are not synchronising "
            f"the same step. " + " ".join(lines) + " This step's gradients are not usable (skip "
            "optimizer.step()); the process group is still usable. Fix the training loop so every rank "
            "synchronises every step."
        )

    def check(self, layout: Layout) -> None:
        """:meth:`start` and :meth:`verify` back to back; raise on a difference."""
        self.start(layout)
        err = self.verify()
        if err is not None:
            raise err


# ---- per step: finite gradients ---------------------------------------------------------------
class FiniteCheck:
    """``check_finite=True``: a non-finite local gradient raises on every rank, naming the parameter.

    1. :meth:`screen` runs on each bucket before it is handed to the wire (the dense path
       overwrites the pool with the reduced sum, after which NaN is everywhere and its origin is
       lost).  One ``sum`` is the screen (a pass, where ``isfinite().all()`` costs three); only a
       non-finite sum is confirmed with ``isfinite``, parameter by parameter, to find the first
       bad one (a sum of large finite values may overflow: that is not a bad gradient).
    2. :meth:`decide` runs after the step's communication: one MAX-allreduce of a per-rank slot
       holding (first bad parameter index + 1), so every rank reaches the same verdict and can
       name rank and parameter.  With a GradScaler registered, overflow is the scaler's business:
       the exchange still happens (so collectives match on every rank) but nothing raises.
    """

    def __init__(self, watchdog: Watchdog, names: Sequence[str], device: torch.device) -> None:
        self.watchdog = watchdog
        self.names = list(names)
        self.scaler_registered = False
        self._device = device
        self._bad = -1
        self._bad_count = 0

    def screen(self, bucket: Bucket, flat: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
        if math.isfinite(float(flat.sum())):
            return
        for i in bucket.params:
            if not bool(torch.isfinite(views[i]).all()):
                self._bad_count += 1
                if self._bad < 0:
                    self._bad = i

    def decide(self) -> None:
        wd = self.watchdog
        t0 = time.perf_counter()
        flags = torch.zeros(wd.world_size, dtype=torch.int64, device=self._device)
        flags[wd.rank] = self._bad + 1
        bad_count, self._bad, self._bad_count = self._bad_count, -1, 0
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=wd.group, async_op=True)
        wd.wait(work, "finite check", flags.numel() * 8)
        if wd.trace is not None and wd.trace.active:
            wd.trace.complete("finite check", "check", t0, time.perf_counter())
        if self.scaler_registered:
            return
        culprits = [(r, int(v) - 1) for r, v in enumerate(flags.tolist()) if v > 0]
        if not culprits:
            return
        parts = []
        for r, i in culprits:
            part = f"rank {r}: parameter '{self.names[i]}'"
            if r == wd.rank:  # only the producing rank knows how many parameters are affected
                part += f" (this rank, {bad_count} parameters affected)" if bad_count > 1 else " (this rank)"
            parts.append(part)
        named = "; ".join(parts)
        raise ConsistencyError(
            f"gradientflow: step {wd.step} (check_finite=True): non-finite gradient (inf or nan) produced on "
            f"{named}. Every rank raises here; the gradients now in .grad are not usable, so skip "
            "optimizer.step() for this batch. Check this batch's inputs and the learning rate; with mixed "
            "precision use torch.amp.GradScaler and model.register_grad_scaler(scaler), which skips such "
            "steps instead."
        )
