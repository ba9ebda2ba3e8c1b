"""Daemon threads that only *wait* on posted works and flag their completion (:class:`Waiter`).

Gloo's point-to-point works, and its ``reduce_scatter_single``, never report completion before
``wait()`` (``is_completed()`` stays False, torch 2.13), so polling them cannot see it.  A waiter
thread waits on each posted group of works, in posting order, with the GIL released, and sets an
event; the training thread polls the event.  It never issues a collective: collectives are issued
from the training thread only, in the same order on every rank.

One waiter per process group (:func:`waiter_for`): the order a waiter waits in is then the order its
group completes in.  A waiter shared by two groups ties them together: with two wrapped models in one
backward, each exchanging on a group of its own, a rank's waiter could sit on one model's round while
the other model's round it must flag first (so that this rank posts the messages a peer waits on) waits
behind it, and every rank hangs.  A waiter's thread ends when it has had nothing to wait on for a while
(a group's waiter outlives neither its group nor its use).
"""

from __future__ import annotations

import queue
import threading
import weakref
from datetime import timedelta

import torch.distributed as dist


class Arrival:
    """One step's works: ``event`` is set once they completed (or failed: ``error``)."""

    def __init__(self, works: list[dist.Work], timeout: timedelta | None) -> None:
        self.works, self.timeout = works, timeout
        self.event = threading.Event()
        self.error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"gradientflow: a collective failed: {self.error}. A peer may have died or ranks issued different "
                "collectives."
            ) from self.error


class Waiter:
    """A daemon thread that waits on posted works, in posting order, and sets their event."""

    IDLE_SECONDS = 30.0
    """The thread ends after this long with nothing to wait on; the next :meth:`watch` starts another."""

    def __init__(self, name: str = "gradientflow-waiter") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # a watch() never finds a thread that is about to end

    def watch(self, works: list[dist.Work], timeout: timedelta | None) -> Arrival:
        arrival = Arrival(works, timeout)
        if not works:
            arrival.event.set()
            return arrival
        with self._lock:
            self._queue.put(arrival)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return arrival

    def _run(self) -> None:
        while True:
            try:
                arrival = self._queue.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                for w in arrival.works:
                    w.wait() if arrival.timeout is None else w.wait(arrival.timeout)
            except BaseException as exc:  # noqa: BLE001 — handed to the training thread by check()
                arrival.error = exc
            arrival.works = []
            arrival.event.set()


_WAITERS: weakref.WeakKeyDictionary[dist.ProcessGroup, Waiter] = weakref.WeakKeyDictionary()


def waiter_for(group: dist.ProcessGroup) -> Waiter:
    """``group``'s waiter (made at its first use; forgotten with the group)."""
    waiter = _WAITERS.get(group)
    if waiter is None:
        waiter = _WAITERS[group] = Waiter(f"gradientflow-waiter-{len(_WAITERS)}")
    return waiter
