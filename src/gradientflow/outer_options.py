"""The options of fewer syncs (``sync_every > 1``, DiLoCo's outer loop; docs/fewer-syncs.md): their names and
defaults, their validation, and the outer exchange an ``outer_compression`` value names.

The options themselves are fields of :class:`gradientflow.config.GradientFlowConfig`, each documented under its
field there; the config validates them at construction through :func:`settle_outer`, passing what it reads, and
holds the values it returns (this module imports nothing of the config: the config imports it).  The outer loop
that runs them is :mod:`gradientflow.outer`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .mechanisms import check_door, options_of
from .options_base import COMM_DTYPES, Quantizer, advise, did_you_mean, not_int
from .recipe_rule import UnknownRecipe, resolve
from .recipes import BY_NAME, OUTER_ALIASES, OUTER_NAMES

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


def _outer_names(topk: bool = False) -> list[str]:
    """What ``outer_compression=`` offers: the rows whose scope is ``"outer"`` (``topk``: those sending a share of
    the chunks, the ones ``outer_density`` applies to)."""
    return [n for n in OUTER_NAMES if not topk or "density" in options_of(BY_NAME[n].mechanism)]


def outer_exchange_of(value: object, density: float | None = None, *, topk: bool = False) -> OuterExchange:
    """The outer exchange an ``outer_compression`` value names: a row of the recipe table whose scope is
    ``"outer"`` (an earlier outer name too), or a width of the quantised family without preconditioning; the top-k
    exchange at ``density`` (:data:`TOPK_DENSITY` where None); ``ValueError`` saying what to pass otherwise
    (``topk``: an ``outer_density`` was passed, so only the top-k exchanges are offered)."""
    key = value.strip().lower() if isinstance(value, str) else value
    key = OUTER_ALIASES.get(key, key) if isinstance(key, str) else key
    names = _outer_names(topk)
    try:
        found = resolve(key)
    except UnknownRecipe:
        close = did_you_mean(value, [*OUTER_NAMES, *OUTER_ALIASES])
        first = [n for n in names if close and f"{n!r}" in close]
        raise ValueError(
            f"outer_compression={value!r} names no outer exchange{close}: it takes a recipe whose scope is 'outer' "
            "(docs/recipes.md) or another width of the quantised family ('2bit', '5bit', ...). "
            + advise(({"outer_compression": [*first, *(n for n in names if n not in first)]}, []))
        ) from None
    recipe, settings = found.recipe, {**found.recipe.settings(), **found.stated}
    what = f"outer_compression={value!r}"
    check_door(recipe.mechanism, "outer", what, advise(({"outer_compression": names}, [])))
    if "outer" not in recipe.scopes or settings.get("quant_precondition"):
        raise ValueError(
            f"{what} is a per-step recipe (compression=, every step: preconditioning, 'auto' and the per-step top-k "
            "read the gradient of every step), not an outer exchange. " + advise(({"outer_compression": names}, []))
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


def _some_h(outer: Mapping[str, Any]) -> int:
    """A ``sync_every`` to advise beside the outer options given: 30, or more where ``sync_fragments`` and
    ``sync_delay`` need it."""
    frags, delay = outer.get("sync_fragments"), outer.get("sync_delay")
    frags = frags if isinstance(frags, int) and not isinstance(frags, bool) and frags > 0 else 1
    delay = delay if isinstance(delay, int) and not isinstance(delay, bool) and delay > 0 else 0
    return max(30, frags, frags * delay)


def _per_step_instead(compression: str, comm_dtype: str, outer_given: bool) -> str | None:
    """The outer exchange that sends what the per-step options asked for (``compression``, or a 16-bit
    ``comm_dtype`` beside ``"none"``), where there is one and no ``outer_compression`` was given."""
    if outer_given:
        return None
    value = comm_dtype if compression == "none" else compression
    try:
        return outer_exchange_of(value).name
    except ValueError:
        return None


def settle_outer(
    sync_every: int,
    outer: Mapping[str, Any],
    *,
    compression: str,
    comm_dtype: str,
    topology: str,
    mechanism: str,
    beside: Sequence[str] = (),
    comm_dtype_passed: bool = True,
) -> dict[str, Any]:
    """``sync_every`` and the outer options (docs/fewer-syncs.md): each checked, the defaults filled in where
    ``sync_every > 1``, and an outer option at ``sync_every=1`` (where it would do nothing) refused.

    ``outer``: the outer options as passed (:data:`OUTER_OPTIONS`, None where not given); ``compression``,
    ``comm_dtype``, ``topology`` and ``mechanism``: the config's per-step options as resolved, which an outer
    exchange would leave without effect; ``beside``: the per-step options passed beside ``compression`` (what the
    advice drops with it); ``comm_dtype_passed``: whether the user passed ``comm_dtype`` (else it is the recipe's
    and goes with ``compression``).  Returns the values the config holds: every outer option where
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
            alternatives: list[tuple[dict[str, Any], list[str]]] = []
            try:  # the advice must itself construct: sync_every=H only where the options beside it allow one
                settle_outer(
                    _some_h(outer), outer, compression=compression, comm_dtype=comm_dtype, topology=topology,
                    mechanism=mechanism, beside=beside,
                )  # fmt: skip
                alternatives.append(({"sync_every": [_some_h(outer)]}, []))
            except ValueError:
                pass
            raise ValueError(
                f"{', '.join(given)} {verb} only with sync_every > 1 (the outer optimizer of DiLoCo), but "
                f"sync_every=1. " + advise(*alternatives, ({}, given))
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
    spec = outer_exchange_of(settled["outer_compression"], topk=density is not None)
    if spec.density is None and density is not None:
        raise ValueError(
            f"outer_density applies only to a top-k outer exchange, but outer_compression={spec.name!r} sends every "
            "coordinate. " + advise(({"outer_compression": _outer_names(topk=True)}, []), ({}, ["outer_density"]))
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
    # what runs every step beside the outer exchange: nothing on a flat layout, a dense average inside each node
    # of several ranks (in comm_dtype); "auto" is resolved at construction, so it is refused as either would be
    nodes = topology not in ("flat", "auto")  # "MxG": the layout is known, its comm_dtype runs inside each node
    if mechanism != "dense" or (topology == "flat" and (compression != "none" or comm_dtype != "fp32")):
        if topology == "flat":
            layout = f"sync_every={h} on a flat layout exchanges no gradient between syncs"
        elif topology == "auto":
            layout = (
                f"sync_every={h}: only the outer exchange goes between replicas (on a flat layout nothing else is "
                "exchanged; on nodes of several ranks gradients are averaged densely inside each node)"
            )
        else:
            layout = (
                f"sync_every={h}: gradients are averaged densely inside a node every step and only the outer "
                "exchange crosses nodes"
            )
        drops = ["compression"] * (compression != "none") + [k for k in beside if k != "comm_dtype"]
        if comm_dtype != "fp32" and not nodes and comm_dtype_passed:  # passed (the recipe's own goes with it)
            drops.append("comm_dtype")
        asked = [f"compression={compression!r}"] * (compression != "none")
        asked += [f"comm_dtype={comm_dtype!r}" if k == "comm_dtype" else k for k in drops if k != "compression"]
        choices: list[tuple[dict[str, Any], list[str]]] = [({}, drops)]
        instead = _per_step_instead(compression, comm_dtype, outer["outer_compression"] is not None)
        if instead is not None and instead != OUTER_DEFAULTS["outer_compression"]:
            choices.insert(0, ({"outer_compression": [instead]}, drops))
        raise ValueError(
            f"{layout}, so {' and '.join(asked)} cannot apply (the exchange every sync_every steps is "
            f"outer_compression's, default {OUTER_DEFAULTS['outer_compression']!r}). " + advise(*choices)
        )
    return {k: None if k == "outer_state_device" and v == "same" else v for k, v in settled.items()}
