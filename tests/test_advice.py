"""Every option error's advice constructs (issue 70, item 1).

An option error says what is wrong, then what to do, in the form :func:`gradientflow.options_base.advise` writes:
sentences starting ``Pass `` or ``Drop ``, alternatives joined by ``, or pass`` / ``, or drop``, each option set as
``name=value`` in Python syntax, a choice among values as ``name='a' (or 'b', 'c')``, an option to leave out as
``drop name``; a choice of ``pick`` (``name must be one of 'a', 'b'``) offers each value.  These tests read that
advice back from the message text alone (not from the code that wrote it), apply each alternative to the
options that were refused, and construct again: every alternative, and every value a choice offers, must construct.

The options are walked as a grid of bad combinations: the per-step recipes with options their mechanism does not
read, the recipe's name contradicted, ``sync_every`` on flat and two-level layouts, the outer options, and
``fully_shard``'s recipe options (its default ``compression="auto"``).  The layout-dependent checks also run where
the layout is found at construction (``topology="auto"`` on 2 Gloo ranks, flat and 2 nodes of 2).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gradientflow as gf
from gradientflow.config import GradientFlowConfig
from gradientflow.fsdp import fully_shard
from gradientflow.fsdp.api import recipe_config
from gradientflow.mechanisms import check_door

from _dist import run_distributed

LITERAL = r"'[^']*'|-?\d+(?:\.\d+)?(?:e-?\d+)?|True|False|None"
SETTING = re.compile(rf"\b(\w+)=({LITERAL})(?: \(or ((?:{LITERAL})(?:, (?:{LITERAL}))*)\))?")
DROP = re.compile(r"\b[Dd]rop (\w+(?:(?:, | and )\w+)*)")
ADVICE_START = re.compile(r"(?:^|(?<=[.:;!?] ))(?:Pass|Drop) ")
ALTERNATIVE = re.compile(r",? or (?=(?:pass|drop) )")
CHOICE = re.compile(rf"\b(\w+) must be one of ((?:{LITERAL})(?:, (?:{LITERAL}))*)")
DID_YOU_MEAN = re.compile(rf"(\w+)=.*\(did you mean ({LITERAL})\?\)|(\w+) must .*\(did you mean ({LITERAL})\?\)")

Alternative = tuple[dict[str, list[Any]], set[str]]
"""An alternative of the advice: the options it sets (each to one of the listed values), the options it drops."""


def advice_of(message: str, known: set[str]) -> list[Alternative]:
    """The alternatives ``message`` advises, read from its text; an assertion error where it advises nothing
    readable (no ``Pass``/``Drop`` sentence, a ``name=`` without a Python literal, an option that does not
    exist)."""
    choice = CHOICE.search(message)
    if choice is not None and choice[1] in known:
        values = [ast.literal_eval(v) for v in re.findall(LITERAL, choice[2])]
        return [({choice[1]: values}, set())]
    start = ADVICE_START.search(message)
    assert start is not None, f"no advice (a sentence starting 'Pass ' or 'Drop '): {message!r}"
    advice = message[start.start() :]
    out: list[Alternative] = []
    for text in ALTERNATIVE.split(advice):
        sets: dict[str, list[Any]] = {}
        for m in SETTING.finditer(text):
            extra = re.findall(LITERAL, m[3]) if m[3] else []
            sets[m[1]] = [ast.literal_eval(v) for v in [m[2], *extra]]
        drops = {name for m in DROP.finditer(text) for name in re.split(r", | and ", m[1])}
        unreadable = re.findall(rf"\b(\w+)=(?!{LITERAL})", text)
        assert not unreadable, f"advice sets {unreadable} to no Python value: {message!r}"
        assert sets or drops, f"an alternative that says nothing to pass or drop: {text!r} in {message!r}"
        assert set(sets) | drops <= known, f"advice names options that do not exist {set(sets) | drops - known}"
        out.append((sets, drops))
    return out


def applied(kwargs: dict[str, Any], alternative: Alternative) -> Iterator[dict[str, Any]]:
    """``kwargs`` with ``alternative`` applied, once per value combination it offers."""
    sets, drops = alternative
    kept = {k: v for k, v in kwargs.items() if k not in drops}
    names = list(sets)
    for values in itertools.product(*(sets[n] for n in names)):
        yield {**kept, **dict(zip(names, values, strict=True))}


def check_advice(build: Callable[..., Any], kwargs: dict[str, Any], known: set[str]) -> str | None:
    """``None`` where ``build(**kwargs)`` constructs; else its error's message, after asserting that every
    alternative it advises constructs.  A ``must be one of`` names the option's values, not a fix for the other
    options: each value passes that check, and one of them constructs."""
    try:
        build(**kwargs)
        return None
    except ValueError as exc:
        message = str(exc)
    domain = CHOICE.search(message)
    built = []
    for alternative in advice_of(message, known):
        for fixed in applied(kwargs, alternative):
            try:
                build(**fixed)
                built.append(fixed)
            except ValueError as exc:
                if domain is not None and f"{domain[1]} must be one of" not in str(exc):
                    continue  # a value of the option, refused for another option beside it
                raise AssertionError(
                    f"{kwargs} was refused with\n  {message}\nbut what it advises, {fixed}, is refused too:\n  {exc}"
                ) from None
    assert built, f"none of the values {message!r} offers constructs beside {kwargs}"
    return message


CONFIG_OPTIONS = set(inspect.signature(GradientFlowConfig).parameters)
FSDP_OPTIONS = {
    n for n, p in inspect.signature(fully_shard).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def ddp_options(**kwargs: Any) -> GradientFlowConfig:
    """What the DDP wrapper validates before any collective (its config; the layout as ``topology`` states)."""
    config = GradientFlowConfig(**kwargs)
    check_door(config.mechanism, "ddp", f"compression={config.compression!r}")
    return config


FSDP_DEFAULTS = {n: p.default for n, p in inspect.signature(fully_shard).parameters.items() if n in FSDP_OPTIONS}


def fsdp_options(**kwargs: Any) -> GradientFlowConfig:
    """What ``fully_shard`` validates before it shards: its recipe options read as the wrapper reads them (its own
    default ``compression="auto"``), the recipe's mechanism at the FSDP door."""
    options = {**FSDP_DEFAULTS, **kwargs}
    config = recipe_config(**{k: v for k, v in options.items() if k in CONFIG_OPTIONS})
    check_door(config.mechanism, "fsdp", f"compression={config.compression!r}")
    return config


