"""``sync_every=H`` behind ``fully_shard`` (DiLoCo over HSDP): the outer loop over this rank's shards.

Inner steps: torch's all-gather and reduce-scatter inside the node, nothing between nodes (the modules' all-reduce
hooks, :class:`.module_comm.ModuleComm`, send nothing, as on one node).  Every H steps the outer sync of the one
outer loop (:class:`gradientflow.outer.loop.OuterLoop`, the DDP door's, driven by the same
:class:`gradientflow.outer.driver.InnerSteps`): its parameters are the local shards of the sharded parameters
(``sharded_param._local_tensor``, views of FSDP's sharded storage, so what the loop writes is what the next
all-gather sends), so the pseudo-gradient, the anchor, the outer momentum and the residuals are this rank's shards
(1/G of the model each, fp32 whatever the parameters' dtype, on ``outer_state_device``).  The exchange
(:class:`gradientflow.outer.exchange.Average`) runs over the mesh's replicate group: each of its ranks holds the
same shard on another node, so one rank per replica and no all-gather inside the node; the outer step then sets
every replica's shard alike.

``fully_shard`` is called per block and at the root; the model gets ONE loop (:class:`ShardedOuter`), over every
module given ``sync_every > 1`` whose parameters the stepping optimizer holds, in construction order (the same on
every rank), built at that optimizer's first step (or earlier, by :func:`outer_of` for a checkpoint or
``comm_stats``, over the model's modules).  Streaming's fragments are cut by the whole parameters' sizes, so every
rank cuts alike however its shards fall.

Replicas that come and go (``replicas=``, a torchft Manager per rank): the launch is one replica, its mesh
``(1, ranks)``; the loop's syncs run through :class:`gradientflow.outer.membership.Membership`, each rank's shard
over its Manager's group (rank r of every live replica holds the same shard), a replica behind healed rank by rank
from rank r of a live peer (its shards of the anchor and the momentum).  The loop is then built, and the first
quorum asked for, at the model's first forward (before any all-gather: a joining replica's shards are the peer's
anchor when its first forward gathers them), over every module given that Manager.

Between syncs the replicas differ while DCP saves one copy of each shard (whichever replica wrote it): this rank's
loop state, its replica's shards and its inner optimizer state travel in ``comm_state`` as one item per rank
(:func:`state_items`), written back before the next forward (the parameters) and the next optimizer step (the
optimizer's state).
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..config import GradientFlowConfig
from ..outer.driver import InnerSteps
from ..outer.exchange import Average
from ..outer.loop import OuterLoop
from ..outer.membership import Membership, check_manager, check_replica_ranks
from ..outer_options import OUTER_OPTIONS, outer_exchange_of
from .mesh import HSDPMesh
from .module_comm import ModuleComm

KEY = "outer"
"""The prefix of the outer state's items in ``comm_state`` (``outer.rank<r>@<mesh>``)."""


def _settings(comm: ModuleComm) -> tuple[Any, ...]:
    """What the modules of one loop must share: the mesh, the outer options and the Manager (by identity)."""
    return (comm.mesh.mesh, id(comm.replicas), *_options(comm.config))


def _options(config: GradientFlowConfig) -> tuple[Any, ...]:
    return (config.sync_every, *(getattr(config, k) for k in OUTER_OPTIONS))


def _said(config: GradientFlowConfig) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in zip(("sync_every", *OUTER_OPTIONS), _options(config)))


