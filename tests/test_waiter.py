"""The waiter threads (``comm/waiter.py``): one per process group, each ending when idle and starting again on use."""

from __future__ import annotations

import threading
import time

from gradientflow.comm import waiter as waiter_mod


class _Work:
    """A posted work that completes when ``release`` is set (what ``wait()`` blocks on)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def wait(self, timeout: object = None) -> bool:
        self.release.wait()
        return True


class _Group:
    """Stands for a process group: ``waiter_for`` only needs it hashable and weakly referable."""


def test_one_waiter_per_group_so_a_slow_group_holds_no_other_back() -> None:
    a, b = _Group(), _Group()
    assert waiter_mod.waiter_for(a) is waiter_mod.waiter_for(a)
    assert waiter_mod.waiter_for(a) is not waiter_mod.waiter_for(b)
    stuck = threading.Event()  # never set until the end: a's round whose peer has not posted yet
    slow = waiter_mod.waiter_for(a).watch([_Work(stuck)], None)  # type: ignore[list-item]
    ready = threading.Event()
    ready.set()
    fast = waiter_mod.waiter_for(b).watch([_Work(ready)], None)  # type: ignore[list-item]
    assert fast.event.wait(5), "b's works completed, but its event waited behind a's"
    assert not slow.event.is_set()
    stuck.set()
    assert slow.event.wait(5)


def test_an_idle_waiter_thread_ends_and_the_next_watch_starts_another(monkeypatch) -> None:
    monkeypatch.setattr(waiter_mod.Waiter, "IDLE_SECONDS", 0.05)
    w = waiter_mod.Waiter("test-waiter")
    done = threading.Event()
    done.set()
    assert w.watch([_Work(done)], None).event.wait(5)  # type: ignore[list-item]
    deadline = time.monotonic() + 5
    while w._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w._thread is None, "the idle thread did not end"
    assert w.watch([_Work(done)], None).event.wait(5)  # type: ignore[list-item]
