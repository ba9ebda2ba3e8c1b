"""Argument types of the subcommands: each parses one option's text or raises a one-line
``argparse.ArgumentTypeError`` saying what was expected.  Where an option is a wrapper option
(``--density``, ``--comm-dtype``), the library itself validates it, so the command accepts exactly
the values ``gradientflow.DistributedDataParallel`` accepts, with the same meaning and message."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any

WORKLOAD_CHOICES = ("resnet50", "alexnet", "small_cnn", "tiny_transformer")


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``, with a one-line error otherwise."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
        return v

    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def float_in(ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """An argparse type: a number for which ``ok`` holds (``what`` says which), with a one-line error otherwise."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return v

    return parse


nonneg_float = float_in(lambda v: v >= 0, "a number >= 0")
positive_float = float_in(lambda v: 0 < v < float("inf"), "a finite number > 0")
beta = float_in(lambda v: 0 <= v < 1, "a number in [0, 1)")
"""An Adam beta."""


def _wrapper_option(name: str, value: Any) -> Any:
    """``value`` if ``GradientFlowConfig`` accepts it for option ``name``, else its ValueError as the
    argparse error (the library's own message)."""
    from gradientflow.config import GradientFlowConfig

    try:
        GradientFlowConfig(**{name: value})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def density(text: str) -> float | None:
    """``--density``: ``none`` (dense) or a number in (0, 1], as the library's ``density=``."""
    if text.strip().lower() == "none":
        return None
    value: Any = text  # not a number: the library says what it expects
    for number in (int, float):
        try:
            value = number(text)
            break
        except ValueError:
            pass
    return _wrapper_option("density", value)


def compression(text: str) -> str:
    """``--compression``: a recipe's name (docs/recipes.md), as the library's ``compression=``."""
    return _wrapper_option("compression", text)


def comm_dtype(text: str) -> str:
    """``--comm-dtype``: fp32, fp16, bf16 or half, as the library's ``comm_dtype=``."""
    return _wrapper_option("comm_dtype", text)


def bandwidth(text: str) -> str:
    from gradientflow.bench.cluster import parse_rate

    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (e.g. 1gbit, 10gbit, none)") from None
    return text.strip().lower()


def links(text: str) -> list[str]:
    from gradientflow.bench.links import parse_links

    try:
        return [p.name for p in parse_links(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def prefix(text: str) -> str:
    if not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9]{0,9}", text):
        raise argparse.ArgumentTypeError(f"expected 1-10 letters/digits starting with a letter, got {text!r}")
    return text


def size(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip().lower())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"expected D_MODELxLAYERS, e.g. 128x2, got {text!r}")
    d, layers = int(m.group(1)), int(m.group(2))
    if d % 32 and d > 32:
        raise argparse.ArgumentTypeError(f"d_model must be at most 32 or a multiple of 32 (heads of 32), got {d}")
    return d, layers


def workload(text: str) -> str:
    """A built-in model, or the user's ``package.module:factory`` (imported here, so a typo fails now)."""
    if text in WORKLOAD_CHOICES:
        return text
    if ":" not in text:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(WORKLOAD_CHOICES)} or your model as package.module:factory, got {text!r}"
        )
    from gradientflow.bench.models import resolve_model

    try:
        resolve_model(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--model", "--workload")) from None
    return text


def bench_mode(text: str) -> str:
    """A mode of ``gradientflow bench``, gradientflow's optionally with ``:OPTION=VALUE,...`` and ``@flat`` /
    ``@auto`` / ``@MxG``; a name from before the recipe table as the table spells it (one line on stderr)."""
    from gradientflow.bench.mode_names import canonical_mode
    from gradientflow.bench.runner_spec import split_mode

    try:
        split_mode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    mode = canonical_mode(text)
    if mode != text:
        print(f"gradientflow bench: mode {text} runs as {mode} (the recipe table's name)", file=sys.stderr)
    return mode


def recipe(text: str) -> str:
    from gradientflow.bench.quality_recipes import parse_recipe

    try:
        parse_recipe(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