def check_replicas(replicas: Any, config: GradientFlowConfig, hsdp: HSDPMesh) -> None:
    """At ``fully_shard(..., replicas=manager)``: ``ValueError`` saying what to pass unless the launch is one replica
    (the mesh ``(1, ranks)``) with fewer syncs, no streaming overlap, and a Manager built for this rank of it."""
    if replicas is None:
        return
    if config.sync_every <= 1:
        raise ValueError(
            "gradientflow.fsdp.fully_shard: replicas= (a torchft Manager) drives the outer syncs of fewer syncs; pass "
            "sync_every > 1 (e.g. sync_every=100), or leave replicas out."
        )
    if config.sync_delay:
        raise ValueError(
            f"gradientflow.fsdp.fully_shard: replicas= runs each outer sync among the replicas alive at it, which "
            f"streaming's overlap (sync_delay={config.sync_delay}) cannot (its exchange spans inner steps). Pass "
            "sync_delay=0."
        )
    if hsdp.nodes != 1:
        raise ValueError(
            f"gradientflow.fsdp.fully_shard: replicas= takes the launch as one replica, its mesh the replica's own "
            f"ranks, but the mesh is {hsdp.label} (replicas inside the launch). Launch each replica (a node) alone "
            "(torchrun --nnodes 1 --nproc-per-node <GPUs>, each rank with its own torchft Manager) and pass "
            "mesh=gradientflow.fsdp.hsdp_mesh() there (1 x <GPUs>), or init_device_mesh(device, (1, ranks), "
            "mesh_dim_names=('replicate', 'shard'))."
        )
    check_manager(replicas)
    check_replica_ranks(replicas, hsdp.shard.get_local_rank(), hsdp.per_node, "the mesh's replica")


def check_calls(config: GradientFlowConfig, modules: list[nn.Module], replicas: Any = None) -> None:
    """At ``fully_shard(modules, ...)``: ``ValueError`` where a submodule sharded already (a block, sharded before the
    root) was given other ``sync_every`` / outer options: the model runs one outer loop (the same on every rank: each
    call's options went through the ranks' agreement).  Raised here rather than at the first optimizer step."""
    for module in modules:
        for name, child in module.named_modules():
            comm = getattr(child, "_gf_fsdp", None)
            if child is module or comm is None:
                continue
            if _options(comm.config) == _options(config) and comm.replicas is not replicas:
                raise ValueError(
                    f"gradientflow.fsdp.fully_shard: submodule {name!r} was sharded with replicas="
                    f"{type(comm.replicas).__name__}; this call passes replicas={type(replicas).__name__}. One model "
                    "is one replica: pass the same torchft Manager as replicas= to every fully_shard call of the model."
                )
            if _options(comm.config) == _options(config):
                continue
            raise ValueError(
                f"gradientflow.fsdp.fully_shard: submodule {name!r} was sharded with {_said(comm.config)}; this call "
                f"passes {_said(config)}. One model runs one outer loop: pass the same sync_every= and outer_*= "
                "options to every fully_shard call of the model."
            )


class ShardedOuter:
    """One model's outer loop over the local shards of ``comms``' sharded parameters (held weakly: the modules hold
    their ``ModuleComm``, the registry holds this)."""

    def __init__(self, comms: list[ModuleComm]) -> None:
        first = comms[0]
        for comm in comms[1:]:
            if _settings(comm) != _settings(first):
                raise ValueError(
                    "gradientflow.fsdp.fully_shard: the modules one optimizer steps run one outer loop, but module "
                    f"{comm.index} was sharded with other sync_every / outer options, another mesh or another "
                    f"replicas= than module {first.index}. Pass the same sync_every=, outer_*=, mesh= and replicas= to "
                    "every fully_shard call of the model."
                )
        config, mesh = first.config, first.mesh
        self.comms = [weakref.ref(c) for c in comms]
        self.label = mesh.label
        fsdp_params = [fp for c in comms for fp in c.param_group.fsdp_params]
        spec = outer_exchange_of(config.outer_compression, config.outer_density)
        fragments = int(config.sync_fragments or 1)
        # the replicate group: this rank and the ranks holding its shard on the other nodes, one rank per replica
        exchange = Average(spec, mesh.replicate, first.watchdog, fragments)
        device = torch.device(config.outer_state_device) if config.outer_state_device is not None else None
        self.loop = OuterLoop(
            self._locals(),
            every=config.sync_every,
            lr=float(config.outer_lr or 0.0),
            momentum=float(config.outer_momentum or 0.0),
            fragments=fragments,
            exchange=exchange,
            watchdog=first.watchdog,
            state_device=device,
            delay=int(config.sync_delay or 0),
            cut_sizes=[fp.sharded_param.numel() for fp in fsdp_params],  # a DTensor's numel: the whole parameter's
        )
        self.steps = InnerSteps(self.loop, [fp.sharded_param for fp in fsdp_params])
        self.dense_bytes = sum(c.numel for c in comms) * 4  # torch HSDP's fp32 shard between nodes, per step
        if first.replicas is not None:  # each sync among the live replicas; the first quorum now (a joiner healed)
            membership = Membership(first.replicas, spec, first.watchdog.timeout)
            membership.attach(self.loop)
            membership.join()

    def _live(self) -> list[ModuleComm]:
        comms = [r() for r in self.comms]
        return [c for c in comms if c is not None]

    def _locals(self, comms: Iterable[ModuleComm] | None = None) -> list[torch.Tensor]:
        """The local shards, read now: torch re-pads a sharded parameter replaced after ``fully_shard`` (a
        ``load_state_dict(assign=True)``, ``to_empty``) into new storage at its lazy init."""
        found = self._live() if comms is None else comms
        return [fp.sharded_param._local_tensor for c in found for fp in c.param_group.fsdp_params]

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.loop.params[:] = self._locals()
        self.steps.before(optimizer)

    def before_forward(self) -> None:
        """A loaded checkpoint's shards of this replica written back, before the all-gather of the next forward."""
        if self.loop.replica is not None:
            self.loop.params[:] = self._locals()
            self.loop.restore_replica()

    def stats(self) -> dict[str, float | int]:
        return self.loop.stats(self.dense_bytes)

    def owned(self) -> frozenset[int]:
        return self.steps.own


