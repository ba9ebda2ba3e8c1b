"""What the step-time bench runs: its modes, variants (mode x θ), the spec every rank reads, the options.

Shared by the launcher (:mod:`gradientflow.bench.runner`) and the worker
(:mod:`gradientflow.bench.runner_worker`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradientflow.bench.mode_names import (
    DENSE_FP32,
    GF_PREFIX,
    OPTIONS_SEP,
    TOPOLOGY_SEP,
    canonical_mode,
    parse_options,
)
from gradientflow.bench.report import ALONE_SUFFIX
from gradientflow.bench.sharded import SHARDED_MODES, is_sharded
from gradientflow.option_values import check_topology_value
from gradientflow.recipes import BY_NAME, PER_STEP_NAMES

RECIPE_MODES = tuple(f"{GF_PREFIX}{name}" for name in PER_STEP_NAMES)
"""``gf-<recipe>``: ``compression="<recipe>"``, one mode per row of the recipe table (docs/recipes.md); ``gf-auto``
runs the recipe of the bench's optimizer (SGD: ``"topk-3bit"``; ``--optimizer adamw``: the ``"3bit"`` family).
Any of them may pass wrapper options after a colon: ``gf-topk-fp16:csc_scope=global`` (:func:`gf_recipe`)."""
TORCH_MODES = ("ddp", "ddp-fp16", "ddp-powersgd")
"""torch DDP: plain, with ``fp16_compress_hook``, with the PowerSGD hook."""
MODES = (
    "gf-none",
    "gf-fp16",
    "gf-bf16",
    "gf-topk-fp16:csc_scope=global",
    "gf-topk-fp16",
    "gf-none:comm_dtype=bf16,density=0.1",
    "gf-topk-fp16:csc_scope=global,schedule=auto",
    *TORCH_MODES,
    "compute",
)
"""What ``gradientflow bench`` runs by default (the tables of docs/results/benchmarks.md): the dense recipes, and
``"topk-fp16"`` with the defaults, with ``csc_scope="global"``, on a bf16 wire, and with ``schedule="auto"``."""
EXTRA_MODES = tuple(m for m in (*RECIPE_MODES, *SHARDED_MODES) if m not in MODES)
"""Modes run only when named (``--modes``): every other recipe of the table, and the FSDP2 / HSDP modes
(:mod:`gradientflow.bench.sharded`: ``hsdp``, ``hsdp-bf16``, ``fsdp-<recipe>``)."""
NO_OPTIONS = ("compression", "fusion_threshold_mb", "topology")
"""Wrapper options a mode does not take after its colon: the recipe is its name, θ is ``--fusion-mb`` (and
``--theta-sweep``), the layout its ``@``."""


def gf_recipe(mode: str) -> tuple[str, dict[str, Any]]:
    """The recipe and the options a gradientflow mode (``gf-<recipe>[:OPTION=VALUE,...]``, no ``@``; an old name
    is read as :func:`~gradientflow.bench.mode_names.canonical_mode` spells it) passes to the wrapper.
    ``ValueError`` for an option the wrapper has not, or one it refuses beside the recipe (its own message)."""
    import dataclasses

    from gradientflow.config import GradientFlowConfig

    base = canonical_mode(mode)
    recipe, _, text = base.removeprefix(GF_PREFIX).partition(OPTIONS_SEP)
    if not text:
        return recipe, {}
    try:
        options = parse_options(text)
    except ValueError as exc:
        raise ValueError(f"mode {mode!r}: {exc} after the colon") from None
    known = {f.name for f in dataclasses.fields(GradientFlowConfig)} - set(NO_OPTIONS)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"mode {mode!r}: {', '.join(unknown)} is not a wrapper option a mode takes (the recipe is its name, "
            f"θ --fusion-mb, the layout @TOPOLOGY); one of {', '.join(sorted(known))}"
        )
    try:  # the wrapper's validation: an option the recipe's name fixes, or its mechanism does not read
        GradientFlowConfig(compression=recipe, **options)
    except ValueError as exc:
        raise ValueError(f"mode {mode!r}: {exc}") from None
    return recipe, options


TOPOLOGY_SUFFIX = TOPOLOGY_SEP
"""``gf-fp16@flat``: a gradientflow mode with the engine's ``topology`` option (``flat``, ``auto`` or
``MxG``), so one table holds a mode forced flat beside the same mode on the node layout torchrun gives."""
OPTIMIZERS = ("sgd", "adamw")
ISOLATED = ("ddp-powersgd",)
"""Modes run in their own launch: a failure of torch's PowerSGD hook (see POWERSGD_BUCKET_MB)
must not take the other modes with it."""
DDP_DEFAULT_BUCKET_MB = 25.0  # torch DDP's bucket_cap_mb default
CSC_DENSITY = BY_NAME["topk-fp16"].options["density"]
"""The top-k modes' density (the ``"topk-fp16"`` row's); the cost model's validation charges it."""
POWERSGD_RANK = 1  # torch's default matrix_approximation_rank
POWERSGD_BUCKET_MB = 1e6
"""torch DDP's bucket cap for ``ddp-powersgd``: the whole model in one bucket.  torch's
``powerSGD_hook`` starts its second allreduce (Q) from the first one's future callback; with
several buckets in flight that callback races the next bucket's allreduce, the two ranks issue
them in different orders, and Gloo aborts ("Received data size doesn't match expected size",
5 of 5 launches of ResNet-50 at the default 25 MB; 0 of 4 with one bucket).  An explicit cap
also sets DDP's first bucket to it, so there is exactly one bucket: no overlap, PowerSGD's
compression runs after backward."""
MARK = "[gf] "  # workers prefix lines meant for the user's terminal with this


