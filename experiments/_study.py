"""What the AdamW experiments share: the quality bench's transformer job, joined as its ranks join.

Not part of the package: only ``adamw_bursts.py`` and ``adamw_variants.py`` (run as scripts from the
repository root, so this folder is on ``sys.path``) use it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

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
