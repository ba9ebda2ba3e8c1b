"""The node layout of a process group, and how one bucket is cut for two-level synchronisation.

Pure functions (no collective, no environment read of their own): the wrapper hands them
torchrun's variables, and ``gradientflow simulate`` calls :func:`two_level_plan` as the engine does.

A layout is ``M`` nodes of ``G`` ranks each, ranks node-contiguous: group rank = node * G + local.
Two-level synchronisation runs where ``M > 1`` and ``G > 1``; every other layout is "flat" (each rank
its own node, today's single exchange over the whole group).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..option_values import TOPOLOGY_PATTERN as _NAMED
from ..option_values import check_topology_value


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``per_node`` ranks; ``name`` is ``"flat"`` or ``"MxG"`` (what ``model.config.topology`` shows)."""

    nodes: int
    per_node: int

    @property
    def two_level(self) -> bool:
        return self.nodes > 1 and self.per_node > 1

    @property
    def name(self) -> str:
        return f"{self.nodes}x{self.per_node}" if self.two_level else "flat"

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local_of(self, rank: int) -> int:
        return rank % self.per_node


def resolve_topology(value: str, world: int, rank: int, env: Mapping[str, str], whole_world: bool) -> Topology:
    """The layout ``value`` means for a group of ``world`` ranks in which this process is ``rank``.

    ``env``: torchrun's launch variables (``os.environ``).  ``whole_world``: the group is the default
    group (``"auto"`` describes the world's ranks, so a subgroup under ``"auto"`` stays flat).
    A layout that cannot hold: ``ValueError`` saying what to pass (raised on this rank; the wrapper's
    construction exchange raises it on every rank).
    """
    check_topology_value(value)
    flat = Topology(world, 1)
    if value == "flat":
        return flat
    m = _NAMED.fullmatch(value)
    if m is not None:
        nodes, per_node = int(m[1]), int(m[2])
        if nodes * per_node != world:
            raise ValueError(
                f"gradientflow: topology={value!r} names {nodes * per_node} ranks, the process group has {world}. "
                f"Pass topology='MxG' with M * G = {world}, topology='auto' or topology='flat'."
            )
        _check_against_launch(value, nodes, per_node, world, rank, env, whole_world)
        return Topology(nodes, per_node) if nodes > 1 and per_node > 1 else flat
    if not whole_world or "LOCAL_WORLD_SIZE" not in env:
        return flat  # not launched by torchrun (or a subgroup): every rank its own node, as before
    g, node, local, env_world, env_rank = _launch_variables(world, rank, env)
    if env_world != world or env_rank != rank:
        raise ValueError(
            f"gradientflow: topology='auto': torchrun's WORLD_SIZE={env_world}, RANK={env_rank} do not describe this "
            f"process group ({world} ranks, this one {rank}). Pass topology='flat' or topology='MxG'."
        )
    if g < 1 or world % g:
        raise ValueError(
            f"gradientflow: topology='auto': LOCAL_WORLD_SIZE={g} does not split the {world} ranks into equal nodes "
            "(uneven nodes). Pass topology='flat' (one exchange over every rank)."
        )
    if node * g + local != rank or not 0 <= local < g:
        raise ValueError(
            f"gradientflow: topology='auto': rank {rank} is LOCAL_RANK={local} of node GROUP_RANK={node} with "
            f"LOCAL_WORLD_SIZE={g}, so the ranks are not contiguous per node (rank = node * {g} + local). Pass "
            "topology='flat'."
        )
    return Topology(world // g, g) if world // g > 1 and g > 1 else flat


def _launch_variables(world: int, rank: int, env: Mapping[str, str]) -> tuple[int, int, int, int, int]:
    """(LOCAL_WORLD_SIZE, the node, LOCAL_RANK, WORLD_SIZE, RANK) from torchrun's variables (``LOCAL_WORLD_SIZE`` set).

    torchrun sets all of them; other launchers (accelerate's, SLURM scripts) may set LOCAL_* alone: then the node
    is the one that node-contiguous ranks give, and the group's own size and rank stand for the missing ones.
    """
    try:
        g = int(env["LOCAL_WORLD_SIZE"])
        node = int(env["GROUP_RANK"]) if "GROUP_RANK" in env else rank // max(g, 1)
        local = int(env.get("LOCAL_RANK", rank % max(g, 1)))
        return g, node, local, int(env.get("WORLD_SIZE", world)), int(env.get("RANK", rank))
    except ValueError as exc:
        raise ValueError(
            f"gradientflow: topology='auto' could not read torchrun's variables ({exc}). Pass topology='flat' or "
            "topology='MxG'."
        ) from exc


def _check_against_launch(
    value: str, nodes: int, per_node: int, world: int, rank: int, env: Mapping[str, str], whole_world: bool
) -> None:
    """``ValueError`` where torchrun's variables lay the ranks out otherwise than ``value`` (``nodes`` x ``per_node``).

    A named layout says which ranks share a machine; where the launch says so too, the two must agree: two-level
    on a layout the machines do not have sends its "inside a node" stage over the link between them, dense, while
    ``comm_stats()`` counts it as inside.  Compared literally (``"1x4"`` or ``"4x1"`` on a 2 x 2 launch is an error
    too, though both would run flat: ``topology="flat"`` says that choice without misnaming the machines).

    Taken as given where the launch does not describe this group: no ``LOCAL_WORLD_SIZE`` (forked or
    ``mp.spawn``-ed ranks, how the tests emulate nodes), a subgroup (torchrun's variables count the world's ranks,
    ``value`` the subgroup's), or ``WORLD_SIZE`` / ``RANK`` that are not this group's, or unreadable (the messages
    for ``"auto"`` recommend ``"MxG"`` there).  Every rank of a launch reads the same ``LOCAL_WORLD_SIZE``, so a
    layout of the wrong shape raises here on every rank; one that disagrees only in a rank's place (ranks not
    node-contiguous) raises on that rank, and the construction check raises on the others.
    """
    if not whole_world or "LOCAL_WORLD_SIZE" not in env:
        return
    try:
        g, node, local, env_world, env_rank = _launch_variables(world, rank, env)
    except ValueError:
        return
    if env_world != world or env_rank != rank:
        return
    if g == per_node and node == rank // per_node and local == rank % per_node:
        return
    launch = (
        f"{_of(world // g, 'node')} of {_of(g, 'rank')}" if g >= 1 and world % g == 0 else f"nodes of {_of(g, 'rank')}"
    )
    raise ValueError(
        f"gradientflow: topology={value!r} ({_of(nodes, 'node')} of {_of(per_node, 'rank')}) contradicts the launch: "
        f"torchrun's LOCAL_WORLD_SIZE={g}, WORLD_SIZE={env_world} ({launch}; this rank {rank} is LOCAL_RANK={local} "
        f"of node GROUP_RANK={node}). Pass topology='auto' (the launch's layout), or topology='flat' for one exchange "
        "over every rank."
    )


def _of(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


@dataclass(frozen=True)
class TwoLevelPlan:
    """How one bucket of ``numel`` elements travels two-level (see :func:`two_level_plan`).

    ``padded``: the wire buffer's length (``per_node * shard``); ``bounds``: each local rank's shard
    ``[a, b)`` within it; ``intra_bytes`` / ``inter_bytes``: bytes one rank sends inside its node (the
    reduce-scatter plus the all-gather, each ``(G-1)/G`` of the padded buffer) and between nodes (a ring
    allreduce of its shard among the ``M`` nodes: ``2 (M-1)/M`` of the shard), at ``itemsize`` bytes an
    element (the quantised recipe's inter-node bytes are its ring's, not a dense ring's: see
    ``QuantizedRing.sent_bytes``).
    """

    numel: int
    padded: int
    shard: int
    bounds: tuple[tuple[int, int], ...]
    intra_bytes: int
    inter_bytes: int


def two_level_plan(numel: int, nodes: int, per_node: int, block: int = 1, itemsize: int = 4) -> TwoLevelPlan:
    """Cut ``numel`` elements into ``per_node`` equal shards of whole ``block``-element blocks.

    Every rank computes the same plan from the same numbers.  The shard is ``ceil(numel / per_node)``
    rounded up to a whole block (the quantiser's block, so no block straddles two shards; 1 for a dense
    wire), the buffer padded with zeros to ``per_node`` shards.  Local rank ``j`` owns
    ``[j * shard, (j + 1) * shard)``: after the reduce-scatter inside the node it holds the node's sum there.
    """
    if numel < 0 or nodes < 1 or per_node < 1 or block < 1:
        raise ValueError(
            f"two_level_plan: numel >= 0, nodes, per_node, block >= 1, got {numel, nodes, per_node, block}"
        )
    blocks = -(-numel // block)
    shard = -(-blocks // per_node) * block
    padded = shard * per_node
    bounds = tuple((j * shard, (j + 1) * shard) for j in range(per_node))
    intra = 2 * (per_node - 1) * shard * itemsize
    inter = 2 * (nodes - 1) * shard * itemsize // nodes  # rounded down to whole bytes
    return TwoLevelPlan(numel, padded, shard, bounds, intra, inter)
