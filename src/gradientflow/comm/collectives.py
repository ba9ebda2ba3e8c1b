"""How a flat tensor is allreduced: the backend's own collective ("native") or our ring ("ring").

Contract used by the engine: ``start_allreduce(tensor, group=..., algorithm=...)`` begins an
in-place SUM allreduce and returns a :class:`PendingAllreduce`; ``wait()`` blocks until the
tensor holds the sum.  Collectives are always *started* from the caller's thread, in the
same order on every rank (Gloo matches operations by order).

The ring lives in :mod:`gradientflow.comm.ring`; ``start_allreduce(..., algorithm="ring")`` runs
it to completion and returns an already-completed handle.  :func:`broadcast_coalesced` is the
buffer and final-model broadcast.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import ALGORITHMS
from ..diagnostics.watchdog import Watchdog
from .ring import ring_allreduce

logger = logging.getLogger(__name__)

_SUM_ASYNC = dist.AllreduceOptions()  # read-only to the backend: one object for every launch
# A ReduceOp built from the enum value: torch 2.13's stubs type the field ReduceOp only, 2.14's take either
_SUM_ASYNC.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
_SUM_ASYNC.asyncOp = True


def as_member(group: object, ranks: list[int]) -> dist.ProcessGroup:
    """``group``, what ``dist.new_group(ranks, ...)`` returned, as the process group it is on a rank among ``ranks``.

    torch 2.14 types ``new_group``'s result ``ProcessGroup | Literal[-100]`` (``GroupMember.NON_GROUP_MEMBER``, what
    a rank outside ``ranks`` gets), 2.13 ``ProcessGroup``: narrowed here, one way for both (a cast or an ignore
    would be unneeded on one of them).  A rank outside ``ranks`` using the group is a bug of the caller."""
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(
            f"gradientflow: rank {dist.get_rank()} uses the group of ranks {ranks} it is not among (got {group!r})"
        )
    return group


class PendingAllreduce:
    """An allreduce in flight.  ``completed_at`` is a ``time.perf_counter()`` stamp once done.

    Completion is *polled* (:meth:`poll`) rather than reported by a future callback: a Python
    callback would run on the backend's worker thread and has to take the GIL first, stalling
    the next queued collective behind the training thread.
    """

    def __init__(
        self, work: dist.Work | None, tensor: torch.Tensor, watchdog: Watchdog | None = None, what: str = "allreduce"
    ) -> None:
        self.tensor = tensor
        self.completed_at: float | None = None
        self._work = work
        self._watchdog = watchdog
        self.what = what
        if work is None:
            self.completed_at = time.perf_counter()

    def poll(self) -> bool:
        """Stamp ``completed_at`` if the collective has finished; never blocks."""
        if self.completed_at is None and self._work is not None and self._work.is_completed():
            self.completed_at = time.perf_counter()
        return self.completed_at is not None

    def wait(self, timeout: timedelta | None = None) -> torch.Tensor:
        """Block until done; with a watchdog, bounded by its timeout (``CommunicationError``)."""
        if self._work is not None and self._watchdog is not None:
            self._watchdog.wait(self._work, self.what, self.tensor.numel() * self.tensor.element_size())
            if self.completed_at is None:
                self.completed_at = time.perf_counter()
        elif self._work is not None:
            try:
                if timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(timeout)
            except RuntimeError as exc:  # Gloo/NCCL timeouts and peer failures surface here
                raise RuntimeError(
                    f"gradientflow: allreduce of {self.tensor.numel()} x {self.tensor.dtype} failed: {exc}. "
                    "A peer may have died or ranks issued different collectives (mismatched models, "
                    "or a collective outside gradientflow on some ranks only)."
                ) from exc
            if self.completed_at is None:
                self.completed_at = time.perf_counter()
        return self.tensor


# torch 2.13 names these two collectives ``*_single`` (its ``reduce_scatter_tensor`` / ``all_gather_into_tensor``
# now warn and forward to them); torch up to 2.12 has only the old names, as the GPU image a lent machine ran
# (torch 2.11, 2026-11-28): resolved once here, so a rank on either calls the same collective.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def start_allreduce(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    algorithm: str = "native",
    watchdog: Watchdog | None = None,
    what: str = "allreduce",
) -> PendingAllreduce:
    """Start an in-place SUM allreduce of ``tensor`` over ``group`` with ``algorithm``.

    "native" is asynchronous (the backend's own allreduce).  "ring" runs :func:`ring_allreduce`
    to completion before returning: progressing it from another thread or a callback would
    break the one-thread ordering rule of DESIGN.md.  With a ``watchdog`` every wait is bounded
    by its timeout and a failure names ``what`` (e.g. "bucket 3"); the watchdog's trace, when
    recording, gets the collective from launch to completion.
    """
    trace = watchdog.trace if watchdog is not None else None
    if trace is not None and not trace.active:
        trace = None
    t0 = time.perf_counter() if trace is not None else 0.0
    if algorithm == "native":
        if group is None:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        else:
            # The group's own allreduce, as torch DDP's C++ reducer calls it: dist.all_reduce's Python
            # checks (torch-function modes, complex views, coalescing) do not apply to a real pool slice
            # of a group this rank is in, and cost a small model's step much of its gap to torch DDP
            # (measured: docs/results/benchmarks.md, per-step fixed cost on small models)
            work = group.allreduce([tensor], _SUM_ASYNC)
        handle = PendingAllreduce(work, tensor, watchdog, what)
    elif algorithm == "ring":
        t_wait = time.monotonic()
        try:
            ring_allreduce(tensor, group, timeout=watchdog.timeout if watchdog is not None else None)
        except RuntimeError as exc:  # same advice as the native path's wait()
            if watchdog is not None:
                nbytes = tensor.numel() * tensor.element_size()
                raise watchdog.failure(f"{what} (ring)", nbytes, exc, time.monotonic() - t_wait) from exc
            raise RuntimeError(
                f"gradientflow: ring allreduce of {tensor.numel()} x {tensor.dtype} failed: {exc}. "
                "A peer may have died or ranks issued different collectives."
            ) from exc
        handle = PendingAllreduce(None, tensor, watchdog, what)
    else:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if trace is not None:
        trace.collective(handle, what, tensor.numel() * tensor.element_size(), t0, algorithm=algorithm)
    return handle


def broadcast_coalesced(
    tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup, watchdog: Watchdog, what: str
) -> None:
    """Broadcast ``tensors`` from global rank ``src`` with one collective per (dtype, device).

    Written through ``.data`` (its own version counter) and not at all on ``src``: a forward that
    re-broadcasts BatchNorm buffers must not invalidate an earlier forward's graph that saved
    them (two forwards before one backward), as torch DDP's C++ broadcast does not.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    receive = dist.get_rank() != src
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        work = dist.broadcast(flat, src=src, group=group, async_op=True)
        watchdog.wait(work, what, flat.numel() * flat.element_size())
        offset = 0
        for t in ts:
            if receive:
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
