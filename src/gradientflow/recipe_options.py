"""The recipe options: one typed definition of what a recipe of the table runs with (``compression``, the top-k
recipes' ``density`` / ``chunk_size`` / ``warmup_steps``, the quantiser's ``quant_*``) and ``timeout``, the options
that :class:`gradientflow.DistributedDataParallel` and :func:`gradientflow.fsdp.fully_shard` both take.

:class:`RecipeOptions` declares them once: their names, types, defaults and meaning (a docstring under each field).
:class:`gradientflow.config.GradientFlowConfig` extends it (these are its fields; it validates them and folds
``compression`` into them by the recipe table's rule).  The two doors take them as explicit keyword parameters, so
that ``help()``, signatures and type checkers show them; a signature cannot be built from a class for a type
checker, so each door states the names and types again and reads the defaults from here (``fully_shard``'s
``compression`` defaults to ``"auto"``: its own choice); tests/test_recipe_options.py checks that both signatures
agree with this class.  It imports nothing of gradientflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

QuantLevels = Literal["fitted", "uniform", "zeroless"]
"""The quantiser's levels (``quant_levels``)."""


@dataclass(frozen=True)
class RecipeOptions:
    """The recipe options, each documented under its field (validated by
    :class:`gradientflow.config.GradientFlowConfig`, which extends this class)."""

    compression: str = "none"
    """A recipe's name from the one table (:mod:`gradientflow.recipes`, docs/recipes.md): "none" (DDP's exact
    behaviour, or what comm_dtype / density say), "fp16", "bf16", "topk-fp16", "topk-3bit", "3bit",
    "3bit-precond", "2bit-precond" or "auto" (dense until the first optimizer step, then the recipe measured
    for it: :mod:`gradientflow.policy.auto_choice`); earlier names (``"csc"``, ``"cscq"``, ``"quantized"``,
    ``"q3p"``, ``"q2npw20"``) are accepted and stored as these.  The recipe sets its row's options; an option
    passed explicitly overrides them, but for those its name states (an error), and an option its mechanism does
    not read is an error (the rule: :mod:`gradientflow.recipes`).  [``fully_shard``: "auto"]"""
    density: float | None = None
    """CSC: the fraction of chunks sent each step; ``None`` = dense."""
    chunk_size: int | str = "auto"
    """CSC: gradients per chunk: an int, or "auto" (:func:`gradientflow.option_values.auto_chunk_size`;
    :meth:`gradientflow.config.GradientFlowConfig.resolved` replaces it)."""
    warmup_steps: int = 100
    """CSC: length of the density ramp: step t < warmup_steps sends ``density ** (t / warmup_steps)`` of the
    chunks (step 0 dense), later steps ``density``.  A ramp step whose chunks and scores would be no fewer
    bytes than a dense step is sent dense."""
    # The quantiser of the quantised recipes ("3bit" and its family, "topk-3bit"'s chunks).  None = the recipe's;
    # the config holds the values that run (None beside recipes that do not quantise).
    quant_bits: int | None = None
    """Bits per gradient: one of :data:`gradientflow.recipes.QUANT_BITS` (32 = the quantiser off: an fp32 ring
    with the same error feedback) [the recipe's: 3, or 2 for "2bit-precond"]."""
    quant_block: int | None = None
    """Gradients per scale (one bf16 scale each), a multiple of 16 [128]."""
    quant_levels: QuantLevels | None = None
    """The quantiser's levels: "fitted" (``comm.levels.CODEBOOKS``: non-uniform, with a zero), "uniform" (steps
    ``k / L`` of the scale) or "zeroless" (2 bits: four levels, no zero) [fitted; "2bit-precond": zeroless]."""
    quant_precondition: bool | None = None
    """Each coordinate quantised in units of its own RMS (:mod:`gradientflow.exchange.precondition`)
    [False; the "-precond" recipes: True]."""
    quant_warmup_steps: int | None = None
    """The first steps sent at 3 bits before the recipe's width [0; "2bit-precond": 20]."""
    quant_clip: float | None = None
    """Each block's scale clipped at this many times its RMS; 0 = max-abs (an experiment) [0.0]."""
    timeout: float | timedelta | None = None
    """Seconds (or a ``timedelta``) any wait may take before ``gradientflow.CommunicationError`` (naming the
    step, the collective and the missing ranks); ``None`` = the process group's timeout, at most 5 minutes where the
    waits include exchanges between nodes (``sync_every > 1``, nodes of several ranks, an FSDP mesh of several
    nodes: docs/multi-node.md, "A hung or lost host").  A wait past min(60 s, timeout / 2) is logged (WARNING)."""