def split_mode(mode: str) -> tuple[str, str | None]:
    """``"gf-fp16@flat"`` -> ``("gf-fp16", "flat")``; ``"ddp"`` -> ``("ddp", None)``; an old name as the recipe
    table spells it (``"gf-fp16-csc-slice@flat"`` -> ``("gf-topk-fp16", "flat")``).  ``ValueError`` saying what
    to pass for an unknown mode, options or a topology on a mode that is not gradientflow's, or a bad one."""
    base, at, topology = canonical_mode(mode).partition(TOPOLOGY_SUFFIX)
    name, colon, _ = base.partition(OPTIONS_SEP)
    if name not in (*MODES, *EXTRA_MODES):
        known = " ".join(m for m in dict.fromkeys((*MODES, *EXTRA_MODES)) if OPTIONS_SEP not in m)
        raise ValueError(f"unknown mode {name!r}: choose from {known} (a gf-* mode may add :OPTION=VALUE,...)")
    if colon:
        if not name.startswith(GF_PREFIX):
            raise ValueError(f"mode {mode!r}: only gradientflow modes (gf-*) take :OPTION=VALUE; {name} is not one")
        gf_recipe(base)
    if not at:
        return base, None
    if not base.startswith(GF_PREFIX):
        raise ValueError(f"mode {mode!r}: only gradientflow modes (gf-*) take @TOPOLOGY; {base} is not one")
    try:
        return base, check_topology(topology)
    except ValueError as exc:
        raise ValueError(f"mode {mode!r}: the topology after @ {exc}") from None


def check_topology(value: str) -> str:
    """``value`` if it is a layout the engine's ``topology`` option takes (the engine's own check)."""
    check_topology_value(value)
    return value


def topology_kwargs(mode: str) -> dict[str, Any]:
    """The keyword a mode passes to ``gradientflow.DistributedDataParallel`` for its layout: none for a plain
    mode (the engine's default), ``{"topology": T}`` for ``mode@T``."""
    topology = split_mode(mode)[1]
    return {} if topology is None else {"topology": topology}


@dataclass(frozen=True)
class Variant:
    """One configuration timed by the bench: a mode at a bucket size θ (MB; None = the mode's default)."""

    name: str
    mode: str
    theta_mb: float | None = None
    sweep: bool = False
    alone: bool = False
    """Run on a one-rank process group of its own rank: every pass of the mode and of autograd runs,
    and no collective has anyone to wait for.  Its step minus the compute mode's is what the mode
    costs a step apart from the network and the other ranks (the report's "own CPU" share)."""


@dataclass
class BenchSpec:
    """Everything a worker needs; written to JSON by the parent, read by every rank."""

    workload: str
    batch_size: int
    steps: int
    warmup: int
    variants: list[dict[str, Any]]
    out_path: str
    threads: int = 1
    algorithm: str = "native"
    chunk_size: int | None = None  # None: "auto" (32768, the paper's, or less so a small model has ~2000 chunks)
    pg_timeout_s: float = 120.0
    lr: float = 0.01
    extra: dict[str, Any] = field(default_factory=dict)
    input_shape: list[int] | None = None  # a user's model (workload "module:factory"): one sample's shape
    device: str = "cpu"  # "cuda": every rank on GPU (local rank mod the GPU count)
    emulated: bool = False  # ranks in network namespaces of this machine: their bytes must cross the shaped link
    optimizer: str = "sgd"  # "sgd" (momentum 0.9) | "adamw" (what compression="auto" turns into the quantised ring)
    transformer_size: list[int] = field(default_factory=lambda: [128, 2])  # tiny_transformer's d_model, layers


