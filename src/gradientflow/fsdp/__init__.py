"""FSDP2 and HSDP with gradientflow's compression between nodes: ``from gradientflow.fsdp import fully_shard``.

Every name ``torch.distributed.fsdp`` exports is here too, the same object (``FSDPModule``, ``MixedPrecisionPolicy``,
...), ``fully_shard`` gradientflow's: torch's import line changes to this one whatever it imports
(tests/test_fsdp_user_code.py checks the list against torch's ``__all__``).  docs/fsdp.md: the one-import change,
the mesh, what crosses the link and what was measured.
"""

from __future__ import annotations

from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)

from .api import fully_shard
from .checkpoint import CommState, check_checkpoint, comm_state
from .mesh import hsdp_mesh
from .stats import comm_stats

__all__ = [
    # torch 2.13's torch.distributed.fsdp.__all__, fully_shard aside (gradientflow's, below): re-exported as they are
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "register_fsdp_forward_method",
    "UnshardHandle",
    "share_comm_ctx",
    # gradientflow's
    "CommState",
    "check_checkpoint",
    "comm_state",
    "comm_stats",
    "fully_shard",
    "hsdp_mesh",
]
