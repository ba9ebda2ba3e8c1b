"""Construction errors on every rank: no rank waits in a collective for a rank that failed.

The wrapper validates everything local first (arguments, options, the module); then every rank,
failed or not, takes part in one MAX allreduce of a failure flag before any other collective.
A rank whose own validation failed raises its error; the others raise :class:`PeerSetupError`
naming the failed rank, within the allreduce's round trip instead of a timeout later.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..diagnostics.watchdog import Watchdog, resolve_timeout
from .compat import DDPValueError


class PeerSetupError(DDPValueError):
    """Another rank could not build its wrapper (its own error is raised there)."""


def fallback_group(process_group: Any, device_mesh: Any) -> dist.ProcessGroup | None:
    """The group a failed construction agrees on (None: no process group, nobody to tell)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    if process_group is not None:
        return process_group
    if device_mesh is not None and getattr(device_mesh, "ndim", 1) == 1:
        return device_mesh.get_group()
    return dist.group.WORLD


def agree_on_construction(error: BaseException | None, group: dist.ProcessGroup | None, module: nn.Module) -> None:
    """Raise on every rank if any rank's local validation failed (``error``: this rank's, or None)."""
    if group is None:
        if error is not None:
            raise error
        return
    params = list(module.parameters())
    device = params[0].device if params and params[0].device.type != "meta" else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([0 if error is None else dist.get_rank() + 1], dtype=torch.int64, device=device)
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
    Watchdog(group, resolve_timeout(None, group)).wait(work, "construction check", 8)
    failed = int(flag.item())
    if error is not None:
        raise error
    if failed:
        raise PeerSetupError(
            f"gradientflow.DistributedDataParallel could not be built on rank {failed - 1} (its error says why); "
            "this rank raises too, so that no rank waits for it. Fix that rank's arguments or model."
        )
