"""One FSDP module's counters of what crossed between nodes (:class:`ExchangeCounters`), and the modules of a model
that hold them (:func:`comms`): kept by :mod:`.module_comm`, summed by :mod:`.stats`, saved by :mod:`.checkpoint`.
Below all three, so none imports another to reach them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

FIELDS = ("exchanges", "payload_bytes", "dense_bytes", "sent_bytes", "dense_sent_bytes", "seconds")


@dataclass
class Counts:
    """One set of counters (an exchange's, a step's or a run's)."""

    exchanges: int = 0
    payload_bytes: int = 0
    dense_bytes: int = 0
    sent_bytes: int = 0
    dense_sent_bytes: int = 0
    seconds: float = 0.0

    def add(self, other: Counts) -> None:
        for name in FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class ExchangeCounters:
    """One module's counters: its last exchange (``last``), every exchange since construction (``total``), and the
    micro-steps held back for a later one (``set_requires_all_reduce(False)``: nothing sent)."""

    last: Counts = field(default_factory=Counts)
    total: Counts = field(default_factory=Counts)
    held: int = 0

    def record(self, counts: Counts) -> None:
        self.last = counts
        self.total.add(counts)


def comms(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, :class:`gradientflow.fsdp.module_comm.ModuleComm`) of every module of ``model`` that
    :func:`gradientflow.fsdp.fully_shard` sharded and that holds parameters of its own (a root whose parameters are
    all its blocks' has no exchange, no state, and under ``"auto"`` no optimizer to switch it), in ``named_modules``
    order."""
    for name, module in model.named_modules():
        comm = getattr(module, "_gf_fsdp", None)
        if comm is not None and comm.param_group is not None:
            yield name, comm