# A bad combination is a configuration that constructs with one option changed (a mistake has one cause: what
# several independent mistakes advise is each one's fix, not one construction).
PER_STEP_BASES: list[dict[str, Any]] = [
    {}, {"compression": "none"}, {"compression": "fp16"}, {"comm_dtype": "bf16"}, {"density": 0.1},
    {"compression": "topk-fp16", "density": 0.2}, {"compression": "topk-3bit", "density": 0.2}, {"compression": "3bit"},
    {"compression": "3bit", "quant_block": 64}, {"compression": "2bit-precond"}, {"compression": "auto"},
    {"compression": "3bit-precond", "quant_warmup_steps": 5},
]  # fmt: skip
OUTER_BASES: list[dict[str, Any]] = [
    {}, {"outer_compression": "fp16"}, {"outer_compression": "indexed-topk-2bit", "outer_density": 0.2},
    {"outer_lr": 0.7, "outer_momentum": 0.9}, {"sync_fragments": 2, "sync_delay": 2},
]  # fmt: skip
CHANGES: list[dict[str, Any]] = [
    *({"compression": c} for c in (
        "none", "fp16", "bf16", "topk-fp16", "topk-3bit", "3bit", "4bit", "5bit", "3bit-precond", "2bit-precond",
        "auto", "csc", "indexed-topk-2bit", "3bti",
    )),
    {"comm_dtype": "fp16"}, {"comm_dtype": "bf16"}, {"comm_dtype": "fp61"}, {"density": 0.1}, {"quant_bits": 2},
    {"quant_bits": 4}, {"quant_precondition": True}, {"quant_levels": "zeroless"}, {"quant_block": 64},
    {"quant_warmup_steps": 5}, {"sync_every": 1}, {"sync_every": 4}, {"topology": "flat"}, {"topology": "2x2"},
    *({"outer_compression": c} for c in ("3bit", "fp16", "auto", "topk-fp16", "3bit-precond", "topk-3bit", "3bt")),
    {"outer_density": 0.2}, {"outer_lr": 0.7}, {"sync_fragments": 2}, {"sync_delay": 1},
]  # fmt: skip


def _bases() -> Iterator[dict[str, Any]]:
    for per_step, topology in itertools.product(PER_STEP_BASES, ("auto", "flat", "2x2")):
        yield {**per_step, "topology": topology}
    for outer, topology, per_step in itertools.product(OUTER_BASES, ("flat", "2x2"), ({}, {"compression": "fp16"})):
        if topology == "2x2" or not per_step:  # a per-step recipe beside sync_every runs on nodes only
            yield {**per_step, **outer, "sync_every": 4, "topology": topology}


BASES = list(_bases())
GRID = [{**base, **change} for base in BASES for change in CHANGES]


def test_the_bases_construct() -> None:
    for base in BASES:
        ddp_options(**base)


