"""gradientflow's DDP as the torch suite's ranks construct it (``device_ids`` dropped: the module is on the CPU)."""

from __future__ import annotations

from typing import Any

import torch

from ...wrapper.ddp import DistributedDataParallel


class GradientflowOnCpu(DistributedDataParallel):
    def __init__(self, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None, *a, **k) -> None:
        super().__init__(module, None, None, *a, **k)
