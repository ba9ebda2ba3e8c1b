"""A Chrome-trace timeline of chosen steps (``trace_path=``, ``trace_steps=``), one file per rank.

The file is Chrome's trace-event JSON (``{"traceEvents": [...]}``), loadable in Perfetto
(ui.perfetto.dev) or ``chrome://tracing``; ``gradientflow trace-summary FILE`` prints where the
time went.  Events (all complete events, ``"ph": "X"``, times in µs):

==============  ============  =====================================================================
cat             track         what
==============  ============  =====================================================================
``forward``     engine        the wrapper's forward (incl. the buffer broadcast)
``backward``    engine        first gradient hook to autograd's final callback
``launch``      engine        handing a bucket over (dense: pre-divide + cast; CSC: accumulate + score)
``final``       engine        the end of backward: tail launch, waiting, CSC select/pack/write-back
``csc``         engine        CSC phases inside ``final`` (``csc.select+pack``, ``csc.write-back``)
``wait``        engine        one blocking wait on a collective (args: bytes)
``check``       engine        ``check_consistency`` / ``check_finite`` exchanges
``collective``  comm N        one collective from launch to completion (args: kind, bytes, algorithm)
==============  ============  =====================================================================

Collectives overlap each other and backward, so each goes on the first free "comm" track.  A
collective's completion is stamped when the engine next looks (a bucket launch or a wait): polled,
never a callback on the backend's thread (DESIGN.md), so the end of a span is an upper bound.

Cost: with tracing off the engine tests one attribute per step and per bucket; with tracing on but
outside ``trace_steps`` it tests one more flag.  Timestamps are wall-clock anchored, so the files
of several ranks can be opened together and line up (to the clocks' agreement).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import IO, Any

logger = logging.getLogger(__name__)


def trace_file(template: str, rank: int) -> str:
    """Where rank ``rank`` writes: ``{rank}`` replaced, else ``.rank<N>`` before the extension."""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    root, ext = os.path.splitext(template)
    return f"{root}.rank{rank}{ext or '.json'}"


class TraceRecorder:
    """Collects events of synchronised steps ``start <= step < stop`` and writes them per step.

    ``active`` is the only thing the engine looks at when deciding to record; it is recomputed
    by :meth:`set_step` whenever the engine's step counter moves.
    """

    def __init__(self, template: str, steps: tuple[int, int], rank: int, world_size: int) -> None:
        self.path = trace_file(template, rank)
        self.start, self.stop = steps
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self.active = False
        self._events: list[dict[str, Any]] = []
        self._pending: list[tuple[Any, str, int, float, dict[str, Any]]] = []
        self._done: list[tuple[float, float, str, int, dict[str, Any]]] = []
        self._lane_end: list[float] = []
        # Wall-clock anchor for perf_counter stamps: rank files line up when loaded together.
        self._origin_wall = time.time()
        self._origin_pc = time.perf_counter()
        self._written = False
        self._file: IO[str] | None = None
        self.set_step(0)

    # ---- clock ----------------------------------------------------------------------------
    def _us(self, pc: float) -> float:
        return round((self._origin_wall + (pc - self._origin_pc)) * 1e6, 3)

    # ---- steps ----------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """The engine moved to synchronised step ``step``; flush the step just finished if traced."""
        if self.active and step != self.step:
            self._flush()
        self.step = step
        self.active = self.start <= step < self.stop

    # ---- events ---------------------------------------------------------------------------
    def complete(self, name: str, cat: str, t0: float, t1: float, **args: Any) -> None:
        """An event on the engine track from ``perf_counter`` stamps ``t0`` to ``t1``."""
        self._poll()
        args["step"] = self.step
        self._events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": self._us(t0),
                "dur": round(max(0.0, t1 - t0) * 1e6, 3),
                "pid": self.rank,
                "tid": 0,
                "args": args,
            }
        )

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, cat, t0, time.perf_counter(), **args)

    def collective(self, handle: Any, kind: str, nbytes: int, t0: float, **args: Any) -> None:
        """A collective launched at ``t0``; its end is ``handle.completed_at`` once polled."""
        self._poll()
        args.update(kind=kind, bytes=nbytes, step=self.step)
        self._pending.append((handle, kind, nbytes, t0, args))
        self._poll()

    def _poll(self) -> None:
        if not self._pending:
            return
        still = []
        for item in self._pending:
            handle = item[0]
            if handle.poll():
                self._done.append((item[3], handle.completed_at, item[1], item[2], item[4]))
            else:
                still.append(item)
        self._pending = still

    # ---- output ---------------------------------------------------------------------------
    def _flush(self) -> None:
        """Close this step's collectives onto comm tracks and append the step's events to the file.

        The file is written incrementally and left valid JSON after every step: the events are
        appended, followed by the closing ``]}``, and the next step writes over that closing.  So
        a run that dies mid-window still leaves the steps it finished, at a cost per step of that
        step's events only.
        """
        now = time.perf_counter()
        for handle, kind, nbytes, t0, args in self._pending:
            end = handle.completed_at if handle.poll() else now
            self._done.append((t0, end, kind, nbytes, args))
        self._pending = []
        events, self._events = self._events, []
        for t0, t1, kind, _nbytes, args in sorted(self._done, key=lambda d: d[0]):
            lane = next((i for i, end in enumerate(self._lane_end) if end <= t0), len(self._lane_end))
            if lane == len(self._lane_end):
                self._lane_end.append(t1)
                events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": self.rank,
                        "tid": 1 + lane,
                        "args": {"name": f"comm {lane}"},
                    }
                )
            self._lane_end[lane] = t1
            events.append(
                {
                    "name": kind,
                    "cat": "collective",
                    "ph": "X",
                    "ts": self._us(t0),
                    "dur": round(max(0.0, t1 - t0) * 1e6, 3),
                    "pid": self.rank,
                    "tid": 1 + lane,
                    "args": args,
                }
            )
        self._done = []
        if self._file is None:
            directory = os.path.dirname(self.path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self._file = open(self.path, "w")  # kept open across the traced steps
            other = {
                "producer": "gradientflow",
                "rank": self.rank,
                "world_size": self.world_size,
                "trace_steps": [self.start, self.stop],
            }
            self._file.write(f'{{"displayTimeUnit": "ms", "otherData": {json.dumps(other)}, "traceEvents": [')
            events = [
                {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "engine"}},
            ] + events
            logger.info("gradientflow: writing trace of steps [%d, %d) to %s", self.start, self.stop, self.path)
        f = self._file
        f.write(("," if self._written else "") + ",".join(json.dumps(e) for e in events))
        self._written = self._written or bool(events)
        end = f.tell()
        f.write("]}")
        f.flush()
        f.seek(end)  # the next step writes over the closing "]}"
        if self.step + 1 >= self.stop:
            f.close()
            self._file = None


def phase_start(watchdog: Any) -> float | None:
    """A ``perf_counter`` stamp when ``watchdog``'s trace is recording, else ``None`` (no clock read)."""
    trace = watchdog.trace if watchdog is not None else None
    return time.perf_counter() if trace is not None and trace.active else None


def phase_end(watchdog: Any, name: str, t0: float | None, cat: str = "csc") -> None:
    """Record ``name`` from ``t0`` (a :func:`phase_start` stamp) to now; no-op when ``t0`` is ``None``."""
    if t0 is not None:
        watchdog.trace.complete(name, cat, t0, time.perf_counter())
