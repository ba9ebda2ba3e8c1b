"""The recipes ``bench --quality`` trains side by side: their names, a variant's options, what each one builds.

``ddp`` (torch DDP, dense fp32: the oracle), ``gf-recommended`` (fp16 wire + CSC density 0.1 with the library's
defaults otherwise, the user's optimizer untouched), ``gf-density-0.3`` (the same at density 0.3), ``gf-paper``
(fp16 + CSC 0.1 + momentum correction 0.9 with plain SGD and a short dense warm-up), ``gf-fp16-dense``, ``ddp-sgd``
(torch DDP with gf-paper's SGD), ``gf-auto``, torch's own hooks and post-local SGD (:mod:`.quality_peers`), one
``gf-<recipe>`` per row of the recipe table, FSDP2 / HSDP (:mod:`.sharded`) and torchft's DiLoCo
(:mod:`.quality_torchft`).  :func:`parse_recipe` reads a name with its options (a variant); :func:`build_recipe`
wraps a model and makes its optimizer, on each rank (:mod:`.quality_worker`).
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

import torch
from torch import nn

from gradientflow.bench.quality_peers import POSTLOCAL_PERIOD, TORCH_PEER_WARMUP, TORCH_PEERS, register_torch_hook
from gradientflow.bench.quality_spec import Job
from gradientflow.bench.quality_torchft import DEFAULT_SYNC_EVERY, TORCHFT_PEERS, TorchftDiLoCo, parse_options
from gradientflow.bench.sharded import FSDP_PREFIX, OVERLAP, SHARDED_MODES, is_sharded, shard
from gradientflow.recipes import BY_NAME
from gradientflow.recipes import RECIPES as RECIPE_TABLE

RECIPES = (
    "ddp",
    "gf-recommended",
    "gf-density-0.3",
    "gf-paper",
    "gf-fp16-dense",
    "ddp-sgd",
    "gf-auto",
    "ddp-fp16-hook",
    "ddp-powersgd",
    "ddp-postlocal",
)
TABLE_RECIPES = tuple(f"gf-{r.name}" for r in RECIPE_TABLE if r.name != "auto")
"""``gf-<recipe>``: ``compression="<recipe>"``, one per row of the recipe table (docs/recipes.md; ``gf-auto`` above),
trained when named (``--recipes``)."""
DENSITY = BY_NAME["topk-fp16"].options["density"]
USER_OPTIMIZER_DENSITY = {"gf-recommended": DENSITY, "gf-density-0.3": 0.3}
"""fp16 + CSC at this density, the library's defaults otherwise, the user's optimizer untouched;
0.3 is what a user whose optimizer loses quality at 0.1 (AdamW) can turn to."""
PAPER_MOMENTUM = 0.9


def parse_recipe(recipe: str) -> tuple[str, dict[str, Any]]:
    """``"gf-recommended:warmup_steps=300,dense_1d=False"`` -> ``("gf-recommended", {...})``.

    A *variant* of a gradientflow recipe: the recipe with some of the wrapper's options changed, to
    measure what an option does to quality (an ablation) on the same seed and batches.  Values are
    Python literals (``300``, ``0.3``, ``False``, ``None``); anything else is taken as a string
    (``csc_scope=global``).  One option is the bench's own: ``steps=F`` trains F times the job's steps
    (F > 0; the LR schedule stretched to them), for time to a loss that a recipe reaches only with more,
    faster, steps.  ``topology=flat`` (or ``auto``, ``MxG``) is passed to the wrapper as its keyword (a
    variant forced flat beside the layout torchrun gives).  Raises ``ValueError`` for an unknown recipe or
    option or a bad value.

    ``fsdp-<recipe>`` takes ``gradientflow.fsdp.fully_shard``'s keywords the same way (``fsdp-none:sync_every=100``:
    its fewer syncs beside torch's ``hsdp`` in one launch), validated as ``fully_shard`` validates them.

    torchft's DiLoCo peers (:data:`TORCHFT_PEERS`) take ``sync_every=H`` (a whole number >= 1) and the outer SGD's
    ``outer_lr`` and ``outer_momentum`` (:func:`~gradientflow.bench.quality_torchft.parse_options`).
    """
    from gradientflow.config import GradientFlowConfig

    base, _, rest = recipe.partition(":")
    if base not in (*RECIPES, *TABLE_RECIPES, *SHARDED_MODES, *TORCHFT_PEERS):
        known = ", ".join((*RECIPES, *TABLE_RECIPES, *SHARDED_MODES, *TORCHFT_PEERS))
        raise ValueError(f"unknown recipe {base!r}; choose from {known}")
    if not rest:
        return base, {}
    if base in TORCHFT_PEERS:
        return base, parse_options(recipe, rest)
    if not base.startswith(("gf-", FSDP_PREFIX)):  # torch DDP, its peers, torch's HSDP
        what = "torch's FSDP2 / HSDP" if is_sharded(base) else "torch DDP"
        raise ValueError(
            f"{recipe!r}: only gradientflow's recipes (gf-*, fsdp-*) and torchft's (sync_every=H) take options; "
            f"{base} is {what}"
        )
    fields = {f.name for f in dataclasses.fields(GradientFlowConfig)}
    names = fields | {"steps"}
    overrides: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq or key not in names:
            raise ValueError(f"{recipe!r}: {item!r} is not OPTION=VALUE with OPTION one of {', '.join(sorted(names))}")
        try:
            overrides[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            overrides[key] = text
    factor = overrides.get("steps", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"{recipe!r}: steps must be a factor > 0 of the job's steps (e.g. steps=1.2)")
    try:  # the wrapper's validation (fully_shard's for fsdp-*: its recipe with the variant's options)
        if base.startswith(FSDP_PREFIX):
            from gradientflow.fsdp.api import recipe_config

            keywords = {k: v for k, v in overrides.items() if k != "steps"}
            recipe_config(compression=base.removeprefix(FSDP_PREFIX).removesuffix(OVERLAP), **keywords)
        else:
            GradientFlowConfig(**{k: v for k, v in overrides.items() if k in fields})
    except ValueError as exc:
        raise ValueError(f"{recipe!r}: {exc}") from None
    return base, overrides


def build_recipe(recipe: str, model: nn.Module, job: Job) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """Wrapper + optimizer of one recipe (or variant, see :func:`parse_recipe`), and what was passed."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import gradientflow as gf

    recipe, overrides = parse_recipe(recipe)
    factor = overrides.pop("steps", 1.0)  # the bench's own option (gf-*, fsdp-*), not the wrapper's
    paper_sgd = recipe in ("gf-paper", "ddp-sgd")
    options: dict[str, Any]
    wrapped: nn.Module
    if is_sharded(recipe):  # FSDP2 / HSDP on the launch's mesh (bench.sharded)
        wrapped = shard(model, recipe, **overrides)  # fsdp-*: fully_shard's options of the variant, if any
        options = {"wrapper": "fully_shard", "mesh": "nodes x ranks per node", **overrides}
    elif recipe in ("ddp", "ddp-sgd", *TORCH_PEERS):
        # PowerSGD issues its second allreduce (Q) from a future callback: with two buckets in flight
        # Gloo ranks issue them in different orders and Gloo aborts ("collective mismatch"); one bucket
        # (an explicit bucket_cap_mb makes the first bucket that size too) keeps them in one chain.
        torch_ddp = TorchDDP(model, bucket_cap_mb=1e4) if recipe == "ddp-powersgd" else TorchDDP(model)
        options = {"wrapper": "torch.nn.parallel.DistributedDataParallel"}
        options.update(register_torch_hook(recipe, torch_ddp))
        wrapped = torch_ddp
    elif recipe in TORCHFT_PEERS:  # DiLoCo is attached to the optimizer below, once it exists
        sync_every = overrides.pop("sync_every", DEFAULT_SYNC_EVERY)
        wrapped = TorchftDiLoCo(model, recipe, sync_every, **overrides)  # outer_lr, outer_momentum where named
        options = {}
    else:
        if recipe == "gf-auto":
            options = {"compression": "auto"}
        elif recipe in TABLE_RECIPES:
            options = {"compression": recipe.removeprefix("gf-")}
        elif recipe in USER_OPTIMIZER_DENSITY:
            options = {"comm_dtype": "fp16", "density": USER_OPTIMIZER_DENSITY[recipe]}  # all else: the defaults
        elif recipe == "gf-paper":
            options = {
                "comm_dtype": "fp16",
                "density": DENSITY,
                "momentum": PAPER_MOMENTUM,
                "warmup_steps": job.paper_warmup_steps,
            }
        else:  # gf-fp16-dense
            options = {"comm_dtype": "fp16"}
        options.update(overrides)
        wrapped = gf.DistributedDataParallel(model, **options)
    params = wrapped.parameters()
    if paper_sgd:
        # gf-paper: momentum lives in CSC's momentum correction, so the optimizer applies none;
        # ddp-sgd: the same SGD with its momentum in the optimizer, dense (gf-paper's oracle)
        momentum = 0.0 if recipe == "gf-paper" else PAPER_MOMENTUM
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=job.paper_lr, momentum=momentum)
        options["optimizer"] = f"SGD(lr={job.paper_lr:g}, momentum={momentum:g})"
    elif job.workload == "transformer" and job.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=job.paper_lr, momentum=PAPER_MOMENTUM)
        options["optimizer"] = f"SGD(lr={job.paper_lr:g}, momentum={PAPER_MOMENTUM:g})"
    elif job.optimizer == "adamw":  # the transformer's by default; the digits jobs' with --digits-optimizer adamw
        opt = torch.optim.AdamW(params, lr=job.lr, betas=(0.9, job.beta2), weight_decay=0.1)
        options["optimizer"] = f"AdamW(lr={job.lr:g}, betas=(0.9, {job.beta2:g}), weight_decay=0.1)"
    else:
        opt = torch.optim.SGD(params, lr=job.lr, momentum=0.9)
        options["optimizer"] = f"SGD(lr={job.lr:g}, momentum=0.9)"
    if recipe == "ddp-postlocal":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        averager = PeriodicModelAverager(period=POSTLOCAL_PERIOD, warmup_steps=TORCH_PEER_WARMUP)
        opt = PostLocalSGDOptimizer(optim=opt, averager=averager)
    if factor != 1.0:
        options["steps_factor"] = factor  # read by the worker: this recipe trains factor x the job's steps
    if isinstance(wrapped, TorchftDiLoCo):  # torchft is imported here, by the recipes that use it only
        options.update(wrapped.attach(opt))
    return wrapped, opt, options
