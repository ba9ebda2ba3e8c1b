"""The values each option takes, apart from the config that holds them: the chunk-size rule, the closed sets'
checks (``pick``, θ, ``topology``), the quantiser's checks and the recipe a ``compression`` value names.  Pure
functions of the values: :class:`gradientflow.config.GradientFlowConfig` calls them, and so do the doors and the
bench where they read one option alone."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, get_args

import torch

from .options_base import advise, did_you_mean, not_int
from .recipe_options import QuantLevels
from .recipe_rule import Resolved, UnknownRecipe, resolve
from .recipes import ALIASES, NAMES, QUANT_BITS, QUANT_DEFAULTS, Mechanism

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
    ``"topk-3bit"`` and ``"auto"`` (which may pick it) floor it at the quantiser's block: whole blocks per chunk,
    fewer fp32 score bytes."""
    if n_elements >= MIN_CHUNKS * PAPER_CHUNK:
        return PAPER_CHUNK
    return max(floor, 2 ** int(math.log2(max(1, n_elements // SMALL_MODEL_CHUNKS))))


# torch DDP users write dtypes as torch names them: each is the wire dtype it names.
COMM_DTYPE_ALIASES: dict[object, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
}


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


QUANT_LEVELS: tuple[QuantLevels, ...] = get_args(QuantLevels)
"""The quantiser's levels: ``comm.levels.CODEBOOKS`` (with a zero), steps ``k / L`` of the scale, or ``ZEROLESS``."""
ZEROLESS_BITS = (2,)
"""The widths with a ``comm.levels.ZEROLESS`` table (``quant_levels="zeroless"``)."""
DEFAULT_QUANT = (QUANT_DEFAULTS["quant_bits"], QUANT_DEFAULTS["quant_block"])
"""``compression="3bit"``: 3 bits, 128-element blocks (0.0977 of fp32's bytes; kept AdamW's quality)."""
QUANT_THETA_MB = 8.0
"""The quantised recipes' θ where the user gives none (``bucket_cap_mb`` / ``fusion_threshold_mb``): their wire
carries 0.1 of the pool's bytes, so 25 MB buckets left a small transformer one message after backward; 8 MB
buckets overlap it (measured: docs/results/adamw.md, experiments/quantized_theta.py)."""


def recipe_error(value: object, candidates: Sequence[str] = ()) -> ValueError:
    """The ``ValueError`` for a ``compression`` value that names no recipe: the closest name, then every one, and
    (``candidates``: the recipes that run with the options passed beside it) which to pass."""
    close = did_you_mean(value, [*NAMES, *ALIASES])
    first = [n for n in candidates if close and f"{n!r}" in close]  # the closest name first, where it runs
    offered = [*first, *(n for n in candidates if n not in first)]
    return ValueError(
        f"compression must be a recipe's name, got {value!r}{close}: one of "
        f"{', '.join(map(repr, NAMES))} (docs/recipes.md); earlier names {', '.join(map(repr, ALIASES))} are "
        f"accepted too, and the quantised family by width: '<bits>bit' or '<bits>bit-precond', bits in "
        f"{list(QUANT_BITS)}." + (" " + advise(({"compression": offered}, [])) if offered else "")
    )


def check_quantizer(q: Mapping[str, Any]) -> None:
    """The quantiser's options as they run (``q``: the ``quant_*`` values; ``quant_precondition`` and
    ``quant_warmup_steps`` None where the mechanism has no such option): ``ValueError`` saying what is allowed."""
    bits, block, levels = q.get("quant_bits"), q.get("quant_block"), q.get("quant_levels")
    if bits not in QUANT_BITS or not isinstance(block, int) or isinstance(block, bool) or block < 16 or block % 16:
        raise ValueError(
            f"quant_bits must be one of {list(QUANT_BITS)} and quant_block a multiple of 16, got {bits!r}, {block!r}"
        )
    if levels not in QUANT_LEVELS or (levels == "zeroless" and bits not in ZEROLESS_BITS):
        raise ValueError(
            f"quant_levels must be one of {list(QUANT_LEVELS)} ('zeroless' with quant_bits in "
            f"{list(ZEROLESS_BITS)}), got {levels!r} at quant_bits={bits!r}"
        )
    w, pre = q.get("quant_warmup_steps"), q.get("quant_precondition")
    if (pre is not None and not isinstance(pre, bool)) or (w is not None and (not_int(w) or w < 0)):
        raise ValueError(
            f"quant_precondition must be True or False and quant_warmup_steps an int >= 0 (steps at 3 bits), got "
            f"{pre!r}, {w!r}"
        )
    c = q.get("quant_clip")
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c >= 0):
        raise ValueError(f"quant_clip must be a number >= 0 (0 = max-abs scales), got {c!r}")


def lookup(value: object) -> Resolved:
    """The recipe a ``compression`` value names (:func:`gradientflow.recipe_rule.resolve`), or :func:`recipe_error`."""
    try:
        return resolve(value)
    except UnknownRecipe:
        raise recipe_error(value) from None


@functools.lru_cache(maxsize=256)
def mechanism_of(name: str, density: float | None) -> Mechanism:
    """The mechanism a resolved recipe runs: ``"none"`` with a ``density`` is CSC (the options as passed)."""
    mech = lookup(name).recipe.mechanism
    return "topk" if mech == "dense" and density is not None else mech


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
