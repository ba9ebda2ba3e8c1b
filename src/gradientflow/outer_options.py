"""The options of fewer syncs (``sync_every > 1``, DiLoCo's outer loop; docs/fewer-syncs.md): their names and
defaults, their validation, and the outer exchange an ``outer_compression`` value names.

The options themselves are fields of :class:`gradientflow.config.GradientFlowConfig`, each documented under its
field there; the config validates them at construction through :func:`settle_outer`, passing what it reads, and
holds the values it returns (this module imports nothing of the config: the config imports it).  The outer loop
that runs them is :mod:`gradientflow.outer`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .mechanisms import check_door, options_of
from .options_base import COMM_DTYPES, Quantizer, did_you_mean, not_int
from .recipe_rule import UnknownRecipe, resolve
from .recipes import OUTER_ALIASES, OUTER_NAMES

OUTER_OPTIONS = (
    "outer_lr", "outer_momentum", "outer_compression", "outer_density", "sync_fragments", "sync_delay",
    "outer_state_device",
)  # fmt: skip
"""The options beside ``sync_every`` (:func:`settle_outer`, called by
:meth:`gradientflow.config.GradientFlowConfig._validate_outer`)."""
OUTER_DEFAULTS: dict[str, Any] = {
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "outer_compression": "3bit",
    "outer_density": None,  # the top-k exchanges' TOPK_DENSITY; no other exchange reads it
    "sync_fragments": 1,
    "sync_delay": 0,
    "outer_state_device": "same",
}
"""The replicas' parameters averaged (outer lr 1, no momentum) through the 3-bit exchange with error feedback: on the
AdamW transformer, 2 replicas, 4,000 steps, H = 100, averaging ended 0.975x DDP's final loss where DiLoCo's outer
optimizer (arXiv 2311.08105: Nesterov, lr 0.7, momentum 0.9) ended 1.020x, and the 3-bit exchange matched fp32 on a
tenth of its bytes (docs/results/fewer-syncs.md).  DiLoCo's values stay one option away."""

TOPK_DENSITY = 0.1
"""The share of the chunks a top-k outer exchange sends where ``outer_density`` is not given."""
TOPK_CHUNK = 128
"""A top-k outer exchange's chunk: one quantiser block (its scale), the unit selected and sent with its index."""


class OuterExchange(NamedTuple):
    """What the outer exchange of the pseudo-gradient sends (:func:`outer_exchange_of`)."""

    name: str
    """The recipe's canonical name."""
    mechanism: str
    """Its mechanism (:mod:`gradientflow.mechanisms`), whose ``"outer"`` form runs it."""
    wire_dtype: torch.dtype | None
    """The wire dtype of a row that sets ``comm_dtype`` (None: fp32, or no such option)."""
    quantizer: Quantizer | None
    """The quantiser of a row that quantises (error feedback across outer syncs; the top-k exchange's blocks), or
    None."""
    density: float | None = None
    """The share of chunks sent (:data:`TOPK_CHUNK` elements each) by a mechanism that reads ``density``; None:
    every coordinate."""


def _ok() -> str:
    names = ", ".join(repr(n) for n in OUTER_NAMES)
    return f"a recipe whose scope is 'outer': {names}, or another width of the quantised family ('4bit', '2bit', ...)"


def outer_exchange_of(value: object, density: float | None = None) -> OuterExchange:
    """The outer exchange an ``outer_compression`` value names: a row of the recipe table whose scope is
    ``"outer"`` (an earlier outer name too), or a width of the quantised family without preconditioning; the top-k
    exchange at ``density`` (:data:`TOPK_DENSITY` where None); ``ValueError`` saying what to pass otherwise (in the
    words of :mod:`gradientflow.mechanisms` where the mechanism has no outer form)."""
    key = value.strip().lower() if isinstance(value, str) else value
    key = OUTER_ALIASES.get(key, key) if isinstance(key, str) else key
    try:
        found = resolve(key)
    except UnknownRecipe:
        raise ValueError(
            f"outer_compression must be {_ok()}, got {value!r}{did_you_mean(value, [*OUTER_NAMES, *OUTER_ALIASES])}"
        ) from None
    recipe, settings = found.recipe, {**found.recipe.settings(), **found.stated}
    what = f"outer_compression={value!r}"
    check_door(recipe.mechanism, "outer", what)
    if "outer" not in recipe.scopes or settings.get("quant_precondition"):
        raise ValueError(
            f"{what} is a per-step recipe (preconditioning and 'auto' read the gradient of every step): pass {_ok()}."
        )
    quantizer = None
    if "quant_bits" in settings:
        bits = int(settings["quant_bits"])
        levels = str(settings.get("quant_levels", "fitted"))
        quantizer = Quantizer(bits, int(settings.get("quant_block", TOPK_CHUNK)), levels, False, 0, 0.0)
    wire = COMM_DTYPES[settings["comm_dtype"]] if "comm_dtype" in settings else None
    reads_density = "density" in options_of(recipe.mechanism)
    share = (TOPK_DENSITY if density is None else float(density)) if reads_density else None
    return OuterExchange(found.name, recipe.mechanism, wire, quantizer, share)


