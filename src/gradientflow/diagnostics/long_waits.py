"""Nothing waits silently: one daemon thread per process looks at every watchdog's wait in progress once a second
and logs a long one once (:meth:`gradientflow.diagnostics.watchdog.Watchdog.warn_long_wait`).  Apart from the
watchdog, which sets what it waits on (``waiting``) and knows how to say it; this file only watches the clock."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)


class Watched(Protocol):
    """What the monitor reads of a watchdog."""

    waiting: tuple[float, str, int | None] | None
    warn_after_s: float

    def warn_long_wait(self, began: float, what: str, nbytes: int | None) -> None: ...


class Monitor:
    """One daemon thread per process that logs the long waits of every watchdog (:meth:`Watchdog.watched`): it
    looks once a second, so a wait costs the training thread two attribute writes and a set lookup.  It ends, and
    is joined, when the last watchdog it watched is freed (a wrapper deleted leaves no thread of ours behind, as
    torch DDP leaves none: tests/compat/test_compat_module.py); the next wait starts another."""

    PERIOD_S = 1.0

    def __init__(self) -> None:
        self._watched: weakref.WeakSet[Watched] = weakref.WeakSet()
        self._warned: dict[int, tuple[float, str, int | None]] = {}  # id(watchdog) -> the wait it logged
        # re-entrant: a watchdog freed by a collection while watch() holds the lock runs _gone() on this thread
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def watch(self, watchdog: Watched) -> None:
        if watchdog in self._watched and self._thread is not None:  # the common case: no lock
            return
        with self._lock:
            if watchdog not in self._watched:
                self._watched.add(watchdog)
                weakref.finalize(watchdog, self._gone)
            if self._thread is None:
                self._stop = threading.Event()  # the new thread's own: an earlier stop does not end it
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), name="gradientflow-wait-monitor", daemon=True
                )
                self._thread.start()

    def _gone(self) -> None:
        """A watchdog was freed: with none left, stop the thread and wait for it to end."""
        with self._lock:
            if any(True for _ in self._watched) or self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.PERIOD_S) and self._look():
            pass
        with self._lock:
            if self._thread is threading.current_thread():
                self._thread = None

    def _look(self) -> bool:
        """One look at every watched wait; False once none is left.  Its own frame: the strong references it takes
        to the watchdogs end when it returns, never held through the wait for the next look."""
        with self._lock:
            watched = list(self._watched)
        if not watched:
            return False
        now = time.monotonic()
        for w in watched:
            waiting = w.waiting
            if waiting is None or now - waiting[0] < w.warn_after_s or self._warned.get(id(w)) == waiting:
                continue
            self._warned[id(w)] = waiting  # once per wait
            try:
                w.warn_long_wait(*waiting)
            except Exception as exc:  # noqa: BLE001 — a log line must never end the monitor
                logger.debug("gradientflow: long-wait warning failed: %s", exc)
        return True


MONITOR = Monitor()
"""The process's one monitor."""
