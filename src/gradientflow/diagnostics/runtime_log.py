"""torch DDP's runtime fields of ``_get_ddp_logging_data()``, from the timestamps the engine takes anyway.

Tools that read torch DDP's logging data (its tests, dashboards built on them) find the same keys here,
sampled as torch's ``Logger::set_runtime_stats_and_log`` samples them: at a synchronised forward,
for the step that completed before it, when that forward's iteration ``n`` (synchronised forwards
before it) is ``0 < n <= 10`` or a multiple of the sample rate (100, or
``_set_ddp_runtime_logging_sample_rate``).  ``iteration`` is the last sampled ``n``.

All times are integer nanoseconds, as torch's: the durations ``forward_compute_time`` (forward start
to backward start), ``backward_compute_time`` (backward start to autograd's final callback),
``backward_comm_time`` (first bucket launched to last collective done), ``backward_compute_comm_overlap_time``
(the part of the communication before the final callback), their ``avg_*`` over the samples, and the host
clock stamps ``forward_compute_time_start``, ``backward_compute_time_start``/``_end``,
``backward_comm_time_start``/``_end`` (epoch nanoseconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# perf_counter seconds -> epoch nanoseconds (the engine stamps with perf_counter: monotonic and cheap)
_EPOCH_OFFSET_NS = time.time_ns() - int(time.perf_counter() * 1e9)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9) + _EPOCH_OFFSET_NS


@dataclass
class StepTimes:
    """One synchronised step's perf_counter stamps (seconds); ``None`` where nothing happened."""

    forward: float | None = None
    backward_start: float | None = None
    backward_end: float | None = None
    comm_start: float | None = None
    comm_end: float | None = None
    ready_order: list[int] = field(default_factory=list)


@dataclass
class RuntimeLog:
    sample_rate: int = 100
    fields: dict[str, int | str] = field(default_factory=dict)
    _sums: dict[str, int] = field(default_factory=dict)
    _samples: int = 0
    last_error: str = ""  # the last error the engine or the wrapper raised (torch DDP's logging data reports it)

    def note_error(self, error: object) -> None:
        """An error about to be raised, as torch's logging data's ``error`` field shows it."""
        self.last_error = str(error)

    def set_sample_rate(self, sample_rate: int) -> None:
        """torch's ``_set_ddp_runtime_logging_sample_rate``: sample every ``sample_rate``-th iteration."""
        self.sample_rate = int(sample_rate)

    def at_forward(self, n: int, last: StepTimes | None) -> None:
        """A synchronised forward of iteration ``n``: sample ``last`` (the step before it) where torch does."""
        if last is None or not (n > 0 and (n <= 10 or n % self.sample_rate == 0)):
            return
        if last.forward is None or last.backward_start is None or last.backward_end is None:
            return
        comm_start = last.comm_start if last.comm_start is not None else last.backward_end
        comm_end = last.comm_end if last.comm_end is not None else comm_start
        durations = {
            "forward_compute_time": last.backward_start - last.forward,
            "backward_compute_time": last.backward_end - last.backward_start,
            "backward_comm_time": comm_end - comm_start,
            "backward_compute_comm_overlap_time": max(0.0, min(last.backward_end, comm_end) - comm_start),
        }
        self._samples += 1
        out: dict[str, int | str] = {"iteration": n}
        for name, seconds in durations.items():
            ns = max(0, int(seconds * 1e9))
            out[name] = ns
            self._sums[name] = self._sums.get(name, 0) + ns
            out[f"avg_{name}"] = self._sums[name] // self._samples
        out.update(
            forward_compute_time_start=_ns(last.forward),
            backward_compute_time_start=_ns(last.backward_start),
            backward_compute_time_end=_ns(last.backward_end),
            backward_comm_time_start=_ns(comm_start),
            backward_comm_time_end=_ns(comm_end),
            prev_iteration_grad_ready_order_indices=", ".join(map(str, last.ready_order)),
        )
        self.fields = out