def settle_outer(
    sync_every: int,
    outer: Mapping[str, Any],
    *,
    compression: str,
    comm_dtype: str,
    topology: str,
    mechanism: str,
) -> dict[str, Any]:
    """``sync_every`` and the outer options (docs/fewer-syncs.md): each checked, the defaults filled in where
    ``sync_every > 1``, and an outer option at ``sync_every=1`` (where it would do nothing) refused.

    ``outer``: the outer options as passed (:data:`OUTER_OPTIONS`, None where not given); ``compression``,
    ``comm_dtype``, ``topology`` and ``mechanism``: the config's per-step options as resolved, which an outer
    exchange would leave without effect.  Returns the values the config holds: every outer option where
    ``sync_every > 1`` (``outer_compression`` by its canonical name, the outer lr and momentum as floats,
    ``outer_state_device`` None for the parameters' device), nothing at ``sync_every=1``; ``ValueError`` saying
    what to do otherwise."""
    h = sync_every
    if not_int(h) or h < 1:
        raise ValueError(
            f"sync_every must be an int >= 1 (optimizer steps between syncs of the replicas; 1 = every step), got {h!r}"
        )
    if h == 1:
        given = [k for k, v in outer.items() if v is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(
                f"{', '.join(given)} {verb} only with sync_every > 1 (the outer optimizer of DiLoCo), but "
                f"sync_every=1. Pass sync_every=H (e.g. 30) too, or drop {', '.join(given)}."
            )
        return {}
    settled = {k: OUTER_DEFAULTS[k] if v is None else v for k, v in outer.items()}
    lr, mom, frags = settled["outer_lr"], settled["outer_momentum"], settled["sync_fragments"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise ValueError(f"outer_lr must be a number > 0 (1.0: averaging; DiLoCo's: 0.7), got {lr!r}")
    if isinstance(mom, bool) or not isinstance(mom, (int, float)) or not 0 <= mom < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1) (Nesterov; 0: none; DiLoCo's: 0.9), got {mom!r}")
    if not_int(frags) or not 1 <= frags <= h:
        raise ValueError(
            f"sync_fragments must be an int in [1, sync_every] (fragments synchronised in turn, at most one per "
            f"step), got {frags!r} at sync_every={h}"
        )
    delay = settled["sync_delay"]
    if not_int(delay) or not 0 <= delay <= h // frags:
        raise ValueError(
            f"sync_delay must be an int in [0, sync_every // sync_fragments] = [0, {h // frags}] (inner steps an "
            f"outer exchange overlaps before it is merged, one exchange in flight at a time), got {delay!r}"
        )
    device = settled["outer_state_device"]
    if device not in ("cpu", "same"):
        raise ValueError(
            f"outer_state_device must be None (the parameters' device) or 'cpu' (host memory), got {device!r}"
        )
    density = settled["outer_density"]
    spec = outer_exchange_of(settled["outer_compression"])
    if spec.density is None and density is not None:
        raise ValueError(
            f"outer_density applies only to a top-k outer exchange, but outer_compression={spec.name!r} sends every "
            f"coordinate. Pass outer_compression='indexed-topk-2bit' (or 'indexed-topk-3bit') with it, or drop "
            "outer_density."
        )
    if spec.density is not None:
        d = TOPK_DENSITY if density is None else density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(
                f"outer_density must be a number in (0, 1] (the share of the pseudo-gradient's chunks a top-k outer "
                f"exchange sends; default {TOPK_DENSITY}), got {density!r}"
            )
        settled["outer_density"] = float(d)
    settled["outer_compression"] = spec.name
    settled["outer_lr"], settled["outer_momentum"] = float(lr), float(mom)
    per_step = compression != "none" or comm_dtype != "fp32"
    if topology == "flat" and per_step:
        raise ValueError(
            f"sync_every={h} on a flat layout exchanges no gradient between steps, so compression="
            f"{compression!r} (comm_dtype={comm_dtype!r}) has no effect. Pass outer_compression=... "
            "for the exchange every sync_every steps, and drop compression / comm_dtype."
        )
    if mechanism != "dense" and per_step:
        try:  # the advice must itself construct: the same name as the outer exchange only where it is one
            outer_exchange_of(compression)
            instead = f"outer_compression={compression!r}"
        except ValueError:
            instead = f"outer_compression= ({_ok()})"
        raise ValueError(
            f"sync_every={h}: gradients are averaged densely inside a node every step and only the outer "
            f"exchange crosses nodes, so compression={compression!r} cannot apply. Pass {instead} for the exchange "
            "between nodes, and drop compression."
        )
    return {k: None if k == "outer_state_device" and v == "same" else v for k, v in settled.items()}
