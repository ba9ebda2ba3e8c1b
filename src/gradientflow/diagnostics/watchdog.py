"""Bounded waits that name the culprit: every wait of gradientflow goes through :class:`Watchdog`.

A dead peer usually surfaces fast (Gloo/NCCL see the connection close); a *stalled* peer (alive,
stuck: SIGSTOP, a deadlock in a data loader, a rank inside ``no_sync()`` while the others
synchronise) only shows up as a wait that never ends.  The watchdog bounds every wait by
``timeout`` and, when one fails, finds out which ranks had not arrived.

Protocol (nothing on the hot path: a wait that succeeds costs exactly the backend's ``wait``):

  1. ``wait(work, what, nbytes)`` calls ``work.wait(timeout)``.  Gloo, NCCL and point-to-point
     work objects all raise once ``timeout`` has passed, or earlier when a peer's connection
     closes.
  2. On failure, this rank *checks in*: it writes ``"<step>|<collective>"`` under its rank in the
     process group's rendezvous store (works on every backend: it is the store that
     ``init_process_group`` already used).
  3. It then polls one counter in the store until every rank has checked in, for up to
     ``grace_s`` seconds (the survivors of one failure time out within moments of each other),
     and reads the check-ins once.  Ranks that never check in are named as not having arrived
     (stalled, dead, or not synchronising this step); ranks that checked in somewhere else are
     named with where they were.
  4. It raises :class:`CommunicationError` naming the step, the collective, its bytes, the
     missing ranks, and that the process group must be torn down.

The store may itself be unreachable (its host process is the stalled one), so steps 2-3 run in a
daemon thread joined with a deadline: the error is raised in time either way, just without names.

Nothing waits silently: a wait still going after ``min(60 s, timeout / 2)`` is logged once (WARNING) by one
monitor thread per process (:mod:`.long_waits`), naming what is waited on and the ranks that have not reported a
long wait of this step themselves (the same store, a key per rank).  With ``timeout=None`` the waits of a run with
exchanges between nodes are bounded by :data:`BETWEEN_NODES_TIMEOUT` (5 minutes), not the process group's 30
minutes on Gloo.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .errors import RESTART_ADVICE, CommunicationError
from .long_waits import MONITOR

if TYPE_CHECKING:
    from .trace import TraceRecorder

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3.0
"""How long a failed rank waits for the others to check in before naming the missing ones."""

_instances: dict[str, itertools.count] = {}

UNEVEN_INPUTS_HINT = (
    "If a rank ran out of data first (uneven inputs: fewer batches on some ranks), run the training loop "
    "inside `with model.join():`, as with torch DDP, or give every rank the same number of batches "
    "(DistributedSampler does)."
)


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The timeout ``group`` was created with (``init_process_group(timeout=...)``)."""
    try:
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except Exception:  # noqa: BLE001 — private API; fall back to torch's documented default
        from torch.distributed.distributed_c10d import default_pg_timeout  # noqa: PLC0415

        return default_pg_timeout


BETWEEN_NODES_TIMEOUT = timedelta(minutes=5)
"""``timeout=None`` on a run with exchanges between nodes (``sync_every > 1``, nodes of several ranks, an FSDP mesh
of several nodes): how long one wait may last, or the process group's own timeout where that is shorter.

Why 5 minutes (docs/multi-node.md, "A hung host"): one wait covers one round of one exchange (a bucket's round,
an outer fragment's ring round, an FSDP module's shard) plus how far the slowest rank lags when it starts; the
process group's own timeout (30 minutes on Gloo) let a hung host stop a run silently for half an hour (issue 70
item 3).  5 minutes carries 3.75 GB in one wait at 100 Mbit/s (a 3-bit outer exchange's round is at most one
quantised copy of the node's pseudo-gradient, 0.39 bytes a parameter: a 9.6-billion-parameter model) and a
replica lagging 5 minutes behind the others at an outer sync; a hung host then costs 5 minutes and 3 seconds.
Larger exchanges on a slower link, or replicas further apart, pass ``timeout=`` (the page says how much)."""

