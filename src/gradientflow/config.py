"""One frozen, validated dataclass holding every option of the wrapper."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NamedTuple, get_args

import torch

# The closed option sets, as types (mypy checks what code passes) and as the tuples validation names.
CommDtype = Literal["fp32", "fp16", "bf16", "half"]
Algorithm = Literal["native", "ring"]
ChunkScore = Literal["l1", "sampled_l1"]
CscScope = Literal["slice", "global"]
Schedule = Literal["fixed", "auto"]
Recipe = Literal["none", "fp16", "csc", "cscq", "quantized", "auto"]
QuantLevels = Literal["fitted", "uniform", "zeroless"]

ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)
"""``algorithm``: the backend's allreduce, or gradientflow's ring (:mod:`gradientflow.comm.ring`)."""
CHUNK_SCORES: tuple[ChunkScore, ...] = get_args(ChunkScore)
"""``chunk_score``: how CSC ranks chunks (:mod:`gradientflow.strategies.selection`)."""

PAPER_CHUNK = 32768
"""The paper's chunk size (32K gradients)."""
MIN_CHUNKS = 200
"""``chunk_size="auto"`` gives the paper's chunk to models of at least this many such chunks."""
SMALL_MODEL_CHUNKS = 2000
"""``chunk_size="auto"`` cuts smaller models into about this many chunks (see auto_chunk_size)."""


