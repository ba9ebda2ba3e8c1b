"""``gradientflow.fsdp.fully_shard``: torch's ``fully_shard`` on each node, the reduction between nodes compressed.

Torch 2.13's arguments, positions and defaults, plus the recipe options of the DDP wrapper (``compression`` and the
``quant_*`` keywords: :class:`gradientflow.recipe_options.RecipeOptions`, validated by
:class:`gradientflow.config.GradientFlowConfig`, so a name means the same for both).  Given the 2-D HSDP mesh
(replicate, shard), the module is sharded by torch on the ``shard`` dimension (each node's ranks: torch's
reduce-scatter does the stage inside the node) and the ``replicate`` dimension's reduction is gradientflow's, in the
module's all-reduce hook (:mod:`.module_comm`).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, Protocol, cast, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from .. import mechanisms
from ..config import GradientFlowConfig
from ..outer_options import OUTER_OPTIONS
from ..recipe_options import QuantLevels, RecipeOptions
from . import auto, outer
from .agreement import ERROR, check_same
from .bounded import bound_inside_node
from .hooks import adopt
from .mesh import HSDPMesh, check_against_launch, hsdp_mesh, split_mesh
from .mixing import check_children
from .module_comm import ModuleComm

logger = logging.getLogger(__name__)


_MP_DEFAULT = MixedPrecisionPolicy()  # torch's defaults (frozen dataclasses, as torch's signature holds them)
_OFFLOAD_DEFAULT = OffloadPolicy()
_ORDER = itertools.count()  # modules in construction order (the same on every rank)
_DEFAULT_MESH: list[DeviceMesh] = []  # mesh=None: one mesh from torchrun's layout for every call


def _settings(
    config: GradientFlowConfig, hsdp: HSDPMesh, modules: list[nn.Module], ignored: set[nn.Parameter] | None
) -> str:
    """What every rank must pass alike for one ``fully_shard`` call: the recipe, the mesh, the parameters (their
    number and elements: the shard's layout; a child sharded already counts its whole parameters)."""
    settings = f"{config.compression} {config.quantizer() if config.quantized else config.comm_dtype} mesh "
    if config.sparse:
        settings += f"density {config.density} chunk {config.chunk_size} ramp {config.warmup_steps} "
    if config.sync_every > 1:
        settings += f"sync_every {config.sync_every} " + " ".join(f"{getattr(config, k)}" for k in OUTER_OPTIONS) + " "
    params = [p for m in modules for p in m.parameters() if ignored is None or p not in ignored]
    return settings + f"{hsdp.label} params {len(params)} of {sum(p.numel() for p in params)} elements"


def _device(hsdp: HSDPMesh) -> torch.device:
    """The device of the ranks' agreement: the mesh's (torch shards the module onto it)."""
    if hsdp.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(hsdp.mesh.device_type)


def _mesh(mesh: DeviceMesh | None) -> HSDPMesh:
    if mesh is None:
        if not _DEFAULT_MESH:
            _DEFAULT_MESH.append(hsdp_mesh())
        mesh = _DEFAULT_MESH[0]
    return split_mesh(mesh)


# Torch types fully_shard with two overloads (a module gives an FSDPModule, a list of modules a list), each repeating
# every keyword.  Here the overloads are stated once, over the module alone: the keywords are the implementation's own
# signature, carried by a ParamSpec, so they are written once (below), and help() and inspect.signature show that
# function itself.  Dropping the overloads would type the result as the union (or Any): a user's
# `fully_shard(model).set_requires_gradient_sync(False)` would no longer check; keywords behind
# `**kwargs: Unpack[TypedDict]` would hide them from help() and give them no defaults.
_P = ParamSpec("_P")


class _PerModule(Protocol[_P]):
    """:func:`fully_shard`'s type: torch's two overloads, the keywords ``_P`` (the implementation's)."""

    @overload
    def __call__(self, module: nn.Module, *args: _P.args, **kwargs: _P.kwargs) -> FSDPModule: ...
    @overload
    def __call__(self, module: list[nn.Module], *args: _P.args, **kwargs: _P.kwargs) -> list[FSDPModule]: ...


def _per_module(impl: Callable[Concatenate[nn.Module | list[nn.Module], _P], Any]) -> _PerModule[_P]:
    """``impl`` itself, typed with torch's overloads over the module."""
    return cast("_PerModule[_P]", impl)


def recipe_config(**options: Any) -> GradientFlowConfig:
    """``fully_shard``'s recipe and outer options as the DDP wrapper reads them (the one table's rule, its advice),
    checked before anything is sharded.  With ``sync_every > 1`` no gradient crosses between nodes between the outer
    syncs, so ``fully_shard``'s default ``compression="auto"`` has no per-step exchange to choose for: ``"none"``."""
    h = options.get("sync_every", 1)
    if options.get("compression") == "auto" and not isinstance(h, bool) and isinstance(h, int) and h > 1:
        options = {**options, "compression": "none"}
    return GradientFlowConfig(**options)


@_per_module
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = _MP_DEFAULT,
    offload_policy: OffloadPolicy = _OFFLOAD_DEFAULT,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    # the recipe options (recipe_options.RecipeOptions: their names, types, defaults and meaning; the config's fields)
    compression: str = "auto",  # fully_shard's own default (the wrapper's is "none"): the recipe for the optimizer
    density: float | None = RecipeOptions.density,
    chunk_size: int | str = RecipeOptions.chunk_size,
    warmup_steps: int = RecipeOptions.warmup_steps,
    quant_bits: int | None = RecipeOptions.quant_bits,
    quant_block: int | None = RecipeOptions.quant_block,
    quant_levels: QuantLevels | None = RecipeOptions.quant_levels,
    quant_precondition: bool | None = RecipeOptions.quant_precondition,
    quant_warmup_steps: int | None = RecipeOptions.quant_warmup_steps,
    quant_clip: float | None = RecipeOptions.quant_clip,
    timeout: float | timedelta | None = RecipeOptions.timeout,
    # fewer syncs between nodes (DiLoCo over HSDP: fsdp/outer.py): the DDP wrapper's names, defaults and checks
    sync_every: int = 1,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    outer_compression: str | None = None,
    outer_density: float | None = None,
    sync_fragments: int | None = None,
    sync_delay: int | None = None,
    outer_state_device: str | None = None,
    replicas: Any = None,  # a torchft Manager per rank: replicas that come and go (outer/membership.py)
    # gradientflow.fsdp's own
    overlap: bool = False,
) -> Any:
    """Torch's ``fully_shard`` (the same arguments, applied per block and at the root as torch's) with HSDP's
    reduction between nodes by a gradientflow recipe.

    ``mesh``: a 2-D DeviceMesh (replicate, shard) (``None``: :func:`gradientflow.fsdp.hsdp_mesh` from torchrun's
    layout).  ``compression``: a recipe's name from the one table (docs/recipes.md): ``"none"`` (torch's HSDP
    reduction: the shard all-reduced in ``reduce_dtype``), ``"fp16"`` / ``"bf16"``, ``"3bit"``, ``"3bit-precond"``,
    ``"2bit-precond"`` (every coordinate quantised, error feedback on the shard), ``"topk-fp16"``, ``"topk-3bit"``
    (the top ``density`` of the shard's chunks of ``chunk_size``, the density ramped from dense over
    ``warmup_steps`` exchanges, the rest kept in the residual: :mod:`gradientflow.fsdp.topk`), ``"auto"`` (dense
    fp32 until the first optimizer step, then the recipe for the optimizer: :mod:`gradientflow.fsdp.auto`); the
    ``quant_*`` options and the others after ``compression``: :class:`gradientflow.recipe_options.RecipeOptions`, the
    same as for :class:`gradientflow.DistributedDataParallel`.  ``timeout``: seconds any exchange may wait.
    ``sync_every=H`` (> 1): fewer syncs between nodes (docs/fewer-syncs.md): the inner steps all-gather and
    reduce-scatter inside the node only, and every H optimizer steps the pseudo-gradient's shards go through
    ``outer_compression``'s exchange to the same shards on the other nodes and the outer optimizer (``outer_lr``,
    ``outer_momentum``) sets every replica's shards alike (:mod:`gradientflow.fsdp.outer`); the outer options as
    :class:`gradientflow.config.GradientFlowConfig` documents them, the same as the DDP wrapper's.  No gradient
    crosses between nodes in between, so ``compression`` keeps its default (``"auto"`` then runs nothing).
    ``overlap=True``: each module's exchange between nodes is posted in its hook and finished when the next module's
    hook runs, or at the end of the backward pass, so that it overlaps the next module's backward
    (:mod:`gradientflow.fsdp.overlap`; the same gradients bit for bit); the default ``False`` waits in the hook
    (measured on the emulated 2 x 2 CPU cluster: overlap hid most of a dense exchange's wait but made the 3-bit
    recipe's step no faster: docs/results/fsdp.md).
    ``replicas`` (with ``sync_every > 1``): a ``torchft.Manager`` of this rank (docs/fault-tolerance.md): the launch
    is one replica, ``mesh`` its own ranks (``(1, ranks)``: :func:`gradientflow.fsdp.hsdp_mesh` under a torchrun of
    the replica), and each outer sync runs among the replicas alive at it, each rank's shard over its Manager's
    group (:mod:`gradientflow.outer.membership`); the same Manager to every ``fully_shard`` call of the model.
    Every option is checked before anything changes, the same on every rank (``ValueError`` saying what to pass).
    """
    modules = module if isinstance(module, list) else [module]
    # this rank's checks; a refusal is raised on every rank, after the agreement below (a rank raising alone would
    # leave its peers waiting in it: Gloo's "Connection closed by peer" there, not the error)
    refused = ""
    try:
        config = recipe_config(  # the recipe as the DDP wrapper reads it: the one table's rule
            compression=compression,
            density=density,
            chunk_size=chunk_size,
            warmup_steps=warmup_steps,
            quant_bits=quant_bits,
            quant_block=quant_block,
            quant_levels=quant_levels,
            quant_precondition=quant_precondition,
            quant_warmup_steps=quant_warmup_steps,
            quant_clip=quant_clip,
            timeout=timeout,
            sync_every=sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            outer_compression=outer_compression,
            outer_density=outer_density,
            sync_fragments=sync_fragments,
            sync_delay=sync_delay,
            outer_state_device=outer_state_device,
        )
    except ValueError as exc:
        refused = ERROR + str(exc)
    hsdp = _mesh(mesh)  # every rank holds the same mesh: its errors are raised alike on every rank, here
    try:
        if dp_mesh_dims is not None:
            raise ValueError(
                "gradientflow.fsdp.fully_shard: dp_mesh_dims (an SPMD mesh) is not supported; pass the 2-D "
                "data-parallel mesh (dimension 0 between nodes, 1 inside a node) itself as mesh="
            )
        if not isinstance(overlap, bool):
            raise ValueError(
                f"gradientflow.fsdp.fully_shard: overlap must be True or False, got {overlap!r}; pass overlap=True "
                "(the exchange between nodes overlaps the next module's backward) or overlap=False (the default)."
            )
        check_against_launch(hsdp, os.environ)
        for m in modules:
            check_children(m)
        if not refused:
            outer.check_replicas(replicas, config, hsdp)
            # one model, one outer loop: its blocks' options (and Manager) are this call's
            outer.check_calls(config, modules, replicas)
        if not refused:
            mechanisms.check_door(config.mechanism, "fsdp", f"compression={config.compression!r}")
    except ValueError as exc:
        refused = refused or ERROR + str(exc)
    settings = refused or _settings(config, hsdp, modules, ignored_params) + f" overlap {overlap}"
    settings += " replicas" if replicas is not None and not refused else ""
    first = modules[0]
    device = _device(hsdp)
    check_same(settings, [hsdp.replicate, hsdp.shard.get_group()], device)  # raises on every rank, or none
    out = torch_fully_shard(
        module,
        mesh=hsdp.shard,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
    )
    sharded: Any = first
    groups = sharded._get_fsdp_state()._fsdp_param_groups
    group = groups[0] if groups else None
    device = group.device if group is not None else device  # the module's own (torch's choice of index)
    comm = ModuleComm(config, hsdp, group, device, index=next(_ORDER), module=sharded, overlap_exchange=overlap)
    comm.replicas = replicas
    if group is not None:
        bound_inside_node(sharded, hsdp, comm.watchdog)  # Gloo: torch's collectives in the node bounded, named
        sharded.set_all_reduce_hook(comm)
        # every parameter in every reduce-scatter (zeros for one without a gradient): the shard's layout, and so
        # the residual's, is the same at every step
        sharded.set_reduce_scatter_unused_params(True, recurse=False)
    for m in modules:  # the user's set_all_reduce_hook composed with the reduction (hooks.py), not replacing it
        adopt(m)
    # a resume by the user's own checkpointing code: the model loaded without the recipe state is said (once)
    sharded.register_load_state_dict_post_hook(lambda _module, _keys: comm.loaded(model=True))
    sharded._gf_fsdp = comm
    if config.compression == "auto":
        auto.REGISTRY.add(comm)
    outer.attach(sharded, comm)  # sync_every > 1: the model's outer loop; 1: known, so that no optimizer mixes them
    logger.debug("gradientflow.fsdp: %s on mesh %s, shard of %d elements", config.compression, hsdp.label, comm.numel)
    return out
