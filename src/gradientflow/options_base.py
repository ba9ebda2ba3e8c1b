"""What the per-step options (:mod:`gradientflow.config`) and the options of fewer syncs
(:mod:`gradientflow.outer_options`) are both built on: the dense wire dtypes by name, the quantiser that runs,
and the two checks both apply to a value.

It imports nothing of gradientflow and sits below both, so that the config can import the outer options'
validation without an import circle.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

# "fp32" is full precision: no cast, the gradient travels in its own dtype (fp32 for fp32
# parameters, fp64 for a float64 model, as torch DDP sends it).
COMM_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def did_you_mean(value: object, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped string, else ``""``."""
    close = difflib.get_close_matches(str(value).lower(), choices, n=1, cutoff=0.6) if isinstance(value, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def not_int(v: object) -> bool:
    """Whether ``v`` is not an int option's value (a ``bool`` is not one)."""
    return isinstance(v, bool) or not isinstance(v, int)


class Quantizer(NamedTuple):
    """The quantiser a quantising recipe runs (:meth:`gradientflow.config.GradientFlowConfig.quantizer`), and the
    quantised outer exchange's (:func:`gradientflow.outer_options.outer_exchange_of`)."""

    bits: int
    block: int
    levels: str
    precondition: bool
    warmup_steps: int
    clip: float


Setting = Sequence[object]
"""The values an advice offers for one option: the first, or any of the others (each must construct)."""


def advise(*alternatives: tuple[Mapping[str, Setting], Sequence[str]]) -> str:
    """What an option error advises, as one sentence a reader (and tests/test_advice.py) can apply: each
    alternative the options to pass, ``name=value`` in Python syntax (a choice among values as
    ``name='a' (or 'b', 'c')``), and the options to drop, ``drop a and b``; alternatives joined by ``, or``.

    ``advise(({"outer_compression": ["3bit"]}, ["compression"]), ({}, ["sync_every"]))`` is "Pass
    outer_compression='3bit' and drop compression, or drop sync_every."  Every alternative must construct with
    the other options as passed: the check that builds one works its values out (tests/test_advice.py walks them)."""
    parts = []
    for sets, drops in alternatives:
        shown = [
            f"{k}={values[0]!r}" + (f" (or {', '.join(map(repr, values[1:]))})" if len(values) > 1 else "")
            for k, values in sets.items()
        ]
        words = []
        if shown:
            words.append("pass " + ", ".join(shown))
        if drops:
            words.append(
                "drop " + (" and ".join(drops) if len(drops) < 3 else ", ".join(drops[:-1]) + " and " + drops[-1])
            )
        parts.append(" and ".join(words))
    text = ", or ".join(p for p in parts if p)
    return text[:1].upper() + text[1:] + "."