def test_every_option_error_of_the_wrapper_advises_what_constructs() -> None:
    refused = [m for kwargs in GRID if (m := check_advice(ddp_options, kwargs, CONFIG_OPTIONS)) is not None]
    # the grid reaches every kind of refusal (a grid that stopped refusing would test nothing)
    for says in (
        "by its name",
        "has no effect there",
        "picks density itself",
        "on a flat layout exchanges no gradient",
        "crosses nodes",
        "is a per-step recipe",
        "not an outer exchange",
        "has no form for the outer exchange",
        "applies only to a top-k outer exchange",
        "apply only with sync_every > 1",
        "is an outer exchange",
        "did you mean",
        "comm_dtype must be one of",
    ):
        assert any(says in m for m in refused), says


def test_every_option_error_of_fully_shard_advises_what_constructs() -> None:
    refused = []
    recipe_changes = [c for c in CHANGES if set(c) <= FSDP_OPTIONS]
    # fully_shard's bases: those that construct at its door (its default compression is "auto", so a density alone
    # is a mistake already), and the fewer-syncs ones (fully_shard has sync_every too)
    candidates = [*PER_STEP_BASES, *({**outer, "sync_every": 4} for outer in OUTER_BASES)]
    recipe_bases = []
    for base in candidates:
        if set(base) <= FSDP_OPTIONS:
            with contextlib.suppress(ValueError):
                fsdp_options(**base)
                recipe_bases.append(base)
    assert any("sync_every" in b for b in recipe_bases) and {} in recipe_bases
    for base, change in itertools.product(recipe_bases, recipe_changes):
        message = check_advice(fsdp_options, {**base, **change}, FSDP_OPTIONS)
        refused += [] if message is None else [message]
    assert any("compression='auto' picks density itself" in m for m in refused), "fully_shard's default is 'auto'"
    assert any("apply only with sync_every > 1" in m for m in refused)


@pytest.mark.parametrize(
    ("message", "alternatives"),
    [
        (
            "x is wrong. Pass outer_compression='3bit' (or 'fp16', 'none'), and drop compression, or drop "
            "sync_every and outer_density.",
            [({"outer_compression": ["3bit", "fp16", "none"]}, {"compression"}), ({}, {"sync_every", "outer_density"})],
        ),
        ("comm_dtype must be one of 'fp32', 'fp16'; got 'x'", [({"comm_dtype": ["fp32", "fp16"]}, set())]),
    ],
)
def test_the_advice_is_read_as_written(message: str, alternatives: list[Alternative]) -> None:
    """The reader itself, on messages whose advice is known by hand."""
    assert advice_of(message, CONFIG_OPTIONS) == alternatives


@pytest.mark.parametrize(
    "message",
    [
        "x is wrong. Pass outer_compression=... for the exchange.",  # a placeholder, not a value
        "x is wrong. Pass sync_every=H too.",
        "x is wrong: use another recipe.",  # no advice at all
        "x is wrong. Drop it.",  # "it" is no option
    ],
)
def test_advice_that_cannot_be_applied_is_refused_by_the_reader(message: str) -> None:
    with pytest.raises(AssertionError):
        advice_of(message, CONFIG_OPTIONS)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


# what only construction knows: the layout (topology="auto"), the model's tensors (sync_fragments)
WRAPPER_CASES = [
    {"sync_every": 100, "compression": "auto"},
    {"sync_every": 100, "compression": "topk-fp16"},
    {"sync_every": 100, "compression": "3bit"},
    {"sync_every": 100, "compression": "3bit-precond"},
    {"sync_every": 100, "comm_dtype": "fp16"},
    {"sync_every": 8, "sync_fragments": 5},
]


def _wrapper_worker(rank: int, world: int) -> list[str | None]:
    def build(**kwargs: Any) -> Any:
        return gf.DistributedDataParallel(_net(), **kwargs)

    known = set(inspect.signature(gf.DistributedDataParallel).parameters)
    return [check_advice(build, kwargs, known) for kwargs in WRAPPER_CASES]


@pytest.mark.parametrize("per_node", [None, 2], ids=["flat", "2-nodes-of-2"])
def test_advice_constructs_where_the_layout_is_found_at_construction(per_node: int | None) -> None:
    world = 2 if per_node is None else 4
    results = run_distributed(_wrapper_worker, world, timeout=120, ranks_per_node=per_node)
    assert all(r == results[0] for r in results), "every rank refuses alike"
    refused = [m for m in results[0] if m is not None]
    if per_node is None:  # a flat layout: nothing is exchanged between steps, so every per-step option is refused
        assert len(refused) == len(WRAPPER_CASES), refused
        assert not any("inside a node" in m for m in refused), "no node of several ranks on a flat layout"
    else:  # nodes of 2: comm_dtype applies inside the node, a compressed recipe nowhere
        assert len(refused) == 5, refused
