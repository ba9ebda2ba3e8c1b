"""The 2-D HSDP mesh (replicate, shard): building it from torchrun's layout, and reading one a user built.

HSDP shards a model over the ranks of a node (the mesh's second dimension, ``shard``) and replicates it between
nodes (the first, ``replicate``).  :func:`gradientflow.fsdp.fully_shard` gives torch's ``fully_shard`` the 1-D
``shard`` submesh and does the ``replicate`` dimension's reduction itself (:mod:`.exchange`), so a mesh it is
given must say which dimension is which: :func:`split_mesh` reads it, or raises what to pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..comm.topology import resolve_topology

DIM_NAMES = ("replicate", "shard")
"""The dimension names :func:`hsdp_mesh` gives (torchtitan's ``dp_replicate`` / ``dp_shard`` are read too)."""
REPLICATE_NAMES = ("replicate", "dp_replicate")
SHARD_NAMES = ("shard", "dp_shard")


def _device_type() -> str:
    """The mesh's device: CUDA where the default group is NCCL's, else CPU (Gloo)."""
    backend = str(dist.get_backend()).lower()
    return "cuda" if torch.cuda.is_available() and "nccl" in backend else "cpu"


def hsdp_mesh(nodes: int | None = None, per_node: int | None = None, *, device_type: str | None = None) -> DeviceMesh:
    """The HSDP mesh ``(nodes, per_node)`` over every rank, dimensions named ``("replicate", "shard")``.

    Without arguments the layout is torchrun's: ``LOCAL_WORLD_SIZE`` ranks per node, ranks node-contiguous (rank =
    node * per_node + local; checked against ``GROUP_RANK`` / ``LOCAL_RANK``).  ``device_type``: the mesh's device
    ("cuda" where the default group is NCCL's, else "cpu").  Needs an initialised default process group.
    """
    if not dist.is_initialized():
        raise RuntimeError("gradientflow.fsdp.hsdp_mesh: call torch.distributed.init_process_group() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if (nodes is None) != (per_node is None):
        raise ValueError(
            f"gradientflow.fsdp.hsdp_mesh: pass both nodes and per_node (nodes * per_node = {world}), or neither "
            f"(torchrun's LOCAL_WORLD_SIZE), got nodes={nodes!r}, per_node={per_node!r}"
        )
    if nodes is None or per_node is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError(
                "gradientflow.fsdp.hsdp_mesh: not launched by torchrun (no LOCAL_WORLD_SIZE), so the node layout is "
                f"unknown: pass hsdp_mesh(nodes, per_node) with nodes * per_node = {world}"
            )
        resolve_topology("auto", world, rank, os.environ, whole_world=True)  # its checks of the layout, its errors
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = world // per_node
    if (
        any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (nodes, per_node))
        or nodes * per_node != world
    ):
        raise ValueError(
            f"gradientflow.fsdp.hsdp_mesh: nodes x per_node must be positive ints whose product is the world size "
            f"{world}, got {nodes!r} x {per_node!r}"
        )
    return init_device_mesh(device_type or _device_type(), (nodes, per_node), mesh_dim_names=DIM_NAMES)


@dataclass(frozen=True)
class HSDPMesh:
    """A 2-D HSDP mesh read by :func:`split_mesh`: ``nodes`` x ``per_node`` ranks."""

    mesh: DeviceMesh
    shard: DeviceMesh
    """The 1-D submesh of this rank's node: what torch's ``fully_shard`` shards over."""
    replicate: dist.ProcessGroup
    """This rank and its peers of the same shard on the other nodes: the reduction gradientflow does."""
    nodes: int
    per_node: int

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.per_node}"


def split_mesh(mesh: object) -> HSDPMesh:
    """``mesh`` as (replicate, shard), or ``ValueError`` saying what to pass (raised alike on every rank: every rank
    holds the same mesh)."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            "gradientflow.fsdp.fully_shard needs mesh=, a 2-D DeviceMesh (replicate, shard): e.g. "
            "gradientflow.fsdp.hsdp_mesh() from torchrun's layout, or init_device_mesh(device, (nodes, per_node), "
            f"mesh_dim_names=('replicate', 'shard')); got {mesh!r}"
        )
    if mesh.ndim != 2:
        raise ValueError(
            f"gradientflow.fsdp.fully_shard: mesh is {mesh.ndim}-D {tuple(mesh.shape)}; gradientflow compresses the "
            "reduction between replicas, and a 1-D mesh has none (plain FSDP: use torch.distributed.fsdp.fully_shard "
            "as it is). For HSDP pass a 2-D mesh (replicate, shard): gradientflow.fsdp.hsdp_mesh(), or "
            "init_device_mesh(device, (nodes, per_node), mesh_dim_names=('replicate', 'shard'))."
        )
    names = mesh.mesh_dim_names
    if names is None or names[0] not in REPLICATE_NAMES or names[1] not in SHARD_NAMES:
        raise ValueError(
            f"gradientflow.fsdp.fully_shard: the mesh's dimensions are named {names}; HSDP's are (replicate, shard), "
            "in that order: between nodes first, inside a node second. Build it with mesh_dim_names=('replicate', "
            "'shard') (or torchtitan's ('dp_replicate', 'dp_shard')), or use gradientflow.fsdp.hsdp_mesh()."
        )
    nodes, per_node = mesh.shape
    return HSDPMesh(mesh, mesh[names[1]], mesh.get_group(names[0]), int(nodes), int(per_node))