def rank_device(kind: str, local_rank: int) -> torch.device:
    """The device a rank trains on: the CPU, or GPU ``local_rank mod count`` (ranks may share one GPU)."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def process_group_backend(device: torch.device, ranks_per_node: int, emulated: bool = False) -> str:
    """NCCL when every rank of a node has a GPU of its own, else Gloo (which also carries CUDA tensors).

    Always Gloo in an emulated cluster: its nodes are namespaces of one machine (so a node's ranks are
    no proof of a GPU each: every node shares this machine's), and NCCL would find its peers on the same
    host and move bytes through shared memory, past the shaped link."""
    if device.type == "cuda" and not emulated and torch.cuda.device_count() >= ranks_per_node:
        return "nccl"
    return "gloo"


def make_model(workload: str, transformer_size: list[int] | None = None) -> nn.Module:
    """A built-in model by name (``tiny_transformer`` of ``transformer_size`` = (d_model, layers), default its
    128 x 2), or the user's: ``"package.module:factory"`` (a zero-argument callable)."""
    from gradientflow.bench.models import build_model, resolve_model

    if ":" in workload:
        return resolve_model(workload)[1]()
    if workload == "tiny_transformer" and transformer_size is not None:
        d_model, layers = transformer_size
        return build_model(workload, d_model=d_model, n_layers=layers)
    return build_model(workload)


def make_batch(spec: BenchSpec, rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's fixed batch: the built-in workload's, or N(0, 1) inputs of ``input_shape`` for a
    user's model, which is then trained on :func:`_loss`'s synthetic objective (no labels)."""
    from gradientflow.bench.models import synthetic_batch

    if ":" not in spec.workload:
        return synthetic_batch(spec.workload, spec.batch_size, seed=rank)
    assert spec.input_shape is not None
    gen = torch.Generator().manual_seed(rank)
    return torch.randn((spec.batch_size, *spec.input_shape), generator=gen), None


def plan_variants(modes: list[str], fusion_mb: float, theta_sweep: list[float], alone: bool = True) -> list[Variant]:
    """``compute`` first (the reference), then the modes, then (``alone``) each mode but PowerSGD and the sharded
    ones (whose mesh is the launch's) again on a one-rank group (see :attr:`Variant.alone`), then the θ sweep
    (gf-none and ddp at each θ).  Old mode names run as the recipe table spells them (:func:`canonical_mode`).

    A sweep point identical to a requested mode (gf-none at ``fusion_mb``, ddp at 25 MB) is not
    run twice: the report points at the mode.
    """
    out = [Variant("compute", "compute")]
    for m in dict.fromkeys(canonical_mode(m) for m in modes):  # an old name runs as its recipe's (mode_names)
        if m == "compute":
            continue
        base = split_mode(m)[0]
        own_theta = base.startswith(GF_PREFIX) and gf_recipe(base)[1].get("schedule") == "auto"  # picks its own θ
        theta = fusion_mb if base.startswith(GF_PREFIX) and not own_theta else None
        out.append(Variant(m, m, theta))
    if alone:  # not for torch's PowerSGD hook, kept out of shared launches (ISOLATED), nor a sharded mode (its mesh)
        out += [
            Variant(v.name + ALONE_SUFFIX, v.mode, v.theta_mb, alone=True)
            for v in out[1:]
            if v.mode not in ISOLATED and not is_sharded(v.mode)
        ]
    named = {canonical_mode(m) for m in modes}
    for theta in theta_sweep:
        if not (DENSE_FP32 in named and theta == fusion_mb):
            out.append(Variant(f"{DENSE_FP32} θ={theta:g}", DENSE_FP32, theta, sweep=True))
        if not ("ddp" in named and theta == DDP_DEFAULT_BUCKET_MB):
            out.append(Variant(f"ddp θ={theta:g}", "ddp", theta, sweep=True))
    return out


@dataclass
class BenchOptions:
    """Options of ``gradientflow bench`` (see ``gradientflow bench --help``)."""

    workload: str = "resnet50"  # a built-in model, or "package.module:factory" with input_shape
    input_shape: tuple[int, ...] | None = None
    nproc: int = 2  # ranks in all
    nproc_per_node: int = 1  # ranks per (emulated) node: nproc / nproc_per_node nodes
    steps: int = 20
    warmup: int = 3
    modes: list[str] = field(default_factory=lambda: list(MODES))
    alone: bool = True  # each mode also on a one-rank group: its cost apart from the network (Variant.alone)
    bandwidth: str = "1gbit"
    batch_size: int = 8
    fusion_mb: float = 25.0
    theta_sweep: list[float] = field(default_factory=list)
    algorithm: str = "native"
    chunk_size: int | None = None
    threads: int | None = None
    timeout_s: float = 1800.0
    prefix: str = "gfb"
    out: str = "benchmarks/results"
    device: str = "cpu"
    links: list[str] = field(default_factory=list)  # link profiles (bench.links.PROFILES): the matrix instead
    optimizer: str = "sgd"
    transformer_size: tuple[int, int] = (128, 2)  # --workload tiny_transformer: d_model x layers

    @property
    def nodes(self) -> int:
        """Nodes of the run (``nproc / nproc_per_node``; the CLI checks that it divides)."""
        return self.nproc // self.nproc_per_node
