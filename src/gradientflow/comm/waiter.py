"""A daemon thread that only *waits* on posted works and flags their completion (:class:`Waiter`).

Gloo's point-to-point works, and its ``reduce_scatter_single``, never report completion before
``wait()`` (``is_completed()`` stays False, torch 2.13), so polling them cannot see it.  A waiter
thread waits on each posted group of works, in posting order, with the GIL released, and sets an
event; the training thread polls the event.  It never issues a collective: collectives are issued
from the training thread only, in the same order on every rank.  One waiter per process group
(the order it waits in is then the order the group completes in, so a slow group never delays
another group's events).
"""

from __future__ import annotations

import queue
import threading
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

    def __init__(self, name: str = "gradientflow-ring-waiter") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, works: list[dist.Work], timeout: timedelta | None) -> Arrival:
        arrival = Arrival(works, timeout)
        if not works:
            arrival.event.set()
            return arrival
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._queue.put(arrival)
        return arrival

    def _run(self) -> None:
        while True:
            arrival = self._queue.get()
            try:
                for w in arrival.works:
                    w.wait() if arrival.timeout is None else w.wait(arrival.timeout)
            except BaseException as exc:  # noqa: BLE001 — handed to the training thread by check()
                arrival.error = exc
            arrival.works = []
            arrival.event.set()


WAITER = Waiter()
"""The quantised ring's waiter (flat, or between nodes in two-level synchronisation)."""
STAGE_WAITERS = {stage: Waiter(f"gradientflow-{stage}-waiter") for stage in ("reduce-scatter", "all-gather", "inter")}
"""Two-level synchronisation's: one per stage, each stage on its own process group."""
