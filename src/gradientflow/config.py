"""One frozen, validated dataclass holding every option of the wrapper."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, get_args

import torch

from .option_values import (
    COMM_DTYPE_ALIASES,
    auto_chunk_size,
    check_quantizer,
    check_theta,
    check_topology_value,
    half_wire_dtype,
    mechanism_of,
    pick,
    recipe_error,
)
from .options_base import COMM_DTYPES, Quantizer, advise
from .outer_options import OUTER_OPTIONS, settle_outer
from .recipe_options import RecipeOptions
from .recipe_rule import UnknownRecipe, fold, resolve, runs_with
from .recipes import QUANT_DEFAULTS, QUANT_OPTIONS, Mechanism

# The closed option sets, as types (mypy checks what code passes) and as the tuples validation names.
CommDtype = Literal["fp32", "fp16", "bf16", "half"]
Algorithm = Literal["native", "ring"]
ChunkScore = Literal["l1", "sampled_l1"]
CscScope = Literal["slice", "global"]
Schedule = Literal["fixed", "auto"]

ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)
"""``algorithm``: the backend's allreduce, or gradientflow's ring (:mod:`gradientflow.comm.ring`)."""
CHUNK_SCORES: tuple[ChunkScore, ...] = get_args(ChunkScore)
"""``chunk_score``: how CSC ranks chunks (:mod:`gradientflow.exchange.selection`)."""


@dataclass(frozen=True)
class GradientFlowConfig(RecipeOptions):
    """Options of :class:`gradientflow.DistributedDataParallel` (see README's options table), each documented
    under its field; validated at construction (``ValueError`` saying what to do).  The recipe options
    (``compression``, ``density``, ``quant_*``, ``timeout``, ...: what ``fully_shard`` takes too) are the fields of
    :class:`gradientflow.recipe_options.RecipeOptions`, declared and documented there; they come first."""

    fusion_threshold_mb: float = 25.0
    """θ of lazy allreduce: a bucket of the gradient pool is launched once θ MB of it are ready.  0 = one
    collective per tensor, ``inf`` = one collective after backward."""
    broadcast_buffers: bool = True
    """Broadcast module buffers (BatchNorm statistics) from rank 0 at every forward."""
    comm_dtype: CommDtype = "fp32"
    """Dtype on the wire: "fp32" (full precision: the gradient's own dtype, no cast), "fp16", "bf16", or "half"
    (the fastest 16-bit for the device: bf16 on CPU, fp16 on GPUs; :meth:`resolved` replaces it).  torch's
    dtypes and names (``torch.float16``, ``"float16"``) are accepted and stored as these."""
    algorithm: Algorithm = "native"
    """"native" (the backend's allreduce) or "ring" (gradientflow's ring)."""
    momentum: float = 0.0
    """CSC: momentum correction factor (0 = off).  When > 0 the optimizer must not apply momentum again."""
    dense_1d: bool = True
    """CSC: 1-D parameters (biases, normalisation scales) are laid out together at the end of the pool and
    their chunks are sent every step (few bytes, often decisive)."""
    chunk_score: ChunkScore = "l1"
    """CSC: how a chunk is scored: "l1" (the paper: the L1 norm of its accumulated gradient) or "sampled_l1"
    (8x the L1 of 16 of every 128 elements, read from 1/8 of the pool; chunks under 1024 gradients are scored
    exactly)."""
    csc_scope: CscScope = "slice"
    """CSC: where the top chunks are chosen: "slice" (default, measured faster: a top-k per fused slice as
    backward produces it, its packed allreduce overlapping backward; each slice sends ceil(density * its
    chunks), < 1 chunk per slice over the global count) or "global" (the paper: one top-k after backward)."""
    schedule: Schedule = "fixed"
    """"fixed" (θ and ``csc_scope`` as given) or "auto": both derived at construction from the group's measured
    per-collective cost and throughput (rank 0's, broadcast; :mod:`gradientflow.engine.schedule`)."""
    check_consistency: bool = False
    """Per synchronised step, one tiny allreduce checks that every rank is synchronising the same step with
    the same buckets (e.g. no rank alone inside ``no_sync()``)."""
    check_finite: bool = False
    """Raise on every rank when a local gradient is non-finite (skipped while a GradScaler is registered:
    overflow is then the scaler's to handle)."""
    trace_path: str | None = None
    """Write a Chrome trace (Perfetto) per rank; ``{rank}`` in the path is replaced by the rank, otherwise
    ``.rank<N>`` is inserted before the extension.  ``None`` = no tracing."""
    trace_steps: tuple[int, int] | None = None
    """``(start, stop)``: synchronised steps traced, 0-based, stop excluded [(1, 4) when ``trace_path`` is
    given, which the config then holds; ``None`` without it]."""
    topology: str = "auto"
    """The node layout: "auto" (from torchrun's ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` / ``LOCAL_RANK``; else,
    with one node of every rank, or a group not the whole world: flat), "flat" (one exchange over every rank),
    or "MxG" (M nodes of G ranks, node-contiguous: rank = node * G + local).  Several nodes of several ranks
    synchronise two-level (:mod:`gradientflow.comm.two_level`).  Resolved at construction: "flat" or "MxG"."""
    # Fewer syncs between nodes (DiLoCo, docs/fewer-syncs.md; :mod:`gradientflow.outer`).  None = the default where
    # sync_every > 1; the config holds the values that run (None at sync_every=1, where none of them applies).
    sync_every: int = 1
    """H: the replicas (the nodes, or every rank on a flat layout) step apart for H optimizer steps, then the
    pseudo-gradient (the last synchronised parameters minus the current ones, averaged) goes through
    ``outer_compression``'s exchange and the outer optimizer sets every replica to the same parameters.  Inside
    a node of several ranks gradients are still averaged densely every step.  1 = every step (torch DDP's
    behaviour, the exact code path of today)."""
    outer_lr: float | None = None
    """The outer optimizer's learning rate (Nesterov SGD on the averaged pseudo-gradient) [1.0: with
    outer_momentum=0, the replicas' parameters averaged, the measured best (docs/results/fewer-syncs.md); DiLoCo's
    0.7 with outer_momentum=0.9]."""
    outer_momentum: float | None = None
    """The outer optimizer's Nesterov momentum, in [0, 1) [0.0; DiLoCo's 0.9]."""
    outer_compression: str | None = None
    """The outer exchange's recipe, a name of the one table: "none" (fp32), "fp16", "bf16", or the quantised family
    ("3bit", "4bit", "2bit", ...: block-quantised, with error feedback across outer syncs), or the top chunks of the
    pseudo-gradient in 2 or 3 bits ("indexed-topk-2bit", "indexed-topk-3bit": ``outer_density`` of them, each replica
    its own; what it does not send stays in its parameters) ["3bit": the same loss as fp32 on a tenth of its bytes,
    measured]."""
    outer_density: float | None = None
    """A top-k outer exchange's share of the pseudo-gradient's chunks (128 elements each) sent per sync, the rest
    left in the replica's parameters for the next [0.1 with outer_compression "indexed-topk-2bit" /
    "indexed-topk-3bit"; refused with any other]."""
    sync_fragments: int | None = None
    """Streaming: the parameters cut into this many fragments (whole tensors, about equal sizes), fragment f
    synchronised at the steps t with (t + 1 - (f + 1) * H // F) % H == 0, so the link carries F smaller
    exchanges per H steps instead of one [1]."""
    sync_delay: int | None = None
    """Streaming's overlap: inner steps an outer exchange runs beside before its result is merged.  The
    pseudo-gradient is taken at the fragment's sync step and its exchange started; ``sync_delay`` optimizer steps
    later the outer step is applied to the anchor and the fragment set to the new anchor plus the replica's own
    progress since the pseudo-gradient was taken (no inner step is lost).  0 = the exchange blocks its step; at
    most ``sync_every // sync_fragments`` (one outer exchange in flight at a time) [0]."""
    outer_state_device: str | None = None
    """Where the last synchronised parameters and the outer momentum live: "cpu" (host memory, for GPUs short
    of memory) or None (the parameters' device)."""

    def __post_init__(self) -> None:
        check_theta("fusion_threshold_mb", self.fusion_threshold_mb)
        dtype: object = self.comm_dtype
        if isinstance(dtype, (str, torch.dtype)):  # torch.float16, "float16", "FP16": the names of the table
            dtype = COMM_DTYPE_ALIASES.get(dtype.strip().lower() if isinstance(dtype, str) else dtype, dtype)
        more = ", or torch.float32 / torch.float16 / torch.bfloat16"
        object.__setattr__(self, "comm_dtype", pick("comm_dtype", dtype, [*COMM_DTYPES, "half"], more))
        object.__setattr__(self, "algorithm", pick("algorithm", self.algorithm, ALGORITHMS))
        d = self.density
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1):
            raise ValueError(f"density must be None (dense) or a number in (0, 1], got {d!r}")
        c = self.chunk_size
        if c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f'chunk_size must be "auto" or a positive int (gradients per chunk), got {c!r}')
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        m = self.momentum
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
            raise ValueError(f"momentum must be a number in [0, 1) (0 = no momentum correction), got {m!r}")

        object.__setattr__(self, "chunk_score", pick("chunk_score", self.chunk_score, CHUNK_SCORES))
        object.__setattr__(self, "csc_scope", pick("csc_scope", self.csc_scope, ("slice", "global")))
        more = " ('fixed': θ and csc_scope as given; 'auto': derived from the link measured at construction)"
        object.__setattr__(self, "schedule", pick("schedule", self.schedule, ("fixed", "auto"), more))
        check_topology_value(self.topology)
        self._validate_fault_options()
        self._apply_compression()
        self._validate_outer()

    def _apply_compression(self) -> None:
        """Fold ``compression`` into the options its recipe sets, by the rule of :mod:`gradientflow.recipes`:
        the row's values, overridden by options passed explicitly, except those the name states (a conflict is a
        ``ValueError``), and a ``ValueError`` for an option the recipe's mechanism does not read.  ``comm_dtype``
        reads as passed when it is not its default ("fp32").  Idempotent: ``dataclasses.replace`` of a resolved
        config gives the same config (:meth:`with_recipe` switches recipe)."""
        passed = {k: getattr(self, k) for k in ("density", *QUANT_OPTIONS) if getattr(self, k) is not None}
        if self.comm_dtype != "fp32":
            passed["comm_dtype"] = self.comm_dtype
        object.__setattr__(self, "_comm_dtype_passed", "comm_dtype" in passed)  # (else the recipe's, if not fp32)
        try:
            found = resolve(self.compression)
        except UnknownRecipe:
            raise recipe_error(self.compression, runs_with(passed, self._runs(passed))) from None
        name = found.name
        if "per step" not in found.recipe.scopes:
            raise ValueError(
                f"compression={self.compression!r} is an outer exchange (its scope is 'outer', docs/recipes.md): it "
                f"runs every sync_every steps as outer_compression={name!r} (docs/fewer-syncs.md), while "
                "compression= takes a per-step recipe. " + self._outer_instead(name, passed)
            )
        settled = fold(found, passed, self._runs(passed))
        object.__setattr__(self, "compression", name)
        for k in ("comm_dtype", "density"):
            if k in settled:
                object.__setattr__(self, k, settled[k])
        for k in QUANT_OPTIONS:  # the values that run; None where the recipe's mechanism has no such option
            object.__setattr__(self, k, settled.get(k))
        if "quant_bits" in settled:
            try:
                check_quantizer(settled)
            except ValueError as exc:  # a quantiser option passed that the recipe's others refuse
                quant = [k for k in QUANT_OPTIONS if k in passed]
                others = runs_with(passed, self._runs(passed), but=name)
                alternatives: list[tuple[dict[str, Any], list[str]]] = [({"compression": others}, [])] if others else []
                raise ValueError(f"{exc}. " + advise(({}, quant), *alternatives)) from None
        # the options passed beside the recipe (values its row does not set): what an outer-only run would drop
        row = {**found.recipe.settings(), **found.stated}
        object.__setattr__(self, "_beside", tuple(k for k, v in passed.items() if k not in row or row[k] != v))

    def _runs(self, passed: Mapping[str, Any]) -> Callable[[str], bool]:
        """Whether this config constructs with another recipe, by name, and the recipe options ``passed``: what an
        error's advice offers must construct (the table's rule and the quantiser checked first, so that a trial
        never fails in the rule, whose message would try recipes again)."""

        def fits(name: str) -> bool:
            try:
                settled = fold(resolve(name), passed)
                if "quant_bits" in settled:
                    check_quantizer(settled)
                dataclasses.replace(self, compression=name)  # the outer options beside it, the layout
            except ValueError:
                return False
            return True

        return fits

    def _outer_instead(self, name: str, passed: Mapping[str, Any]) -> str:
        """The advice for an outer recipe passed as ``compression``: it as the outer exchange (where that
        constructs with the other options), or a per-step recipe that runs with the options ``passed``."""
        alternatives: list[tuple[dict[str, Any], list[str]]] = []
        outer: dict[str, Any] = {"outer_compression": [name]}
        if self.sync_every == 1:
            outer["sync_every"] = [30]
        try:  # the same options with the recipe moved to outer_compression (and none of the per-step ones)
            moved: dict[str, Any] = {"compression": "none", "comm_dtype": "fp32", "density": None}
            moved.update({**dict.fromkeys(QUANT_OPTIONS), **{k: v[0] for k, v in outer.items()}})
            dataclasses.replace(self, **moved)
            alternatives.append((outer, ["compression", *passed]))
        except ValueError:
            pass
        per_step = runs_with(passed, self._runs(passed))
        if per_step:
            alternatives.append(({"compression": per_step}, []))
        return advise(*alternatives) if alternatives else "Pass a per-step recipe (docs/recipes.md)."

    def with_recipe(self, name: str, **options: Any) -> GradientFlowConfig:
        """This config running recipe ``name`` (with ``options``) instead: every recipe option back to unset
        first, so the new row's values apply (``compression="auto"``'s switch)."""
        unset: dict[str, Any] = {"comm_dtype": "fp32", "density": None, **dict.fromkeys(QUANT_OPTIONS)}
        return dataclasses.replace(self, compression=name, **{**unset, **options})

    def _validate_fault_options(self) -> None:
        t = self.timeout
        seconds = t.total_seconds() if isinstance(t, timedelta) else t
        if t is not None and (
            isinstance(t, bool) or not isinstance(seconds, (int, float)) or not seconds > 0 or math.isinf(seconds)
        ):
            raise ValueError(
                f"timeout must be None (the process group's), a number of seconds > 0 or a timedelta, got {t!r}"
            )
        for name in ("check_consistency", "check_finite", "dense_1d"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.trace_path is not None and not isinstance(self.trace_path, str):
            raise ValueError(f"trace_path must be None or a str (a path), got {self.trace_path!r}")
        steps = self.trace_steps
        if steps is None and self.trace_path is not None:  # model.config shows the steps traced, not None
            steps = DEFAULT_TRACE_STEPS
        if steps is not None:
            if self.trace_path is None:
                raise ValueError("trace_steps has no effect without trace_path: pass trace_path='trace.json' too")
            if (
                not isinstance(steps, (tuple, list))
                or len(steps) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                or not 0 <= steps[0] < steps[1]
            ):
                raise ValueError(
                    f"trace_steps must be (start, stop) with 0 <= start < stop (synchronised steps, stop "
                    f"excluded), got {steps!r}"
                )
            object.__setattr__(self, "trace_steps", (int(steps[0]), int(steps[1])))

    def _validate_outer(self) -> None:
        """``sync_every`` and the outer options (docs/fewer-syncs.md): each checked, the defaults filled in where
        ``sync_every > 1``, and an outer option at ``sync_every=1`` (where it would do nothing) refused
        (:func:`gradientflow.outer_options.settle_outer`; the config holds the values it returns)."""
        settled = settle_outer(
            self.sync_every,
            {k: getattr(self, k) for k in OUTER_OPTIONS},
            compression=self.compression,
            comm_dtype=self.comm_dtype,
            topology=self.topology,
            mechanism=self.mechanism,
            beside=self.__dict__.get("_beside", ()),
            comm_dtype_passed=self.__dict__.get("_comm_dtype_passed", True),
        )
        for k, v in settled.items():
            object.__setattr__(self, k, v)

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype gradients are cast to on the wire; ``None`` = their own dtype (no cast)."""
        return COMM_DTYPES[self.comm_dtype]

    @property
    def threshold_bytes(self) -> float:
        return self.fusion_threshold_mb * 1024 * 1024

    def resolved(self, n_elements: int, device: torch.device) -> GradientFlowConfig:
        """This config for a model of ``n_elements`` on ``device``: ``chunk_size="auto"`` and
        ``comm_dtype="half"`` replaced by what they mean there."""
        changes: dict[str, Any] = {}
        if self.chunk_size == "auto":  # "topk-3bit" (or "auto", which may pick it): whole quantiser blocks per chunk
            mech = self.mechanism
            floor = int(QUANT_DEFAULTS["quant_block"]) if mech == "auto" else 16
            if mech == "topk-quantized":
                floor = self.quantizer().block
            changes["chunk_size"] = auto_chunk_size(n_elements, floor)
        if self.comm_dtype == "half":
            changes["comm_dtype"] = half_wire_dtype(device)
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def sparse(self) -> bool:
        return self.density is not None

    @property
    def mechanism(self) -> Mechanism:
        """What the recipe's strategy does (:data:`gradientflow.recipes.Mechanism`)."""
        return mechanism_of(self.compression, self.density)

    def quantizer(self) -> Quantizer:
        """The quantiser this config runs (``ValueError`` for a recipe that does not quantise; options its
        mechanism has no use for, such as ``"topk-3bit"``'s warm-up, read as the defaults)."""
        if self.quant_bits is None or self.quant_block is None or self.quant_levels is None:
            raise ValueError(f"compression={self.compression!r} does not quantise")
        return Quantizer(
            self.quant_bits,
            self.quant_block,
            self.quant_levels,
            bool(self.quant_precondition),
            self.quant_warmup_steps or 0,
            self.quant_clip or 0.0,
        )

    @property
    def quantized(self) -> bool:
        """Every gradient quantised every step (the "3bit" family)."""
        return self.mechanism == "quantized"

    @property
    def needs_control_group(self) -> bool:
        """CSC's score exchanges, and the quantised ring's point-to-point messages, keep the main group's
        collectives apart from the engine's bookkeeping (the "used" exchange goes on the control group)."""
        return self.sparse or self.quantized

    @property
    def trace_window(self) -> tuple[int, int]:
        return self.trace_steps if self.trace_steps is not None else DEFAULT_TRACE_STEPS


DEFAULT_TRACE_STEPS = (1, 4)
"""Steps traced when only ``trace_path`` is given: step 0 also re-lays the pool out, so skip it."""

LOCAL_OPTIONS = frozenset({"timeout", "trace_path", "trace_steps"})
"""Options that may differ between ranks; every other option must agree (checked at construction)."""
