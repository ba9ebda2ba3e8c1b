"""What the experiments share: the quality bench's transformer job, joined as its ranks join (the AdamW studies),
and the standard library's sources as a file each replica loads (the replica studies).

Not part of the package: the experiments run as scripts from the repository root, so this folder is on
``sys.path``; ``adamw_bursts.py`` and ``adamw_variants.py`` use the first, ``rejoin_optimizer_state.py`` and
``replicas_under_failures.py`` the second.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradientflow.bench.quality import QualityOptions, plan_jobs
from gradientflow.bench.quality_data import WorkloadData
from gradientflow.bench.quality_spec import Job


def start_transformer_study(steps: int) -> tuple[Job, WorkloadData]:
    """Under torchrun: join the process group as the quality bench's ranks do (Gloo, one torch thread)
    and return its transformer job, ``steps`` long, with this rank's data (seed 0).

    The AdamW studies train exactly what ``gradientflow bench --quality`` trains, so their figures
    line up with its table.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    job = plan_jobs(QualityOptions(workloads=["transformer"], steps=steps, bandwidth="none"))[0][0]
    return job, WorkloadData(job, 0, dist.get_rank(), dist.get_world_size())


WINDOW = Job.seq_len
"""Tokens per validation window: the quality bench's transformer's context (64)."""


def save_stdlib_windows(path: Path, windows: int) -> None:
    """Write ``path`` (``torch.save``): the standard library's training ids and ``windows`` validation windows spread
    evenly over the held-out files (``val_x``, and ``val_y`` shifted by one), a corpus the run does not exhaust.

    Read once by the launcher: a replica that is (re)started loads the file in a second instead of reading the
    sources again."""
    from gradientflow.bench.quality_data import corpus_ids

    train, val, _ = corpus_ids("stdlib")
    n = (len(val) - 1) // WINDOW
    starts = torch.linspace(0, n - 1, min(n, windows)).long() * WINDOW
    offs = torch.arange(WINDOW)
    x, y = val[starts[:, None] + offs].long(), val[starts[:, None] + offs + 1].long()
    torch.save({"train": train, "val_x": x, "val_y": y}, path)


def evaluate(model: torch.nn.Module, val: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Mean cross-entropy of ``model`` over the validation windows ``val`` (inputs, targets)."""
    with torch.no_grad():
        logits = model(val[0])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), val[1].reshape(-1)).item()