class _OuterRegistry:
    """The modules given ``sync_every > 1`` (weakly held, in construction order), the loops built over them, and
    one pair of global optimizer step hooks dispatching to them (a hook registered while torch runs the global
    hooks would change the dict it iterates: so the loops register none of their own)."""

    def __init__(self) -> None:
        self.modules: list[weakref.ref[ModuleComm]] = []
        self.loops: weakref.WeakKeyDictionary[ModuleComm, ShardedOuter] = weakref.WeakKeyDictionary()
        self.by_optimizer: weakref.WeakKeyDictionary[torch.optim.Optimizer, ShardedOuter | None] = (
            weakref.WeakKeyDictionary()
        )
        self.hooks: list[RemovableHandle] = []
        self.every_step: weakref.WeakSet[ModuleComm] = weakref.WeakSet()  # the modules of sync_every=1

    def add(self, comm: ModuleComm) -> None:
        self.modules.append(weakref.ref(comm))
        if not self.hooks:
            self.hooks = [
                register_optimizer_step_pre_hook(self._before),
                register_optimizer_step_post_hook(self._after),
            ]

    def alive(self) -> list[ModuleComm]:
        comms = [r() for r in self.modules]
        self.modules = [weakref.ref(c) for c in comms if c is not None]
        return [c for c in comms if c is not None]

    def outer_of(self, comms: list[ModuleComm]) -> ShardedOuter:
        """The loop over ``comms`` (built now if none is), or ``ValueError`` where some of them run another."""
        found = {id(o): o for o in (self.loops.get(c) for c in comms) if o is not None}
        if not found:
            outer = ShardedOuter(comms)
            for c in comms:
                self.loops[c] = outer
            return outer
        (outer, *more) = found.values()
        if more or {id(c) for c in outer._live()} != {id(c) for c in comms}:
            raise ValueError(
                "gradientflow.fsdp.fully_shard(sync_every > 1): one optimizer steps every parameter of the model and "
                "the model is one replica: put every parameter of the modules sharded with sync_every in one "
                "optimizer (a second optimizer, or one holding part of the model, would count other steps)."
            )
        return outer

    def _for(self, optimizer: torch.optim.Optimizer) -> ShardedOuter | None:
        if optimizer in self.by_optimizer:
            return self.by_optimizer[optimizer]
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        mine = [c for c in self.alive() if c.param_ids & held]
        outer = self.outer_of(mine) if mine else None
        if outer is not None and any(c.param_ids & held for c in self.every_step):
            raise ValueError(
                f"gradientflow.fsdp.fully_shard: {type(optimizer).__name__} steps modules sharded with sync_every="
                f"{outer.loop.every} and modules sharded with sync_every=1 (every step) together: the first meet "
                "between nodes every few steps, the others every step, so one optimizer cannot step both. Pass the "
                "same sync_every= to every fully_shard call of the model, or give each model its own optimizer."
            )
        if outer is not None and not outer.owned() <= held:
            raise ValueError(
                f"gradientflow.fsdp.fully_shard(sync_every > 1): {type(optimizer).__name__} holds part of the "
                "parameters of the modules sharded with sync_every; the outer loop counts one optimizer's steps "
                "over all of them. Put every parameter of the model in one optimizer."
            )
        self.by_optimizer[optimizer] = outer
        return outer

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        outer = self._for(optimizer)
        if outer is not None:
            outer.before_step(optimizer)

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        outer = self.by_optimizer.get(optimizer)
        if outer is not None:
            outer.steps.after()