def auto_chunk_size(n_elements: int, floor: int = 16) -> int:
    """The paper's 32768 for models of >= 200 such chunks; else a power of two giving ~2000 chunks.

    ResNet-50 (25.6M) and AlexNet (61M) get 32768.  A smaller model gets the power of two at or below ``n / 2000``
    (at least ``floor``): finer chunks let the top fraction follow the gradient closely (on the quality bench's
    models ~2000 chunks ended lower than ~200; on its bigger time-to-accuracy transformer, slightly higher).
    ``"cscq"`` and ``"auto"`` floor it at the quantiser's block: whole blocks per chunk, fewer fp32 score bytes."""
    if n_elements >= MIN_CHUNKS * PAPER_CHUNK:
        return PAPER_CHUNK
    return max(floor, 2 ** int(math.log2(max(1, n_elements // SMALL_MODEL_CHUNKS))))


# "fp32" is full precision: no cast, the gradient travels in its own dtype (fp32 for fp32
# parameters, fp64 for a float64 model, as torch DDP sends it).
COMM_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


# torch DDP users write dtypes as torch names them: each is the wire dtype it names.
COMM_DTYPE_ALIASES: dict[object, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
}


def did_you_mean(value: object, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped string, else ``""``."""
    close = difflib.get_close_matches(str(value).lower(), choices, n=1, cutoff=0.6) if isinstance(value, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def pick(name: str, value: object, choices: Sequence[str], more: str = "") -> str:
    """``value`` as one of ``choices`` (case and surrounding spaces ignored); else ``ValueError`` naming the
    option, the closest choice and all of them (``more``: what else is accepted)."""
    key = value.strip().lower() if isinstance(value, str) else value
    if isinstance(key, str) and key in choices:
        return key
    raise ValueError(
        f"{name} must be one of {', '.join(map(repr, choices))}{more}; got {value!r}{did_you_mean(key, choices)}"
    )


def check_theta(name: str, value: object) -> None:
    """θ (``fusion_threshold_mb``, or torch DDP's ``bucket_cap_mb``: ``name`` is the one the user passed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(
            f"{name} must be a number >= 0 (MB per fused allreduce; 0 = no fusion, float('inf') = one "
            f"collective after backward), got {value!r}"
        )


COMPRESSIONS: tuple[Recipe, ...] = get_args(Recipe)
"""``compression``: named recipes (see :func:`parse_compression` for ``"q<bits>"`` / ``"q<bits>b<block>"``)."""
CSC_RECIPE: dict[str, Any] = {"comm_dtype": "fp16", "density": 0.1}
"""``compression="csc"``: fp16 CSC at 0.1, measured for SGD first (``"auto"``'s SGD recipe until 2026-11-27)."""
CSCQ_RECIPE: dict[str, Any] = {"comm_dtype": "fp32", "density": 0.3}
"""``compression="cscq"`` (``"auto"`` with SGD): CSC at 0.3 (or the ``density`` passed), chunks in 3-bit blocks."""
QUANT_BITS = (2, 3, 4, 5, 6, 7, 8, 32)
"""Quantiser widths: 2 = ternary {-s, 0, s}, 3 = the default (7 levels), 32 = the quantiser off (fp32 ring)."""
QUANT_LEVELS: tuple[QuantLevels, ...] = get_args(QuantLevels)
"""The quantiser's levels: ``comm.levels.CODEBOOKS`` (with a zero), steps ``k / L`` of the scale, or ``ZEROLESS``."""
ZEROLESS_BITS = (2,)
"""The widths with a ``comm.levels.ZEROLESS`` table (``"q2n"``)."""
DEFAULT_QUANT = (3, 128)
"""``compression="quantized"``: 3 bits, 128-element blocks (0.0977 of fp32's bytes; kept AdamW's quality)."""
QUANT_THETA_MB = 8.0
"""The quantised recipe's θ where the user gives none (``bucket_cap_mb`` / ``fusion_threshold_mb``): its wire
carries 0.1 of the pool's bytes, so 25 MB buckets left a small transformer one message after backward; 8 MB
buckets overlap it (measured: docs/adamw.md, experiments/quantized_theta.py)."""


class Compression(NamedTuple):
    """A ``compression`` value parsed: the recipe and, for ``"quantized"``, its quantiser."""

    recipe: Recipe
    bits: int = DEFAULT_QUANT[0]
    block: int = DEFAULT_QUANT[1]
    clip: float = 0.0  # k: each block's scale clipped at k x its RMS (0 = max-abs)
    levels: QuantLevels = "fitted"
    precondition: bool = False  # each coordinate quantised in units of its own RMS
    warmup: int = 0  # the first steps at the default quantiser (3 bits)


def parse_compression(value: object) -> Compression:
    """The :class:`Compression` a ``compression`` value names; ``ValueError`` saying what is accepted.

    ``"quantized"`` = ``"q3"`` = 3 bits in 128-element blocks with max-abs scales and the non-uniform levels
    of ``comm.levels.CODEBOOKS``; ``"q<bits>"`` another width (2-8, or 32 = the quantiser off);
    ``"q<bits>b<block>"`` also another block (a multiple of 16); a ``"u"`` after them: uniform levels
    (``"q3u"``: the first version of the recipe); an ``"n"``: levels with no zero (``comm.levels.ZEROLESS``,
    2 bits: ``"q2n"``); a ``"p"``: preconditioned (each coordinate quantised in units of its own RMS, see
    ``strategies.quantized``); ``"w<steps>"``: the first steps at the default quantiser (3 bits); a trailing
    ``"c<k>"`` clips each block's scale at k x its RMS (an experiment; 0 = max-abs).
    """
    value = value.strip().lower() if isinstance(value, str) else value  # "Auto", "Quantized" as meant
    for recipe in COMPRESSIONS:
        if value == recipe:
            return Compression(recipe)
    if value == "quantised":  # the British spelling names the same recipe
        return Compression("quantized")
    pattern = r"q(\d+)(?:b(\d+))?([un])?(p)?(?:w(\d+))?(?:c(\d+(?:\.\d+)?))?"
    m = re.fullmatch(pattern, value) if isinstance(value, str) else None
    if m is not None:
        bits, block = int(m[1]), int(m[2]) if m[2] else DEFAULT_QUANT[1]
        clip = float(m[6]) if m[6] else 0.0
        levels: QuantLevels = "uniform" if m[3] == "u" else "zeroless" if m[3] == "n" else "fitted"
        if bits in QUANT_BITS and block >= 16 and block % 16 == 0 and (levels != "zeroless" or bits in ZEROLESS_BITS):
            return Compression("quantized", bits, block, clip, levels, m[4] is not None, int(m[5] or 0))
    # The short answer first: most bad values are a mistyped name; the quantiser grammar is for experiments.
    raise ValueError(
        f"compression must be a recipe's name, got {value!r}{did_you_mean(value, [*COMPRESSIONS, 'q2npw20'])}: one of "
        f"{', '.join(map(repr, COMPRESSIONS))} or 'q2npw20' (docs/adamw.md); other quantisers are written "
        f"'q<bits>[b<block>][u|n][p][w<steps>][c<k>]', bits in {list(QUANT_BITS)}, block a multiple of 16"
    )


TOPOLOGY_PATTERN = re.compile(r"([1-9]\d*)x([1-9]\d*)")
"""``topology="MxG"``: M nodes of G ranks."""


def check_topology_value(value: object) -> None:
    """``ValueError`` unless ``value`` is ``"auto"``, ``"flat"`` or ``"MxG"`` (positive M and G)."""
    if value in ("auto", "flat") or (isinstance(value, str) and TOPOLOGY_PATTERN.fullmatch(value)):
        return
    raise ValueError(
        f"topology must be 'auto' (the node layout from torchrun's LOCAL_WORLD_SIZE), 'flat' (one exchange over "
        f"every rank) or 'MxG' (M nodes of G ranks, ranks node-contiguous, e.g. '2x4'), got {value!r}"
    )


def half_wire_dtype(device: torch.device) -> str:
    """``comm_dtype="half"``: the fastest 16-bit wire for the device.

    CPU (Gloo): "bf16" — Gloo's fp16 sum is no faster than its fp32 sum, its bf16 sum is (README,
    loopback table: bf16 is the fastest dense wire).
    Accelerators (NCCL): "fp16" — both go at line rate there, and fp16 keeps 3 more mantissa bits.
    """
    return "bf16" if device.type == "cpu" else "fp16"


@dataclass(frozen=True)
class GradientFlowConfig:
    """Options of :class:`gradientflow.DistributedDataParallel` (see README's options table), each documented
    under its field; validated at construction (``ValueError`` saying what to do)."""

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
    density: float | None = None
    """CSC: the fraction of chunks sent each step; ``None`` = dense."""
    chunk_size: int | str = "auto"
    """CSC: gradients per chunk: an int, or "auto" (:func:`auto_chunk_size`; :meth:`resolved` replaces it)."""
    warmup_steps: int = 100
    """CSC: length of the density ramp: step t < warmup_steps sends ``density ** (t / warmup_steps)`` of the
    chunks (step 0 dense), later steps ``density``.  A ramp step whose chunks and scores would be no fewer
    bytes than a dense step is sent dense."""
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
    timeout: float | timedelta | None = None
    """Seconds (or a ``timedelta``) any wait may take before ``gradientflow.CommunicationError`` (naming the
    step, the collective and the missing ranks); ``None`` = the process group's timeout."""
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
    compression: str = "none"
    """A named recipe (:data:`COMPRESSIONS`): "none" (DDP's exact behaviour, or what comm_dtype / density say),
    "fp16" (= comm_dtype="fp16"), "csc" (comm_dtype="fp16", density=0.1), "cscq" (CSCQ_RECIPE), "quantized" / "q3"
    (3-bit blocks of 128 with error feedback, on a ring; others: :func:`parse_compression`),
    "auto" (dense until the first optimizer step, then "cscq" for SGD, "quantized" for Adam and the others)."""
    topology: str = "auto"
    """The node layout: "auto" (from torchrun's ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` / ``LOCAL_RANK``; else,
    with one node of every rank, or a group not the whole world: flat), "flat" (one exchange over every rank),
    or "MxG" (M nodes of G ranks, node-contiguous: rank = node * G + local).  Several nodes of several ranks
    synchronise two-level (:mod:`gradientflow.comm.two_level`).  Resolved at construction: "flat" or "MxG"."""
    # The quantiser of "quantized", set from ``compression`` (the fields of :class:`Compression`):
    quant_bits: int = DEFAULT_QUANT[0]  # bits per gradient: one of QUANT_BITS (32 = the quantiser off)
    quant_block: int = DEFAULT_QUANT[1]  # gradients per scale: a multiple of 16
    quant_clip: float = 0.0  # each block's scale clipped at this many times its RMS (0 = max-abs)
    quant_levels: QuantLevels = "fitted"  # one of QUANT_LEVELS (comm.levels.LEVELS)
    quant_precondition: bool = False  # each coordinate quantised in units of its own RMS (strategies.quantized)
    quant_warmup: int = 0  # the first steps at the default quantiser (3 bits)

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

    def _apply_compression(self) -> None:
        """Fold ``compression`` into the options it sets; a conflicting explicit value is a ``ValueError``.

        Idempotent (``dataclasses.replace`` of a resolved config gives the same config).
        """
        parsed = parse_compression(self.compression)
        recipe = parsed.recipe
        if self.compression != "quantized" and recipe == "quantized":
            for name in ("bits", "block", "clip", "levels", "precondition", "warmup"):
                object.__setattr__(self, f"quant_{name}", getattr(parsed, name))
        object.__setattr__(self, "compression", recipe)
        sets: dict[str, Any] = {"fp16": {"comm_dtype": "fp16"}, "csc": CSC_RECIPE, "cscq": CSCQ_RECIPE}.get(recipe, {})
        if recipe in ("quantized", "auto"):
            sets = {"comm_dtype": "fp32", "density": None}
        elif recipe == "cscq" and self.density is not None:  # a density passed beside "cscq" is its density
            sets = {"comm_dtype": "fp32"}
        for name, value in sets.items():
            if getattr(self, name) not in (value, "fp32" if name == "comm_dtype" else None):
                raise ValueError(
                    f"compression={self.compression!r} sets {name}={value!r}, but {name}={getattr(self, name)!r} was "
                    f"passed too. Pass either compression={self.compression!r} or {name}=... (with "
                    "compression='none'), not both."
                )
            object.__setattr__(self, name, value)
        if self.quant_bits not in QUANT_BITS or self.quant_block < 16 or self.quant_block % 16:
            raise ValueError(
                f"quant_bits must be one of {list(QUANT_BITS)} and quant_block a multiple of 16, got "
                f"{self.quant_bits!r}, {self.quant_block!r}"
            )
        if self.quant_levels not in QUANT_LEVELS or (
            self.quant_levels == "zeroless" and self.quant_bits not in ZEROLESS_BITS
        ):
            raise ValueError(
                f"quant_levels must be one of {list(QUANT_LEVELS)} ('zeroless' with quant_bits in "
                f"{list(ZEROLESS_BITS)}), got {self.quant_levels!r} at quant_bits={self.quant_bits!r}"
            )
        w = self.quant_warmup
        if not isinstance(self.quant_precondition, bool) or isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(
                f"quant_precondition must be True or False and quant_warmup an int >= 0 (steps at 3 bits), got "
                f"{self.quant_precondition!r}, {w!r}"
            )

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
        if self.chunk_size == "auto":  # "cscq" (or "auto", which may pick it): whole quantiser blocks per chunk
            floor = self.quant_block if self.compression in ("cscq", "auto") else 16
            changes["chunk_size"] = auto_chunk_size(n_elements, floor)
        if self.comm_dtype == "half":
            changes["comm_dtype"] = half_wire_dtype(device)
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def sparse(self) -> bool:
        return self.density is not None

    @property
    def quantized(self) -> bool:
        return self.compression == "quantized"

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
