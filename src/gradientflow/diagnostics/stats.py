"""Per-step communication counters, filled by the engine and read by ``model.comm_stats()``."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

PHASES = ("accumulate", "score", "select", "pack", "wire_wait", "unpack", "zero", "check")
"""The phases of :attr:`StepStats.phases`, in the order a step runs them."""


@dataclass
class StepStats:
    """What one synchronised backward did.

    collectives: collective calls on gradients (scores and packed chunks included for CSC).
    payload_bytes: the bytes of gradient data this rank hands to the exchange between nodes, in the wire's
        encoding: one copy of what it contributes (a ring then sends ``2 (N-1)/N`` of it; ``inter_node_bytes``
        counts what two-level sent).  Flat, every rank is its own node: the whole of each exchange (the dense wire
        buffer, CSC's scores and packed chunks, one quantised copy of a bucket).  Two-level: this rank's shard of
        each node-summed buffer (``two_level_plan``'s ``shard``), dense or quantised alike, warm-up steps included,
        plus CSC's scores (exchanged over every rank); the stages inside the node are ``intra_node_bytes``.
    dense_bytes: bytes one dense fp32 allreduce of every gradient would hand over (torch DDP's ``payload_bytes``).
    comm_seconds: first launch to last completion.
    exposed_seconds: time the end of backward waited on communication.
    control_bytes: bytes of bookkeeping collectives beside the gradients (the one-byte-per-parameter
        "used" flags), not counted in ``collectives`` / ``payload_bytes``.
    host_syncs: device-to-host reads on the step's path (``.item()``-like; each stalls a GPU stream).
    phases: seconds of host time per phase of the strategy's own work, reported as
        ``phase_<name>_s``: accumulate (fold the gradient into CSC's residual), score (per-chunk
        L1), select (top-k), pack (gather chunks, cast to the wire dtype), wire_wait (blocked on
        a collective), unpack (cast back, write into the pool), zero (clear the pool and the
        sent residual chunks), check (the step's one finite check).  On an accelerator these are
        launch times, not kernel times.
    """

    collectives: int = 0
    payload_bytes: int = 0
    dense_bytes: int = 0
    comm_seconds: float = 0.0
    exposed_seconds: float = 0.0
    control_bytes: int = 0
    host_syncs: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    extra: dict[str, float | int] = field(default_factory=dict)
    _first_launch: float | None = None
    _last_done: float | None = None

    def record_collective(self, nbytes: int) -> None:
        if self._first_launch is None:
            self._first_launch = time.perf_counter()
        self.collectives += 1
        self.payload_bytes += nbytes

    def record_done(self, stamp: float | None) -> None:
        stamp = time.perf_counter() if stamp is None else stamp
        if self._last_done is None or stamp > self._last_done:
            self._last_done = stamp

    def phase(self, name: str, t0: float) -> float:
        """Add the time since ``t0`` to phase ``name``; return now (the next phase's ``t0``)."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + (now - t0)
        return now

    def comm_span(self) -> tuple[float | None, float | None]:
        """perf_counter of the first launch and of the last completion (``None``: no collective)."""
        return self._first_launch, self._last_done

    def close(self) -> None:
        if self._first_launch is not None and self._last_done is not None:
            self.comm_seconds = max(0.0, self._last_done - self._first_launch)

    def as_dict(self) -> dict[str, float | int]:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_") and k not in ("extra", "phases")}
        d.update({f"phase_{k}_s": v for k, v in self.phases.items()})
        d.update(self.extra)
        return d


TOTALLED = (
    "collectives",
    "payload_bytes",
    "dense_bytes",
    "comm_seconds",
    "exposed_seconds",
    "control_bytes",
    "host_syncs",
)
"""The counters of :class:`StepStats` that add up over a run (with every ``phase_<name>_s`` and every ``extra``
key but :data:`PER_STEP_ONLY`)."""
PER_STEP_ONLY = frozenset({"density", "n_chunks", "quant_bits", "quant_block"})
"""The ``extra`` keys that describe a step's setting, not what it did: a sum of them means nothing, so totals
leave them out.  Every other ``extra`` key is a count or a number of bytes (``inter_node_bytes``,
``intra_node_bytes``, CSC's ``selected_chunks``, ``warmup``, ``warmup_ramp``, ``overflow``, ``slices``,
``slices_in_backward``): totalled over the steps that report it."""


@dataclass
class RunTotals:
    """Every synchronised step's counters summed since the wrapper was built: ``comm_stats(total=True)``.

    Like torch's and Horovod's own counters, a property of this process's run, not of the training
    state: a rebuild of the engine (``.to()``, ``compression="auto"`` switching) keeps them, and
    neither ``comm_state_dict()`` saves them nor loading one changes them.
    """

    steps: int = 0
    sums: dict[str, float | int] = field(default_factory=lambda: dict.fromkeys(TOTALLED, 0))

    def add(self, step: StepStats) -> None:
        self.steps += 1
        for key in TOTALLED:
            self.sums[key] += getattr(step, key)
        for name, seconds in step.phases.items():
            key = f"phase_{name}_s"
            self.sums[key] = self.sums.get(key, 0.0) + seconds
        for key, value in step.extra.items():
            if key not in PER_STEP_ONLY:
                self.sums[key] = self.sums.get(key, 0) + value

    def as_dict(self) -> dict[str, float | int]:
        return {"steps": self.steps, **self.sums}