REGISTRY = _OuterRegistry()


def attach(module: nn.Module, comm: ModuleComm) -> None:
    """``fully_shard(module, sync_every=H > 1, ...)``: ``comm`` joins the registry, and a forward pre-hook, run before
    torch's (its all-gather), writes a loaded checkpoint's replica back.  ``sync_every=1``: ``comm`` is noted, for
    the check that no optimizer steps it with a loop's modules."""
    if comm.param_group is None:
        return
    if comm.config.sync_every <= 1:
        REGISTRY.every_step.add(comm)
        return  # no parameter of its own: nothing to synchronise (its blocks' hooks run before their all-gathers)
    REGISTRY.add(comm)
    ref = weakref.ref(comm)

    def restore(mod: nn.Module, args: Any) -> None:
        found = ref()
        outer = REGISTRY.loops.get(found) if found is not None else None
        if outer is None and found is not None and found.replicas is not None:  # the first forward: the first quorum
            outer = _of_manager(found.replicas)
        if outer is not None:
            outer.before_forward()

    module.register_forward_pre_hook(restore, prepend=True)


def _of_manager(manager: Any) -> ShardedOuter:
    """The loop of the model given ``manager`` as ``replicas=`` (every module given it, in construction order)."""
    mine = sorted((c for c in REGISTRY.alive() if c.replicas is manager), key=lambda c: c.index)
    return REGISTRY.outer_of(mine)


def outer_of(comms: list[ModuleComm]) -> ShardedOuter | None:
    """The loop over the modules ``comms`` with ``sync_every > 1`` (a model's, in construction order), built now if
    none is; ``None`` where none has it."""
    mine = sorted((c for c in comms if c.config.sync_every > 1 and c.param_group is not None), key=lambda c: c.index)
    return REGISTRY.outer_of(mine) if mine else None


# ---- comm_state(): one item per rank -----------------------------------------------------------------------------
def _item(label: str) -> str:
    return f"{KEY}.rank{dist.get_rank()}@{label}"


def state_items(comms: list[ModuleComm]) -> dict[str, Any]:
    """This rank's outer state (the loop's, its replica's shards, its inner optimizer state) as one serialised item
    keyed by its rank and the mesh: DCP saves every rank's (the keys differ), and a rank loads its own."""
    outer = outer_of(comms)
    if outer is None:
        return {}
    blob = io.BytesIO()
    torch.save(outer.steps.state_dict(), blob)
    return {_item(outer.label): blob.getvalue()}


def load_items(comms: list[ModuleComm], state: dict[str, Any]) -> None:
    """The item :func:`state_items` saved for this rank, into the loop (``ValueError`` where it does not fit)."""
    outer = outer_of(comms)
    if outer is None:
        return
    key = _item(outer.label)
    if key not in state:
        raise ValueError(
            f"gradientflow.fsdp: the checkpoint holds no outer state for this rank ({key}); it was saved without "
            "sync_every, or on another mesh. Resume with the options and the mesh it was saved with."
        )
    saved = torch.load(io.BytesIO(state[key]), weights_only=True)
    outer.steps.validate_state_dict(saved)
    outer.steps.load_state_dict(saved)
