"""The mechanisms, each declared once: the options it reads, the doors it has a form for, and those forms.

A *mechanism* is what a recipe's exchange does with a tensor (``"quantized"``: every coordinate in a few bits with
error feedback; ``"topk"``: the top chunks, the rest kept; ...).  A *door* is a place a user reaches it through:

====================  ==============================================================================================
door                  what its form builds
====================  ==============================================================================================
``"ddp"``             the DDP wrapper's synchronisation strategy for the pool's buckets (``gradientflow.strategies``)
``"fsdp"``            ``gradientflow.fsdp.fully_shard``'s exchange of a module's gradient shard between nodes
``"outer"``           the outer exchange of fewer syncs (``sync_every=H``, ``outer_compression=``): a fragment's
                      pseudo-gradient averaged over the replicas (``gradientflow.outer``)
``"sim"``             the cost model's technique (``gradientflow simulate``)
====================  ==============================================================================================

Each mechanism is declared here, as data (:func:`declare`: its name, the recipe options it reads, the doors it has a
form for); each door's form is registered by the door's own package (:func:`form`, a decorator), so that nothing
low imports something high.  The doors look their forms up here (:func:`builder`), never by comparing strings, and
validation refuses a recipe at a door its mechanism declares no form for, in this module's words
(:func:`check_door`), before anything is built.  A new mechanism is one :func:`declare` and one :func:`form` per
door it serves: the recipe table (:mod:`gradientflow.recipes`) names it in a row.

This module imports nothing of gradientflow: it is data and a lookup, at the bottom of the layers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

DOORS: Mapping[str, str] = {
    "ddp": "the DDP wrapper's exchange every step (gradientflow.DistributedDataParallel)",
    "fsdp": "gradientflow.fsdp.fully_shard's exchange between nodes",
    "outer": "the outer exchange of sync_every (outer_compression=...)",
    "sim": "the cost model (gradientflow simulate)",
}
"""Every door, in the words an error uses."""


@dataclass(frozen=True)
class Mechanism:
    """One mechanism, as declared."""

    name: str
    summary: str
    """One line: what it does with a tensor."""
    options: tuple[str, ...]
    """The recipe options it reads (passing another beside one of its recipes is a ``ValueError``,
    :func:`gradientflow.recipe_rule.fold`'s third clause)."""
    doors: frozenset[str]
    """The doors it has a form for (:data:`DOORS`)."""


class NoForm(ValueError):
    """A recipe passed to a door its mechanism has no form for."""


MECHANISMS: dict[str, Mechanism] = {}
"""Every declared mechanism by name."""
_FORMS: dict[tuple[str, str], Any] = {}

F = TypeVar("F")


def declare(mechanism: Mechanism) -> Mechanism:
    """Declare ``mechanism`` (once per name; declaring the same again is a no-op, another under a taken name an
    error)."""
    unknown = set(mechanism.doors) - set(DOORS)
    if unknown:
        raise ValueError(f"mechanism {mechanism.name!r} declares unknown doors {sorted(unknown)}; doors: {list(DOORS)}")
    known = MECHANISMS.get(mechanism.name)
    if known is not None and known != mechanism:
        raise ValueError(f"mechanism {mechanism.name!r} is declared already, differently")
    MECHANISMS[mechanism.name] = mechanism
    return mechanism


def form(mechanism: str, door: str) -> Callable[[F], F]:
    """Register the decorated builder as ``mechanism``'s form at ``door`` (what the builder takes and returns is
    the door's contract, documented where the door looks it up)."""
    declared = MECHANISMS.get(mechanism)
    if declared is None or door not in declared.doors:
        raise ValueError(f"mechanism {mechanism!r} declares no form for the door {door!r}: declare it first")

    def register(builder: F) -> F:
        _FORMS[(mechanism, door)] = builder
        return builder

    return register


def doors_of(mechanism: str) -> frozenset[str]:
    """The doors ``mechanism`` has a form for."""
    declared = MECHANISMS.get(mechanism)
    return declared.doors if declared is not None else frozenset()


def options_of(mechanism: str) -> tuple[str, ...]:
    """The recipe options ``mechanism`` reads."""
    return MECHANISMS[mechanism].options


def refusal(mechanism: str, door: str, what: str, advice: str | None = None) -> str:
    """Why ``what`` (a recipe, as the user passed it) cannot run at ``door``, where it can, and ``advice`` (what to
    pass instead, in :func:`gradientflow.options_base.advise`'s words, where the caller knows it)."""
    doors = sorted(doors_of(mechanism))
    where = "; ".join(DOORS[d] for d in doors) or "no door"
    return (
        f"{what} runs the mechanism {mechanism!r}, which has no form for {DOORS[door]}: it is built for {where}. "
        + (advice or "Pass a recipe built for this door (docs/recipes.md lists each recipe's scope).")
    )


def check_door(mechanism: str, door: str, what: str, advice: str | None = None) -> None:
    """``NoForm`` (a ``ValueError``, in :func:`refusal`'s words) unless ``mechanism`` declares a form for ``door``."""
    if door not in doors_of(mechanism):
        raise NoForm(refusal(mechanism, door, what, advice))


def builder(mechanism: str, door: str) -> Any:
    """``mechanism``'s form at ``door``: ``NoForm`` where it declares none; a ``LookupError`` where it declares one
    that no imported module registered (the door's package registers its forms when it is imported)."""
    check_door(mechanism, door, f"mechanism {mechanism!r}")
    try:
        return _FORMS[(mechanism, door)]
    except KeyError:
        raise LookupError(
            f"mechanism {mechanism!r} declares a form for the door {door!r} but none is registered: import the "
            "module that registers it"
        ) from None


QUANT_OPTIONS = ("quant_bits", "quant_block", "quant_levels", "quant_precondition", "quant_warmup_steps", "quant_clip")
"""The quantiser's keyword options."""

ALL_DOORS = frozenset(DOORS)
PER_STEP = frozenset({"ddp", "fsdp", "sim"})

DENSE = declare(Mechanism("dense", "every coordinate, averaged, in comm_dtype", ("comm_dtype",), ALL_DOORS))
TOPK = declare(
    Mechanism(
        "topk",
        "the top chunks by score, agreed across ranks, in comm_dtype; the rest kept in a residual (CSC)",
        ("comm_dtype", "density"),
        PER_STEP,
    )
)
QUANTIZED = declare(
    Mechanism("quantized", "every coordinate in quant_bits-bit blocks with error feedback", QUANT_OPTIONS, ALL_DOORS)
)
TOPK_QUANTIZED = declare(
    Mechanism(
        "topk-quantized",
        "the top chunks by score, agreed across ranks, in few-bit blocks; what was not sent kept in a residual",
        ("density", "quant_bits", "quant_block", "quant_levels"),
        PER_STEP,
    )
)
INDEXED_TOPK = declare(
    Mechanism(
        "indexed-topk",
        "each party's own top chunks with their indices, in few-bit blocks, all-gathered; the rest kept by the party",
        ("density", "quant_bits"),
        frozenset({"outer"}),
    )
)
AUTO = declare(
    Mechanism(
        "auto",
        "dense fp32 until the first optimizer step, then a recipe picked for the optimizer",
        (),
        PER_STEP,
    )
)
