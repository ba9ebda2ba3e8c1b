"""The quality bench's learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math
from typing import Protocol

import torch


class Job(Protocol):
    """What the schedule reads of a quality job (:class:`gradientflow.bench.quality_spec.Job`)."""

    steps: int
    lr_warmup_frac: float


def lr_factor(step: int, steps: int, warmup: int, floor: float = 0.1) -> float:
    """LR multiplier at 0-based ``step``: linear warm-up over ``warmup`` steps (1/w, 2/w, ..., 1),
    then cosine from 1 down to ``floor`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_schedule(opt: torch.optim.Optimizer, job: Job) -> torch.optim.lr_scheduler.LambdaLR:
    """``job``'s schedule on ``opt`` (stepped once per training step): :func:`lr_factor` with a warm-up
    of ``lr_warmup_frac`` of the steps (at least one)."""
    warm = max(1, round(job.lr_warmup_frac * job.steps))
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, job.steps, warm))
