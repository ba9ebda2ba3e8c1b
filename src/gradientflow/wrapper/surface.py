"""What every part of ``DistributedDataParallel`` may rely on: its attributes and methods, declared once.

The wrapper is one class composed of parts by idea (torch DDP's surface in :mod:`.torch_api`, pickling and
checkpoints in :mod:`.checkpoint`, nesting in :mod:`.nested`, the rest in :mod:`.ddp`).  Each part reads
state that :mod:`.ddp` sets at construction; declaring it here, once, lets the type checker read every part
(a part that used an attribute nobody sets would fail ``make lint``).  Declarations only: nothing here runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch import nn

    from ..config import GradientFlowConfig
    from ..diagnostics.watchdog import Watchdog
    from ..engine.reducer import Reducer
    from .auto import AutoState
    from .fewer_syncs import FewerSyncs


class WrapperSurface:
    """The attributes :mod:`.ddp` sets (torch DDP's public ones and gradientflow's ``_gf_*``) and the methods the
    parts call on each other, for the type checker."""

    # torch DDP's public attributes (same names and meaning)
    module: nn.Module
    process_group: dist.ProcessGroup
    device_ids: Any  # as torch DDP types them (its own base class declares them too)
    output_device: Any
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    forward_sync_buffers: bool
    static_graph: bool
    # gradientflow's
    config: GradientFlowConfig
    _gf_engine: Reducer
    _gf_watchdog: Watchdog
    _gf_world_size: int
    _gf_params: list[nn.Parameter]
    _gf_sparse_params: list[nn.Parameter]
    _gf_module_buffers: list[torch.Tensor]
    _gf_ignored: set[str]
    _gf_auto: AutoState
    _gf_outer: FewerSyncs | None  # sync_every > 1 (fewer_syncs.py)
    _gf_replicas: Any  # a torchft Manager: replicas that come and go (outer/membership.py); None: a fixed set
    _join_config: Any  # torch's Joinable sets it

    if TYPE_CHECKING:  # defined in ddp.py and nested.py

        def _gf_attach_group(self, group: dist.ProcessGroup) -> None: ...

        def _gf_collect_tensors(self) -> None: ...

        def _gf_build_engine(self, order: list[int] | None, layout_final: bool = False) -> None: ...

        def _gf_refuse_if_nested(self, what: str) -> None: ...

        def comm_stats(self, total: bool = False) -> dict[str, float | int | str]: ...
