"""The 2-D HSDP mesh (replicate, shard): building it from torchrun's layout, and reading one a user built.

HSDP shards a model over the ranks of a node (the mesh's second dimension, ``shard``) and replicates it between
nodes (the first, ``replicate``).  :func:`gradientflow.fsdp.fully_shard` gives torch's ``fully_shard`` the 1-D
``shard`` submesh and does the ``replicate`` dimension's reduction itself (:mod:`.exchange`), so a mesh it is
given is read as torch reads a 2-D mesh, by position (:func:`split_mesh`), and checked against torchrun's layout
(:func:`check_against_launch`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..comm.topology import resolve_topology

DIM_NAMES = ("replicate", "shard")
"""The dimension names :func:`hsdp_mesh` gives.  A mesh a user built is read by position, as torch's ``fully_shard``
reads it (dimension 0 replicates, 1 shards), whatever its names (torchtitan's ``dp_replicate`` / ``dp_shard``)."""


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
    if names is None:  # torch's fully_shard asserts on an unnamed 2-D mesh too: its dimensions are found by name
        raise ValueError(
            f"gradientflow.fsdp.fully_shard: the 2-D mesh {tuple(mesh.shape)} has no dimension names; HSDP's mesh "
            "is named, as torch's fully_shard requires (dimension 0 between nodes, 1 inside a node, whatever the "
            "names). Build it with init_device_mesh(device, (nodes, per_node), mesh_dim_names=('replicate', "
            "'shard')), or use gradientflow.fsdp.hsdp_mesh()."
        )
    nodes, per_node = (int(n) for n in mesh.shape)
    return HSDPMesh(mesh, mesh[names[1]], mesh.get_group(names[0]), nodes, per_node)


def check_against_launch(hsdp: HSDPMesh, env: Mapping[str, str]) -> None:
    """``ValueError`` where torchrun's layout contradicts the mesh: each row of the mesh (a ``shard`` group) must be
    one node's ranks, and each node hold one row.  Otherwise the exchange "between nodes" runs inside a node (a
    ``(4, 1)`` mesh on 2 nodes of 2: compressing traffic that never crosses the link) or torch's reduce-scatter
    "inside a node" crosses the link, dense, while nothing is compressed (``(1, 4)``).  The DDP door refuses the same
    contradiction (:func:`gradientflow.comm.topology.resolve_topology`).

    Taken as given where the launch does not describe the default group: no ``LOCAL_WORLD_SIZE`` (forked or
    ``mp.spawn``-ed ranks), or torchrun's ``WORLD_SIZE`` / ``RANK`` not the default group's."""
    if "LOCAL_WORLD_SIZE" not in env:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if env.get("WORLD_SIZE", str(world)) != str(world) or env.get("RANK", str(rank)) != str(rank):
        return
    resolve_topology("auto", world, rank, env, whole_world=True)  # LOCAL_WORLD_SIZE read and the ranks contiguous
    g = int(env["LOCAL_WORLD_SIZE"])
    rows = [[int(r) // g for r in row] for row in hsdp.mesh.mesh.tolist()]  # each mesh rank's node
    one_node_each = all(len(set(row)) == 1 for row in rows)
    if one_node_each and len({row[0] for row in rows}) == len(rows):
        return
    names = hsdp.mesh.mesh_dim_names
    raise ValueError(
        f"gradientflow.fsdp.fully_shard: the mesh {hsdp.nodes} x {hsdp.per_node} {names} contradicts the launch: "
        f"torchrun's LOCAL_WORLD_SIZE={g}, WORLD_SIZE={world} ({_of(world // g, 'node')} of {_of(g, 'rank')}). "
        "HSDP's mesh is (between nodes, inside a node) by position: "
        + (
            "a row of the mesh (dimension 1) spans several nodes, so its reduce-scatter would cross the link, dense."
            if not one_node_each
            else "several rows of the mesh lie on one node, so the exchange between its rows would not leave it."
        )
        + f" Pass gradientflow.fsdp.hsdp_mesh() (the launch's layout: {world // g} x {g}), or a mesh of "
        "dimensions (nodes, ranks per node). A single node's FSDP has nothing between nodes to compress: use "
        "torch.distributed.fsdp.fully_shard on a 1-D mesh there."
    )


def _of(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"
