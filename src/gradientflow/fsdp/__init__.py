"""FSDP2 and HSDP with gradientflow's compression between nodes: ``from gradientflow.fsdp import fully_shard``.

docs/fsdp.md: the one-import change, the mesh, what crosses the link and what was measured.
"""

from __future__ import annotations

from .api import fully_shard
from .checkpoint import CommState, check_checkpoint, comm_state
from .mesh import hsdp_mesh
from .stats import comm_stats

__all__ = ["CommState", "check_checkpoint", "comm_state", "comm_stats", "fully_shard", "hsdp_mesh"]
