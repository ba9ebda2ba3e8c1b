"""A bench worker's memory: the resident set a mode adds (sampled while it is built), and malloc's
steady state for the timed steps (see :func:`timing_allocator`)."""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRss:
    """Samples this process's resident set every 2 ms while active; ``peak`` in MB."""

    def __enter__(self) -> PeakRss:
        self.peak = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb())


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_STEADY_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def timing_allocator() -> bool:
    """Give malloc back its steady-state behaviour before anything is timed.

    Workers start with ``MALLOC_MMAP_THRESHOLD_=131072`` (see :func:`launch_workers`): every
    tensor over 128 KB is mmapped and unmapped on free, so the RSS each mode adds while it is
    built is exact.  Timed like that, every step page-faults its activations (and a fresh
    ``.grad`` per parameter where ``zero_grad(set_to_none=True)`` dropped them): on ResNet-50,
    2 ranks, the compute-only step took 339 ms instead of 206, which dilutes every
    communication overhead.  A long-running process with glibc's default (dynamic) threshold
    reuses those blocks from its heap; 32 MB (the dynamic threshold's ceiling) and a trim
    threshold twice that are that steady state.  A no-op where glibc's ``mallopt`` is absent;
    returns whether the thresholds were set.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _STEADY_MMAP_THRESHOLD) and libc.mallopt(
            _M_TRIM_THRESHOLD, 2 * _STEADY_MMAP_THRESHOLD
        )
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.warning("bench: could not set malloc's thresholds; timing with the launcher's")
    return bool(ok)
