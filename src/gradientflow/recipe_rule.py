"""How a value names a recipe of the table (:mod:`gradientflow.recipes`), and the rule for options passed beside it.

A ``compression`` value names a row (case and surrounding spaces ignored), an earlier name of one (its aliases), a
width of the quantised family, ``"<bits>bit"`` and ``"<bits>bit-precond"`` for ``bits`` in
:data:`~gradientflow.recipes.QUANT_BITS` (``"5bit"``, ``"32bit"`` = the quantiser off, an fp32 ring; a width without
a row takes the ``"3bit"`` row's other settings), or the experiments' quantiser shorthand (:func:`parse_shorthand`):
:func:`resolve`.

The rule for options passed beside a recipe (stated once, here; tested in tests/test_recipes.py), :func:`fold`:

1. The recipe sets the options of its row.
2. An option passed explicitly overrides the row's value, except one the recipe's *name* states
   (:attr:`~gradientflow.recipes.Recipe.named`: the wire dtype of ``"fp16"``, the width of ``"3bit"``, the
   preconditioning of ``"3bit-precond"``): passing another value is a ``ValueError`` naming the recipe that has it.
3. An option the recipe's mechanism does not read (``density`` beside a quantised recipe, ``quant_bits``
   beside ``"fp16"``, any of them beside ``"auto"``, which picks them) is a ``ValueError``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import recipes
from .mechanisms import options_of
from .options_base import advise
from .recipes import ALIASES, BY_NAME, QUANT_BITS, Recipe

FAMILY = re.compile(r"(\d+)bit(-precond)?")
"""The quantised family's names: ``"<bits>bit"`` / ``"<bits>bit-precond"``."""


def family_name(bits: int, precondition: bool) -> str:
    """The quantised family's name for a width and preconditioning: ``(3, True)`` -> ``"3bit-precond"``."""
    return f"{bits}bit" + ("-precond" if precondition else "")


@dataclass(frozen=True)
class Resolved:
    """A ``compression`` value read against the table: the row whose settings apply, the canonical name, and the
    options the value itself states (a family width, or the experiments' shorthand)."""

    recipe: Recipe
    name: str
    stated: dict[str, Any] = field(default_factory=dict)


class UnknownRecipe(ValueError):
    """A ``compression`` value that names no recipe."""


SHORTHAND = re.compile(r"q(\d+)(?:b(\d+))?([un])?(p)?(?:w(\d+))?(?:c(\d+(?:\.\d+)?))?")
"""The experiments' quantiser shorthand (kept as aliases: docs/recipes.md#aliases): ``q<bits>`` then optional
``b<block>``, ``u`` (uniform levels) or ``n`` (zeroless), ``p`` (preconditioned), ``w<steps>`` (warm-up steps at
3 bits), ``c<k>`` (each block's scale clipped at k x its RMS)."""


def parse_shorthand(value: str) -> dict[str, Any] | None:
    """The quantiser options a shorthand string states (``"q2npw20"`` -> 2 bits, zeroless, preconditioned, 20
    warm-up steps), or ``None`` when ``value`` is not of that form.  Values are checked by the config."""
    m = SHORTHAND.fullmatch(value)
    if m is None:
        return None
    out: dict[str, Any] = {"quant_bits": int(m[1]), "quant_precondition": m[4] is not None}
    if m[2]:
        out["quant_block"] = int(m[2])
    if m[3]:
        out["quant_levels"] = "uniform" if m[3] == "u" else "zeroless"
    if m[5]:
        out["quant_warmup_steps"] = int(m[5])
    if m[6]:
        out["quant_clip"] = float(m[6])
    return out