WARN_AFTER_S = 60.0
"""A wait that lasts this long (or half its timeout, if that is less) is logged once, as a WARNING naming what it
waits on and the ranks that have not reported a long wait themselves: nothing waits silently."""


def resolve_timeout(
    timeout: float | timedelta | None, group: dist.ProcessGroup, *, between_nodes: bool = False
) -> timedelta:
    """``timeout`` as a ``timedelta``; ``None`` means the process group's own timeout, at most
    :data:`BETWEEN_NODES_TIMEOUT` where the waits include exchanges ``between_nodes``."""
    if timeout is None:
        own = group_timeout(group)
        return min(own, BETWEEN_NODES_TIMEOUT) if between_nodes else own
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def format_bytes(n: int | None) -> str:
    if n is None:
        return "? bytes"
    if n < 1 << 10:
        return f"{n} B"
    if n < 1 << 20:
        return f"{n / (1 << 10):.1f} KB"
    return f"{n / (1 << 20):.1f} MB"


class Watchdog:
    """Bounds every wait of one wrapper by ``timeout`` and turns a failure into a named error.

    ``step`` is the synchronised step (0-based) the engine is in, for messages and the trace;
    ``trace`` is the :class:`~gradientflow.diagnostics.trace.TraceRecorder` or ``None`` (collectives report
    their launch and completion to it).
    """

    # a subclass's own words where its group is not one job's ranks (the replicas' quorums, outer/membership.py):
    unknown_why = "the rendezvous store did not answer"  # why the ranks waited on can be unknown
    missing_hint: str | None = UNEVEN_INPUTS_HINT  # the commonest cause of a missing rank, or None
    after_failure = RESTART_ADVICE  # what the user does once the error is raised

    def __init__(
        self,
        group: dist.ProcessGroup,
        timeout: timedelta,
        *,
        grace_s: float = DEFAULT_GRACE_S,
        global_ranks: list[int] | None = None,
    ) -> None:
        self.group = group
        self.timeout = timeout
        self.grace_s = grace_s
        self.rank = group.rank() if global_ranks is not None else dist.get_rank(group)
        self.world_size = group.size() if global_ranks is not None else dist.get_world_size(group)
        # Errors name global ranks (what torchrun, the logs and the user see): a subgroup's (an FSDP mesh's replicate
        # group, a node's group) own numbering would name another process.  ``global_ranks``: a group c10d does not
        # register (torchft's quorum group) names its ranks itself (the replicas' numbers).
        if global_ranks is None:
            global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.global_ranks = global_ranks
        self.step = 0
        self.trace: TraceRecorder | None = None
        self.failed: CommunicationError | None = None
        # One key space per wrapper: wrappers are built collectively, in the same order on every
        # rank, so the n-th wrapper on a group has the same prefix everywhere.
        name = getattr(group, "group_name", "") or "default"
        counter = _instances.setdefault(name, itertools.count())
        base = f"gradientflow/{name}/{next(counter)}/"
        self._prefix = base + "stuck/"
        self._slow_prefix = base + "slow/"
        self.warn_after_s = min(WARN_AFTER_S, timeout.total_seconds() / 2)
        # The wait in progress (its start, what, bytes), read by the monitor thread (:class:`.long_waits.Monitor`)
        # to log a long one; set and cleared by the outermost wait only (a pipeline's drain waits on its rings inside).
        self.waiting: tuple[float, str, int | None] | None = None

    # ---- 0. a long wait is logged ---------------------------------------------------------
    @contextlib.contextmanager
    def watched(self, what: str, nbytes: int | None) -> Iterator[None]:
        """Around a blocking wait on ``what``: past :attr:`warn_after_s` the monitor thread logs it (once)."""
        if self.waiting is not None:  # inside an outer wait: that one is watched
            yield
            return
        self.waiting = (time.monotonic(), what, nbytes)
        MONITOR.watch(self)
        try:
            yield
        finally:
            self.waiting = None

    def warn_long_wait(self, began: float, what: str, nbytes: int | None) -> None:
        """Log (WARNING) that this rank has waited on ``what`` since ``began``, naming the ranks that have not
        reported a long wait of this step themselves (the rendezvous store, as :meth:`failure` does)."""
        me = self.global_ranks[self.rank]
        waited = time.monotonic() - began
        size = f" ({format_bytes(nbytes)})" if nbytes is not None else ""
        parts = [
            f"gradientflow: step {self.step}: rank {me} has waited {waited:.0f} s on {what}{size}; it raises "
            f"CommunicationError after the timeout of {self.timeout.total_seconds():g} s."
        ]
        reports = self._report_slow(f"{self.step}|{what}")
        if reports is None:
            parts.append(f"Which ranks it waits on is unknown ({self.unknown_why}).")
        else:
            silent = [self.global_ranks[r] for r in range(self.world_size) if r != self.rank and r not in reports]
            if silent:
                parts.append(
                    f"Rank(s) {silent} have not reported a long wait of this step: stalled, dead, slow (a straggler, "
                    "a slow link) or not synchronising this step."
                )
            on: dict[str, list[int]] = {}
            for r, w in sorted(reports.items()):
                on.setdefault(w.partition("|")[2], []).append(self.global_ranks[r])
            parts += [f"Rank(s) {ranks} wait too, on {coll}." for coll, ranks in on.items()]
        logger.warning(" ".join(parts))

    def _report_slow(self, where: str) -> dict[int, str] | None:
        """Write our long wait under our rank, give the others ``grace_s`` to write theirs, and read the ones of
        this step; ``None`` if the store did not answer.  Runs on the monitor thread, never the training one."""
        try:
            from torch.distributed.distributed_c10d import _get_process_group_store  # noqa: PLC0415

            store = _get_process_group_store(self.group)
            store.set(f"{self._slow_prefix}{self.rank}", where)
            time.sleep(self.grace_s)  # the others' waits began within moments of ours (they wait on the same peer)
            step = where.partition("|")[0]
            found = {}
            for r in range(self.world_size):
                key = f"{self._slow_prefix}{r}"
                if r != self.rank and store.check([key]):
                    w = store.get(key).decode()
                    if w.partition("|")[0] == step:  # a report of an earlier step is not this wait's
                        found[r] = w
            return found
        except Exception as exc:  # noqa: BLE001 — the store's host may be the stalled rank
            logger.debug("gradientflow: rendezvous store did not answer: %s", exc)
            return None

    # ---- 1. bounded wait ------------------------------------------------------------------
    def wait(self, work: Any, what: str, nbytes: int | None) -> None:
        """``work.wait(timeout)``; on failure raise :class:`CommunicationError` (steps 2-4)."""
        if self.failed is not None:  # the group is broken: do not add another full timeout
            raise CommunicationError(
                f"gradientflow: step {self.step}: {what} not attempted: an earlier collective failed (step "
                f"{self.failed.step}: {self.failed.collective}, missing ranks {self.failed.missing_ranks}). "
                + self.after_failure,
                step=self.step,
                collective=what,
                nbytes=nbytes,
                missing_ranks=self.failed.missing_ranks,
            )
        t0 = time.perf_counter()
        try:
            with self.watched(what, nbytes):
                work.wait(self.timeout)
        except RuntimeError as exc:  # DistBackendError and Gloo's "Operation timed out!" are RuntimeErrors
            raise self.failure(what, nbytes, exc, time.perf_counter() - t0) from exc
        trace = self.trace
        if trace is not None and trace.active:
            trace.complete(f"wait {what}", "wait", t0, time.perf_counter(), bytes=nbytes)

    def failure(self, what: str, nbytes: int | None, exc: BaseException, waited_s: float) -> CommunicationError:
        """Build (and remember) the error for a failed wait on ``what``; checks in with the store."""
        timeout_s = self.timeout.total_seconds()
        timed_out = waited_s >= 0.95 * timeout_s or "timed out" in str(exc).lower()
        cause = f"did not complete within the timeout of {timeout_s:g} s" if timed_out else f"failed: {exc}"
        where = f"{self.step}|{what}"
        missing, elsewhere = self._check_in(where)
        if missing is not None:
            missing = [self.global_ranks[r] for r in missing]
        elsewhere = {self.global_ranks[r]: w for r, w in elsewhere.items()}
        me = self.global_ranks[self.rank]
        everyone = self.world_size == dist.get_world_size()
        among = f"of {self.world_size}" if everyone else f"(with ranks {self.global_ranks} in this exchange)"
        parts = [f"gradientflow: step {self.step}: {what} ({format_bytes(nbytes)}) {cause} on rank {me} {among}."]
        if missing is None:
            parts.append(
                f"Which ranks were missing is unknown ({self.unknown_why}): a peer may "
                "have died or stalled, or ranks issued different collectives."
            )
        elif missing:
            parts.append(
                f"Rank(s) {missing} never reached a failing wait within {self.grace_s:g} s: a peer may have died, "
                "or it is stalled (stopped, deadlocked, slow data loading) or not synchronising this step (e.g. "
                "inside no_sync() while the others synchronise)."
            )
        if (missing is None or missing) and self.missing_hint:
            # The commonest cause in a first run: one rank's shard had fewer batches (uneven inputs), so it left
            # the loop and closed its connections while the others still synchronise.
            parts.append(self.missing_hint)
        elif elsewhere:
            parts.append(
                "Every rank checked in, but not all at this collective: ranks issued collectives in a "
                "different order (a collective outside gradientflow on some ranks only?)."
            )
        else:
            parts.append(
                "Every rank reached a failing wait at this collective: the network or the backend failed, not one rank."
            )
        for r, w in sorted(elsewhere.items()):
            step, _, coll = w.partition("|")
            parts.append(f"Rank {r} was waiting on {coll} of step {step} instead.")
        parts.append(self.after_failure)
        err = CommunicationError(" ".join(parts), step=self.step, collective=what, nbytes=nbytes, missing_ranks=missing)
        self.failed = err
        logger.debug("gradientflow: %s", err)  # raised, not logged: the caller decides what to print
        return err

    # ---- 2-3. store check-in --------------------------------------------------------------
    def _check_in(self, where: str) -> tuple[list[int] | None, dict[int, str]]:
        """Write our position, collect the others' for ``grace_s``; (missing ranks, others' positions)."""
        found: dict[int, str] = {}
        done = threading.Event()

        def run() -> None:
            from torch.distributed.distributed_c10d import _get_process_group_store  # noqa: PLC0415

            store = _get_process_group_store(self.group)
            store.set(f"{self._prefix}{self.rank}", where)
            # One counter to poll (not one key per rank): at scale, every survivor polls the store.
            arrived = store.add(f"{self._prefix}count", 1)
            deadline = time.monotonic() + self.grace_s
            while arrived < self.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
                arrived = store.add(f"{self._prefix}count", 0)
            for r in range(self.world_size):  # once, at the end: who checked in, and where
                if r != self.rank and store.check([f"{self._prefix}{r}"]):
                    found[r] = store.get(f"{self._prefix}{r}").decode()
            done.set()

        def guarded() -> None:
            try:
                run()
            except Exception as exc:  # noqa: BLE001 — the store host may be the dead rank
                logger.warning("gradientflow: rendezvous store check-in failed: %s", exc)

        thread = threading.Thread(target=guarded, name="gradientflow-check-in", daemon=True)
        thread.start()
        thread.join(self.grace_s + 2.0)
        if not done.is_set():
            return None, {}
        missing = [r for r in range(self.world_size) if r != self.rank and r not in found]
        elsewhere = {r: w for r, w in found.items() if w != where}
        return missing, elsewhere
