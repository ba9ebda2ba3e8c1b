"""The one table of compression recipes: what each name puts on the wire, when to use it, what it sets.

A recipe is a named bundle of the wrapper's options (``compression="3bit"`` sets ``quant_bits=3``,
``quant_block=128``, ...).  Every place that names recipes reads this table: the options' validation
(:mod:`gradientflow.config`), ``compression="auto"``'s policy (:mod:`gradientflow.policy`), the bench's modes,
``gradientflow simulate`` and the docs' table (docs/recipes.md, checked against :func:`markdown_table`).
Adding a recipe of an existing mechanism is one row here; a new mechanism is declared in
:mod:`gradientflow.mechanisms`, with a form for each door it serves.

How a value names a row (its aliases, the quantised family's widths, the experiments' shorthand) and the rule for
options passed beside a recipe are :mod:`gradientflow.recipe_rule`'s.  A row is a recipe with a measured use (its
section of docs/recipes.md).

This module imports only :mod:`gradientflow.mechanisms`: it is data, at the bottom of the layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .mechanisms import MECHANISMS, QUANT_OPTIONS, options_of

Mechanism = str
"""What a recipe's exchange does with a tensor: a name declared in :mod:`gradientflow.mechanisms`, which says what
each one does, the options it reads and the doors it has a form for (``"dense"``, ``"topk"``, ``"quantized"``,
``"topk-quantized"``, ``"indexed-topk"``, ``"auto"``)."""

Scope = Literal["per step", "outer"]
"""Where a recipe runs: ``"per step"``, the exchange of every synchronised step (``compression=``: the DDP wrapper,
``gradientflow.fsdp.fully_shard``); ``"outer"``, the exchange of fewer syncs' outer loop every ``sync_every``
steps (``outer_compression=``)."""

QUANT_BITS = (2, 3, 4, 5, 6, 7, 8, 32)
"""The quantiser's widths: 2 = ternary {-s, 0, s} (or four levels with ``quant_levels="zeroless"``), 3 = 7
levels, 32 = the quantiser off (fp32 on the same ring, with the same error feedback: an exact average)."""

QUANT_DEFAULTS: Mapping[str, Any] = {
    "quant_bits": 3,
    "quant_block": 128,
    "quant_levels": "fitted",
    "quant_precondition": False,
    "quant_warmup_steps": 0,
    "quant_clip": 0.0,
}
"""The quantiser of ``"3bit"`` (3 bits in 128-element blocks, each with a bf16 scale: 0.0977 of fp32's bytes),
and of every width of the family without a row of its own."""

assert tuple(QUANT_DEFAULTS) == QUANT_OPTIONS, "the quantiser's options, declared in gradientflow.mechanisms"


@dataclass(frozen=True)
class Recipe:
    """One row of the table."""

    name: str
    """What goes on the wire, in words (lower case, ASCII)."""
    mechanism: Mechanism
    summary: str
    """One line: what is sent each step."""
    when: str
    """One line: the training it is for."""
    options: Mapping[str, Any]
    """The options it sets (rule 2: an explicit keyword overrides all but :attr:`named`)."""
    named: tuple[str, ...] = ()
    """The options its name states: fixed (rule 2)."""
    doc: str = "docs/recipes.md"
    """Where it is explained, with what was measured (dated in docs/results/)."""
    aliases: tuple[str, ...] = ()
    """Earlier names, still accepted: each means exactly this row."""
    scopes: tuple[Scope, ...] = ("per step",)
    """Where it runs (:data:`Scope`): ``compression=`` takes the rows with ``"per step"``, ``outer_compression=``
    those with ``"outer"``."""
    outer_aliases: tuple[str, ...] = ()
    """Earlier names ``outer_compression=`` still accepts for this row (never a name of another row)."""

    def settings(self) -> dict[str, Any]:
        """Every option the recipe's mechanism reads, at this recipe's values (the quantiser's defaults filled
        in for the quantised mechanisms)."""
        quant = {k: v for k, v in QUANT_DEFAULTS.items() if k in options_of(self.mechanism)}
        return {**quant, **self.options}


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        name="none",
        mechanism="dense",
        summary="every gradient in comm_dtype (fp32 by default: torch DDP's exact bytes); the options as you pass them",
        when="a fast network, or the final loss must be DDP's to the digit",
        options={},
        doc="docs/recipes.md#none",
        scopes=("per step", "outer"),
    ),
    Recipe(
        name="fp16",
        mechanism="dense",
        summary="every gradient cast to fp16: half of DDP's bytes",
        when="AdamW whose final loss must equal DDP's, on a network twice too slow",
        options={"comm_dtype": "fp16"},
        named=("comm_dtype",),
        doc="docs/recipes.md#fp16-and-bf16",
        scopes=("per step", "outer"),
    ),
    Recipe(
        name="bf16",
        mechanism="dense",
        summary="every gradient cast to bf16: half of DDP's bytes, the fastest dense wire on Gloo (CPU)",
        when="CPU ranks on a fast network",
        options={"comm_dtype": "bf16"},
        named=("comm_dtype",),
        doc="docs/recipes.md#fp16-and-bf16",
        scopes=("per step", "outer"),
    ),
    Recipe(
        name="topk-fp16",
        mechanism="topk",
        summary="the top 10% of the gradient's chunks by L1 in fp16, the rest kept in a residual (the paper's CSC)",
        when="SGD with momentum where the CPU, not the link, bounds the step",
        options={"comm_dtype": "fp16", "density": 0.1},
        named=("comm_dtype",),
        doc="docs/recipes.md#topk-fp16",
        aliases=("csc",),
    ),
    Recipe(
        name="topk-3bit",
        mechanism="topk-quantized",
        summary="the top 30% of the chunks, in 3-bit blocks of 128 with a bf16 scale, error kept",
        when="SGD with momentum on a slow network (what auto picks for SGD under the DDP wrapper)",
        options={"density": 0.3},
        named=("quant_bits",),
        doc="docs/recipes.md#topk-3bit",
        aliases=("cscq",),
    ),
    Recipe(
        name="3bit",
        mechanism="quantized",
        summary="every gradient every step in 3-bit blocks of 128 with a bf16 scale, error feedback",
        when="Adam or AdamW on a slow network, 2 ranks or 2 nodes (what auto picks there)",
        options={},
        named=("quant_bits", "quant_precondition"),
        doc="docs/recipes.md#3bit",
        aliases=("quantized", "quantised"),
        scopes=("per step", "outer"),
    ),
    Recipe(
        name="3bit-precond",
        mechanism="quantized",
        summary="3bit, each coordinate quantised in units of its own RMS (its share of the block's noise spread)",
        when="Adam or AdamW on a slow network, more than two flat ranks or nodes (what auto picks there)",
        options={"quant_precondition": True},
        named=("quant_bits", "quant_precondition"),
        doc="docs/recipes.md#3bit-precond",
        aliases=("q3p",),
    ),
    Recipe(
        name="2bit-precond",
        mechanism="quantized",
        summary="every gradient in four zeroless 2-bit levels, preconditioned; the first 20 steps at 3 bits",
        when="Adam or AdamW, 2 ranks or 2 nodes, a link slow enough to hold 3-bit steps back",
        options={"quant_bits": 2, "quant_levels": "zeroless", "quant_precondition": True, "quant_warmup_steps": 20},
        named=("quant_bits", "quant_precondition"),
        doc="docs/recipes.md#2bit-precond",
        aliases=("q2npw20",),
    ),
    Recipe(
        name="4bit",
        mechanism="quantized",
        summary="every gradient every step in 4-bit blocks of 128 with a bf16 scale, error feedback",
        when="SGD with momentum under gradientflow.fsdp, between nodes (what auto picks there)",
        options={"quant_bits": 4},
        named=("quant_bits", "quant_precondition"),
        doc="docs/recipes.md#4bit",
        scopes=("per step", "outer"),
    ),
    Recipe(
        name="indexed-topk-2bit",
        mechanism="indexed-topk",
        summary="each replica's own top 10% of the pseudo-gradient's 128-element chunks with their indices, in four "
        "zeroless 2-bit levels; what it did not send stays in its parameters",
        when="fewer syncs on the slowest links, where even 0.001 of DDP's bytes is too much",
        options={"quant_bits": 2, "quant_levels": "zeroless"},
        named=("quant_bits",),
        doc="docs/recipes.md#indexed-topk-2bit-and-indexed-topk-3bit",
        scopes=("outer",),
        outer_aliases=("topk-2bit",),
    ),
    Recipe(
        name="indexed-topk-3bit",
        mechanism="indexed-topk",
        summary="indexed-topk-2bit in the quantised family's fitted 3-bit levels",
        when="fewer syncs on the slowest links, a finer wire than indexed-topk-2bit",
        options={"quant_bits": 3},
        named=("quant_bits",),
        doc="docs/recipes.md#indexed-topk-2bit-and-indexed-topk-3bit",
        scopes=("outer",),
        outer_aliases=("topk-3bit",),
    ),
    Recipe(
        name="auto",
        mechanism="auto",
        summary=(
            "dense fp32 until the first optimizer step, then by its class: SGD topk-3bit (4bit under FSDP), "
            "Adam-type 3bit family"
        ),
        when="the default to reach for: the measured choice per optimizer, layout and link",
        options={},
        doc="docs/recipes.md#auto",
    ),
)
"""Every recipe, in the order the docs list them."""

BY_NAME: dict[str, Recipe] = {r.name: r for r in RECIPES}
ALIASES: dict[str, str] = {a: r.name for r in RECIPES for a in r.aliases}
"""Earlier names -> the recipe they mean (besides the experiments' quantiser shorthand, :func:`parse_shorthand`)."""
NAMES: tuple[str, ...] = tuple(BY_NAME)
PER_STEP_NAMES: tuple[str, ...] = tuple(r.name for r in RECIPES if "per step" in r.scopes)
"""The rows ``compression=`` takes."""
OUTER_NAMES: tuple[str, ...] = tuple(r.name for r in RECIPES if "outer" in r.scopes)
"""The rows ``outer_compression=`` takes (besides the quantised family's other widths)."""
OUTER_ALIASES: dict[str, str] = {a: r.name for r in RECIPES for a in r.outer_aliases}
"""Earlier names of the outer rows -> the row (``outer_compression=`` only)."""


def add_row(recipe: Recipe) -> Recipe:
    """A row added to the table in this process (a new recipe of a declared mechanism, :func:`gradientflow.mechanisms
    .declare`: in a test, an experiment, or before the row is shipped): from then on ``compression=`` /
    ``outer_compression=`` resolve its name by the same rules as the shipped rows, and what is read from the table
    after this call (:data:`RECIPES`, the name tuples, the bench's and the cost model's modes, :func:`markdown_table`)
    has it.  A name already taken is a ``ValueError``."""
    global RECIPES, NAMES, PER_STEP_NAMES, OUTER_NAMES
    if recipe.mechanism not in MECHANISMS:
        raise ValueError(
            f"recipe {recipe.name!r}: declare its mechanism {recipe.mechanism!r} first (mechanisms.declare)"
        )
    taken = {*BY_NAME, *ALIASES, *OUTER_ALIASES} & {recipe.name, *recipe.aliases, *recipe.outer_aliases}
    if taken:
        raise ValueError(f"recipe {recipe.name!r}: the names {sorted(taken)} are taken")
    BY_NAME[recipe.name] = recipe
    ALIASES.update({a: recipe.name for a in recipe.aliases})
    OUTER_ALIASES.update({a: recipe.name for a in recipe.outer_aliases})
    RECIPES = (*RECIPES, recipe)
    NAMES = (*NAMES, recipe.name)
    if "per step" in recipe.scopes:
        PER_STEP_NAMES = (*PER_STEP_NAMES, recipe.name)
    if "outer" in recipe.scopes:
        OUTER_NAMES = (*OUTER_NAMES, recipe.name)
    return recipe


def markdown_table() -> str:
    """The table as docs/recipes.md shows it (the docs test compares the page with this).  "scope": ``per step``
    rows are what ``compression=`` takes, ``outer`` rows what ``outer_compression=`` takes; "sets": the row's own
    options; the quantised recipes also run :data:`QUANT_DEFAULTS` where their row says nothing."""
    lines = [
        "| name | scope | what goes on the wire | use it for | sets | earlier names |",
        "|---|---|---|---|---|---|",
    ]
    for r in RECIPES:
        sets = ", ".join(f"`{k}={_shown(v)}`" for k, v in r.options.items()) or "—"
        aliases = [f'`"{a}"`' for a in r.aliases] + [f'`"{a}"` (outer)' for a in r.outer_aliases]
        scope = ", ".join(r.scopes)
        lines.append(f'| `"{r.name}"` | {scope} | {r.summary} | {r.when} | {sets} | {", ".join(aliases) or "—"} |')
    return "\n".join(lines)


def _shown(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)