def resolve(value: object) -> Resolved:
    """The recipe a ``compression`` value names (case and surrounding spaces ignored): a row's name, an alias,
    a quantised family name, or the experiments' shorthand; :class:`UnknownRecipe` otherwise."""
    key = value.strip().lower() if isinstance(value, str) else value
    if not isinstance(key, str):
        raise UnknownRecipe(f"compression must be a recipe's name (a str), got {value!r}")
    key = ALIASES.get(key, key)
    if key in BY_NAME:
        return Resolved(BY_NAME[key], key)
    m = FAMILY.fullmatch(key)
    stated = None
    if m is not None:
        stated = {"quant_bits": int(m[1]), "quant_precondition": m[2] is not None}
    else:
        stated = parse_shorthand(key)
    if stated is None or stated["quant_bits"] not in QUANT_BITS:
        raise UnknownRecipe(value)
    name = family_name(int(stated["quant_bits"]), bool(stated["quant_precondition"]))
    # a family name takes its row's settings where it has one; the shorthand states all it means over 3bit's
    # ("q2np" is 2 bits with 3bit's levels and no warm-up, not "2bit-precond"'s zeroless levels and 20 steps)
    row = BY_NAME.get(name, BY_NAME["3bit"]) if m is not None else BY_NAME["3bit"]
    return Resolved(row, name, stated)


def fold(found: Resolved, passed: Mapping[str, Any], fits: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """The rule of this module's docstring: the options that run for ``found`` given those ``passed``
    explicitly; a ``ValueError`` for every option the name states passed with another value (clause 2) and every
    option the recipe's mechanism does not read (clause 3), advising to drop them or (``fits``: whether a recipe,
    by name, runs with ``passed``) to pass a recipe that runs with them."""
    recipe, name = found.recipe, found.name
    base = {**recipe.settings(), **found.stated}
    named = set(recipe.named) | set(found.stated)  # a family name or the shorthand states its width itself
    reads = set(options_of(recipe.mechanism)) | ({"density"} if name == "none" else set())
    unread = [k for k in passed if k not in reads]
    clash = [k for k in passed if k in reads and k in named and k in base and passed[k] != base[k]]
    if unread or clash:
        raise ValueError(_refusal(found, passed, unread, clash, fits))
    return {**base, **passed}


def runs_with(passed: Mapping[str, Any], fits: Callable[[str], bool] | None, but: str = "") -> list[str]:
    """The recipes (by name) that run with the options ``passed``: the quantised family's width they state first,
    then the per-step rows; none where ``fits`` is None."""
    if fits is None:
        return []
    names = []
    bits = passed.get("quant_bits")
    if isinstance(bits, int) and not isinstance(bits, bool) and bits in QUANT_BITS:
        names.append(family_name(bits, passed.get("quant_precondition") is True))
    names += [n for n in recipes.PER_STEP_NAMES if n not in names]
    return [n for n in names if n != but and fits(n)]


_WHY = {"density": "sends every coordinate (no top-k)", "comm_dtype": "puts its own codes on the wire"}
"""Clause 3: what a recipe does instead of reading an option (a quantiser option: it does not quantise)."""


def _refusal(
    found: Resolved, passed: Mapping[str, Any], unread: list[str], clash: list[str], fits: Callable[[str], bool] | None
) -> str:
    """Clauses 2 and 3's message: what the recipe does instead, then :func:`advise`: drop the options, or pass a
    recipe that runs with all of them."""
    name, base = found.name, {**found.recipe.settings(), **found.stated}
    said = []
    if unread:
        values = ", ".join(f"{k}={passed[k]!r}" for k in unread)
        if found.recipe.mechanism == "auto":
            said.append(
                f"compression='auto' picks {' and '.join(unread)} itself (by the optimizer, at its first step), but "
                f"{values} {'was' if len(unread) == 1 else 'were'} passed too."
            )
        else:
            why = dict.fromkeys(_WHY.get(k, "does not quantise") for k in unread)
            verb = "has" if len(unread) == 1 else "have"
            said.append(f"compression={name!r} {' and '.join(why)}, so {values} {verb} no effect there.")
    for k in clash:
        said.append(f"compression={name!r} is {k}={base[k]!r} by its name, but {k}={passed[k]!r} was passed too.")
    others = runs_with(passed, fits, but=name)
    alternatives: list[tuple[dict[str, Any], list[str]]] = [({}, [*unread, *clash])]
    if others:
        alternatives.append(({"compression": others}, []))
    return " ".join(said) + " " + advise(*alternatives)
