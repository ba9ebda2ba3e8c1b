"""torch DDP's constructor arguments, translated into what gradientflow does with each.

``resolve_ddp_args`` is a pure function of the arguments and the module's parameter devices: it
returns the settings the engine uses, or raises ``ValueError`` naming the argument and what to do
instead.  No argument that would change results is ever ignored silently.  ``move_to_device``
moves a forward's inputs to the module's device as DDP does when ``device_ids`` is given.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import GradientFlowConfig
from ..option_values import QUANT_THETA_MB, check_theta

DEFAULT_BUCKET_CAP_MB = 25.0


class DDPValueError(ValueError, RuntimeError):
    """A setup torch DDP refuses with ``RuntimeError`` and gradientflow with ``ValueError`` (what to do
    instead): both ``except`` clauses catch it."""


@dataclass(frozen=True)
class DDPSettings:
    """What the wrapper takes from torch DDP's arguments (``check_reduction``, ``skip_all_reduce_unused_params`` and
    ``batched_grad_copy`` are accepted and have no effect: none of them is here)."""

    device: torch.device | None  # inputs are moved here at forward (device_ids given), else None
    process_group: dist.ProcessGroup
    fusion_threshold_mb: float
    theta_given: bool  # bucket_cap_mb or fusion_threshold_mb passed: a recipe's own default θ stays unused
    forward_sync_buffers: bool  # broadcast buffers from rank 0 at every synchronised forward
    init_sync: bool  # compare models and broadcast rank 0's state at construction
    init_sync_buffers: bool  # ... buffers included (the deprecated broadcast_buffers=False excludes them)
    static_graph: bool
    # torch DDP's public attributes of the same names, as torch DDP sets them
    device_ids: list[int | torch.device] | None
    output_device: int | torch.device | None  # device_ids[0] where device_ids is given and output_device is not
    dim: int
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    device_mesh: Any
    bucket_cap_mb_list: list[int] | None


def recipe_theta(config: GradientFlowConfig, theta_given: bool) -> GradientFlowConfig:
    """``config`` with its recipe's own θ where the user gave none: :data:`~gradientflow.option_values.QUANT_THETA_MB`
    for the quantised recipe (``schedule="auto"`` derives θ itself and keeps it)."""
    if theta_given or not config.quantized or config.schedule != "fixed":
        return config
    return dataclasses.replace(config, fusion_threshold_mb=QUANT_THETA_MB)


def _device_index(d: Any) -> torch.device:
    if isinstance(d, torch.device):
        return d
    if isinstance(d, int):
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return torch.device(acc.type if acc is not None else "cuda", d)
    return torch.device(d)


def resolve_ddp_args(
    module: nn.Module,
    *,
    device_ids: list[int | torch.device] | None,
    output_device: int | torch.device | None,
    dim: int,
    broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None,
    init_sync: bool,
    process_group: dist.ProcessGroup | None,
    device_mesh: Any,
    bucket_cap_mb: float | None,
    fusion_threshold_mb: float | None,
    bucket_cap_mb_list: list[int] | None,
    find_unused_parameters: bool,
    gradient_as_bucket_view: bool,
    static_graph: bool,
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
) -> DDPSettings:
    """Validate torch DDP's arguments against gradientflow and return the settings to use.

    1. Unsupported arguments raise ``ValueError`` with the alternative.
    2. ``bucket_cap_mb`` is θ; given together with ``fusion_threshold_mb`` they must agree.
    3. ``device_ids`` / ``output_device`` follow DDP's rule: only for a module on one
       accelerator device; CPU and multi-device modules take ``None``.
    4. ``broadcast_buffers`` (deprecated in torch 2.13) / ``forward_sync_buffers`` resolve as in DDP.
    """
    # 1. What has no counterpart here.
    if mixed_precision is not None:
        raise ValueError(
            "mixed_precision (DDP's private _MixedPrecision) is not supported: use comm_dtype='fp16' or "
            "'bf16' for gradients on the wire, and torch.autocast (+ torch.amp.GradScaler) for compute."
        )
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise ValueError(
            "delay_all_reduce_named_params / param_to_hook_all_reduce are not supported: gradientflow fuses "
            "every gradient into θ-sized slices of one pool (fusion_threshold_mb); to keep parameters out of "
            "synchronisation set module._ddp_params_and_buffers_to_ignore."
        )
    # bucket_cap_mb_list (per-bucket sizes after the rebuild) is recorded, not used: the pool is cut
    # by one threshold, and bucket sizes change when bytes go on the wire, never the result.
    if device_mesh is not None:
        if process_group is not None:
            raise DDPValueError("Cannot specify both process_group and device_mesh arguments: pass one of them.")
        if getattr(device_mesh, "ndim", 1) != 1:
            raise DDPValueError(
                f"Only 1D device mesh is supported, got a {device_mesh.ndim}-D mesh: pass "
                "process_group=mesh.get_group(mesh_dim=...) for the data-parallel dimension."
            )
        process_group = device_mesh.get_group()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "gradientflow.DistributedDataParallel needs an initialised process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (e.g. under torchrun)."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None  # initialised: checked above

    # 2. θ, checked under the name the user passed (torch DDP's bucket_cap_mb or ours).
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("fusion_threshold_mb", fusion_threshold_mb)):
        if value is not None:
            check_theta(name, value)
    if (
        bucket_cap_mb is not None
        and fusion_threshold_mb is not None
        and float(bucket_cap_mb) != float(fusion_threshold_mb)
    ):
        raise ValueError(
            f"bucket_cap_mb={bucket_cap_mb} and fusion_threshold_mb={fusion_threshold_mb} disagree: they are the "
            "same setting (θ, MB per fused allreduce); pass one of them."
        )
    theta = fusion_threshold_mb if fusion_threshold_mb is not None else bucket_cap_mb
    theta = DEFAULT_BUCKET_CAP_MB if theta is None else theta

    # 3. Devices.
    devices = {p.device for p in module.parameters()}
    if device_ids is not None and not isinstance(device_ids, (list, tuple)):
        raise ValueError(f"device_ids must be None or a list with one device, got {device_ids!r}")
    on_one_accelerator = len(devices) == 1 and next(iter(devices)).type not in ("cpu", "meta")
    device: torch.device | None = None
    if device_ids:
        if len(device_ids) != 1:
            raise ValueError(
                f"device_ids={list(device_ids)}: one process per device is required (single-process "
                "multi-device is gone from torch DDP too); pass device_ids=[local_rank]."
            )
        if not on_one_accelerator:
            raise ValueError(
                f"device_ids={list(device_ids)} only works with a module on one accelerator device; this module's "
                f"parameters are on {sorted(map(str, devices))}. Move the module first (module.to(device)) or pass "
                "device_ids=None (CPU and multi-device modules)."
            )
        device = _device_index(device_ids[0])
        if device != next(iter(devices)):
            raise ValueError(
                f"device_ids={list(device_ids)} but the module's parameters are on {next(iter(devices))}: "
                "call module.to(device_ids[0]) before wrapping it."
            )
    elif output_device is not None:
        raise ValueError(
            "output_device only applies with device_ids (a module on one accelerator device); pass "
            "output_device=None for CPU and multi-device modules."
        )

    # 4. Buffers.
    if broadcast_buffers is not None:
        warnings.warn(
            "`broadcast_buffers` is deprecated in torch 2.13 DDP; `forward_sync_buffers` replaces it "
            "(unlike broadcast_buffers=False, forward_sync_buffers=False still syncs buffers at init).",
            FutureWarning,
            stacklevel=2,  # the wrapper's constructor, which calls this
        )
    if forward_sync_buffers is not None:
        forward, at_init = bool(forward_sync_buffers), True
    else:
        forward = at_init = broadcast_buffers if broadcast_buffers is not None else True
    return DDPSettings(
        device=device,
        process_group=group,
        fusion_threshold_mb=theta,
        theta_given=fusion_threshold_mb is not None or bucket_cap_mb is not None,
        forward_sync_buffers=bool(forward),
        init_sync=bool(init_sync),
        init_sync_buffers=bool(at_init),
        static_graph=bool(static_graph),
        device_ids=list(device_ids) if device_ids else None,
        output_device=output_device if output_device is not None or not device_ids else device_ids[0],
        dim=dim,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
        device_mesh=device_mesh,
        bucket_cap_mb_list=bucket_cap_mb_list,
    )


def sparse_gradient_params(module: nn.Module) -> set[str]:
    """Names of the parameters that get sparse gradients (``nn.Embedding`` / ``EmbeddingBag(sparse=True)``)."""
    names = set()
    for mod_name, mod in module.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse:
            names.add(f"{mod_name}.weight" if mod_name else "weight")
    return names


def move_to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside (lists, tuples, namedtuples, dicts, dataclasses) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(move_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, move_to_device(v, device)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: move_to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        )
    return obj
