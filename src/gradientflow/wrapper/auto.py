"""``compression="auto"``: dense until the wrapper knows its optimizer, then that optimizer's recipe.

1. At the first ``step()`` of an optimizer holding the model's parameters (the wrapper's optimizer
   step pre-hook, :meth:`checkpoint.OptimizerWatch`), :func:`note_optimizer`
   records the recipe for its class (:func:`gradientflow.policy.auto_choice.recipe_for_optimizer`).
   Step 0's gradients were averaged densely in fp32, exactly as torch DDP does.
2. At the next synchronised forward (:func:`switch_if_chosen`; not inside the optimizer hook, where
   ``.grad`` still holds the result the optimizer is reading) the ranks check they picked the
   same recipe, and the wrapper rebuilds its engine with it (the observed pool order is kept).
   An Adam-type optimizer on two ranks gets ``"2bit-precond"``, whose first 20 steps send the 3-bit codes of
   ``"3bit"``; at their end (:func:`_watch_width`) it keeps 2 bits or goes on at 3, whichever costs less per
   step on this link and device, measured there (:mod:`gradientflow.policy.width`); one whose exchange has
   more than two parties (flat ranks or nodes) gets ``"3bit-precond"``
   (:data:`gradientflow.policy.auto_choice.MANY_PARTIES_ADAM`).
3. ``comm_state_dict()`` records the active recipe; loading it into a fresh ``"auto"`` wrapper
   switches to that recipe first, so a resumed run continues exactly.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..engine import comm_state
from ..engine.schedule import measure as measure_link
from ..option_values import DEFAULT_QUANT, lookup
from ..policy import width
from ..policy.auto_choice import (
    ADAM_RECIPE,
    AUTO_RECIPES,
    MANY_PARTIES_ADAM,
    adam_recipe,
    agree_on_recipe,
    recipe_for_optimizer,
    recipe_options,
    unmeasured_warning,
)
from .compat import recipe_theta
from .groups import resolve_layout

AUTO_PICKS = (*AUTO_RECIPES, width.FEWER_BITS, MANY_PARTIES_ADAM)
"""Every recipe an ``"auto"`` run may be running (its checkpoint names one of them)."""
DistributedDataParallel = Any
"""The wrapper (:class:`gradientflow.wrapper.ddp.DistributedDataParallel`), not imported: ddp imports this module."""


@dataclass
class AutoState:
    """What ``"auto"`` knows: whether it was asked for, the pending choice, and why."""

    requested: bool
    pending: str | None = None
    reason: str = "no optimizer step seen yet: dense fp32"
    optimizer: str = ""  # the class name of the optimizer that decided
    adam: bool = False  # the optimizer is Adam-type: the quantised recipe's width is chosen by measurement
    picked: str | None = None  # the recipe switched to (a row of the recipe table: one of AUTO_PICKS)
    deciding: bool = False  # "2bit-precond"'s 3-bit warm-up runs; 2 bits or 3 are decided at its end
    exposed: list[float] = field(default_factory=list)  # the warm-up steps' exposed communication, seconds
    seen: int = -1  # the strategy's step whose exposure was last read
    watched: int = 0  # steps watched since the warm-up began here (the run's switch, or a resume inside it)
    offset: int = 0  # steps synchronised before this wrapper: a run resumed from a checkpoint saved before its switch


def note_optimizer(model: DistributedDataParallel, optimizer: torch.optim.Optimizer, stacklevel: int = 2) -> None:
    """Step 1: the first optimizer stepping this model decides (later ones are ignored); an optimizer whose
    quality under its recipe was never measured is warned about, once (``stacklevel``: the user's step line)."""
    auto = model._gf_auto
    if not auto.requested or auto.pending is not None or model.config.compression != "auto":
        return
    auto.pending = recipe_for_optimizer(optimizer)
    auto.adam = isinstance(optimizer, torch.optim.Adam)  # AdamW too (a subclass)
    auto.optimizer = type(optimizer).__name__
    auto.reason = f"{auto.optimizer} -> {auto.pending}"
    message = unmeasured_warning(optimizer, auto.pending)
    if message is not None:
        warnings.warn(message, stacklevel=stacklevel + 1)


def switch_if_chosen(model: DistributedDataParallel) -> None:
    """Step 2, at a synchronised forward: agree across ranks and rebuild the engine with the recipe."""
    auto = model._gf_auto
    if auto.deciding:
        _watch_width(model)
        return
    if auto.pending is None or model.config.compression != "auto":
        return
    agree_on_recipe(auto.pending, auto.reason, model.process_group, model._gf_watchdog, model.join_device)
    recipe = auto.pending
    if recipe == ADAM_RECIPE and auto.adam and model._gf_world_size == 2:
        recipe = width.FEWER_BITS  # its warm-up sends "3bit"'s codes meanwhile
        _start_deciding(auto)
        auto.reason = f"{auto.optimizer} -> {recipe} (3 bits first; 3 or 2 decided at step {width.WARMUP})"
    elif recipe == ADAM_RECIPE and auto.adam:
        parties = resolve_layout(model.config, model.process_group).nodes  # flat: every rank its own node
        recipe = adam_recipe(parties)
        if recipe != ADAM_RECIPE:
            auto.reason = f"{auto.optimizer} -> {recipe} (3 bits, preconditioned: {parties} parties)"
    _rebuild(model, recipe)


def _start_deciding(auto: AutoState, deciding: bool = True) -> None:
    auto.deciding, auto.exposed, auto.seen, auto.watched = deciding, [], -1, 0


def exposure_is_timed(device: torch.device, backend: str) -> bool:
    """Whether the host's wait at the end of backward is the wait on the network: on CPU tensors, and with Gloo
    (which the host waits on, staged through host memory for CUDA tensors).  With NCCL the host only queues the
    wait on a CUDA stream, so the exposure it sees says nothing of the link: there the whole wire time the 2-bit
    codes save counts (as the rule did before it watched the warm-up)."""
    return device.type == "cpu" or "gloo" in backend.lower()


def last_exposed(model: DistributedDataParallel) -> float:
    """Seconds the end of the last step's backward waited on communication (``comm_stats()["exposed_seconds"]``)."""
    return float(model._gf_engine.last_stats.exposed_seconds)


def _watch_width(model: DistributedDataParallel) -> None:
    """At each synchronised forward of ``"2bit-precond"``'s warm-up: note the last step's exposed communication (but for
    the first :data:`width.SETTLE` steps run here); at the forward before its first 2-bit step, decide."""
    auto, sync = model._gf_auto, model._gf_engine.sync
    if sync.step != auto.seen:  # a forward per step (an evaluation forward with grad on would read it twice)
        auto.seen, auto.watched = sync.step, auto.watched + 1
        if auto.watched > width.SETTLE:  # not the first steps here: allocations (and, resumed, a step not run here)
            auto.exposed.append(last_exposed(model))
    if sync.step >= sync.warmup:
        _decide_width(model)


def _lower_quartile(seconds: list[float]) -> float:
    """The steps' exposure the 2-bit codes could cut: the lower quartile, not the median.  Behind a shaped link the
    3-bit steps' exposures are bimodal (at 500 Mbit/s here 2-5 ms, or 15-24 ms when the link's bucket ran dry:
    docs/results/adamw.md); the spikes decide the median on some runs and not on others, and fewer bytes did not remove
    them     (2 bits were slower there on every run)."""
    return statistics.quantiles(seconds, n=4)[0] if len(seconds) > 1 else seconds[0]


def _decide_width(model: DistributedDataParallel) -> None:
    """2 bits go on or 3 take over, for a two-party exchange: the link (``schedule="auto"``'s measurement, or one
    now), the 3-bit steps' exposed communication (its lower quartile) and the codec's extra time (both on the first
    rank, broadcast), then the pure rule of :mod:`gradientflow.strategies.width`; collective, so every rank decides
    on the same numbers.  3 bits: the engine is rebuilt as ``"3bit"`` with the warm-up's residual (the same
    codes)."""
    auto, group, watchdog = model._gf_auto, model.process_group, model._gf_watchdog
    device = model._gf_params[0].device
    link = model.schedule.link if model.schedule is not None else measure_link(group, watchdog, device, model._gf_src)
    total = sum(p.numel() for p in model._gf_params)
    extra, exposed = 0.0, 0.0
    if dist.get_rank() == model._gf_src:
        extra = width.extra_seconds(device, min(width.SAMPLE, total))
        timed = exposure_is_timed(device, str(dist.get_backend(group)))
        # none seen (resumed at the warm-up's end) or not timed by the host (NCCL): unknown, the wire time counts whole
        exposed = _lower_quartile(auto.exposed) / total if auto.exposed and timed else math.inf
    mine = torch.tensor([extra, exposed], dtype=torch.float64, device=device)
    watchdog.wait(dist.broadcast(mine, src=model._gf_src, group=group, async_op=True), "auto width broadcast", 8)
    extra, exposed = mine.tolist()
    fewer = width.fewer_bits_pay(link.bulk_Bps, extra, exposed)
    auto.deciding, auto.exposed = False, []
    saved_ns = width.saved_bytes() / link.bulk_Bps * 1e9
    shown = "not measured" if math.isinf(exposed) else f"{exposed * total * 1e3:.1f} ms a step, {exposed * 1e9:.2f} ns"
    auto.reason = (
        f"{auto.optimizer} -> {width.FEWER_BITS if fewer else ADAM_RECIPE} ({'2' if fewer else '3'} bits: 2-bit codes "
        f"would save {saved_ns:.2f} ns a gradient on this {link.bulk_Bps * 8 / 1e6:.0f} Mbit/s link, of which the "
        f"3-bit steps left exposed {shown}; their codec costs {extra * 1e9:.2f} ns more here)"
    )
    if not fewer:
        state = comm_state.save(model._gf_engine, model._gf_world_size)
        _rebuild(model, ADAM_RECIPE)
        three = {**state, "quantizer": list(DEFAULT_QUANT), "sq": None}  # the warm-up's residual: 3-bit codes' error
        comm_state.load(model._gf_engine, three, model._gf_world_size)


def _rebuild(model: DistributedDataParallel, recipe: str) -> None:
    """The engine for ``recipe``, in the observed pool order; its step counter continues the run's, so
    CSC's density ramp is where a run started with ``compression="topk-3bit"`` would be (at ``density=0.5`` beyond a
    pair of ranks: :func:`~gradientflow.policy.auto_choice.recipe_options`)."""
    engine = model._gf_engine
    model._gf_auto.picked = recipe
    extra = recipe_options(recipe, model._gf_world_size)  # "topk-3bit" beyond a pair of ranks: denser
    config = model.config.with_recipe(recipe, **extra)  # the row's options in full: "3bit" after "2bit-precond"
    model.config = recipe_theta(config, model._gf_settings.theta_given)
    model._gf_build_engine(list(engine.pool.layout.order), layout_final=engine.layout_final)
    # both recipes' strategies count steps: the run's (a resumed run's steps before it included)
    model._gf_engine.sync.step = model._gf_watchdog.step + model._gf_auto.offset


def save(model: DistributedDataParallel, state: dict[str, Any]) -> dict[str, Any]:
    """Step 3: the active recipe goes into the communication checkpoint (and a choice not yet applied:
    a run saved between the first optimizer step and the next forward switches at that forward too)."""
    state["compression"] = model.config.compression
    if model._gf_auto.picked is not None:  # what "auto" switched to (a resumed "auto" run switches to it too)
        state["auto_recipe"] = model._gf_auto.picked
    if model._gf_auto.deciding:  # in "2bit-precond"'s warm-up: a resumed run decides at its end, on its own measurement
        state["auto_deciding"] = True
    if model.config.compression == "auto" and model._gf_auto.pending is not None:
        state["auto_pending"] = model._gf_auto.pending
        state["auto_steps"] = model._gf_watchdog.step + model._gf_auto.offset  # where the switched recipe's ramp starts
        # the optimizer that chose: the switch's rules for Adam-type ones (2 ranks "2bit-precond", more "3bit-precond")
        state["auto_optimizer"], state["auto_adam"] = model._gf_auto.optimizer, model._gf_auto.adam
    return state


def prepare_load(model: DistributedDataParallel, state: dict[str, Any]) -> dict[str, Any]:
    """Step 3: an ``"auto"`` wrapper not yet switched takes the checkpoint's recipe; other mismatches raise."""
    state = dict(state)
    saved = lookup(state.pop("compression", model.config.compression)).name  # a checkpoint's earlier names: the rows
    pending = state.pop("auto_pending", None)
    pending = None if pending is None else lookup(pending).name
    steps = int(state.pop("auto_steps", 0))
    picked = lookup(state.pop("auto_recipe", saved)).name
    deciding = bool(state.pop("auto_deciding", False))
    optimizer, adam = str(state.pop("auto_optimizer", "")), bool(state.pop("auto_adam", False))
    active = model.config.compression
    mine = model._gf_auto.picked
    # an "auto" run's two widths are one run: 2bit-precond's warm-up may have gone on as 3bit, here or there
    widths = {width.FEWER_BITS, ADAM_RECIPE}
    same_run = model._gf_auto.requested and {saved, active} <= widths
    if (saved == active or same_run) and mine is not None and picked != mine:  # "auto" switched here to another width
        raise ValueError(
            f'gradientflow: the communication state was saved by a compression="auto" run sending {picked!r}, this '
            f"model switched to {mine!r} already. Load the communication state before the first training step "
            "(a fresh wrapper takes the saved recipe), or pass the saved recipe by name."
        )
    if saved == active or same_run:
        _start_deciding(model._gf_auto, deciding and model._gf_auto.requested)
        if pending is not None and active == "auto":
            model._gf_auto.pending, model._gf_auto.offset = pending, steps
            model._gf_auto.optimizer, model._gf_auto.adam = optimizer, adam
            model._gf_auto.reason = f"{pending} (chosen before the loaded communication state was saved)"
        return state
    if active == "auto" and model._gf_auto.requested and saved in AUTO_PICKS:  # "topk-fp16": an "auto" run of before
        model._gf_auto.reason = f"{picked} (from the loaded communication state)"
        _rebuild(model, picked)
        _start_deciding(model._gf_auto, deciding)
        return state
    raise ValueError(
        f"gradientflow: the communication state was saved with compression={saved!r}, this model runs "
        f"compression={active!r}. Build the model with the compression it was saved with."
    )


def describe(model: DistributedDataParallel) -> dict[str, str]:
    """For ``comm_stats()``: the active recipe and, under ``"auto"``, why (nothing for the default "none",
    whose counters stay all numbers)."""
    if model.config.compression == "none":
        return {}
    out = {"compression": model.config.compression}  # the same canonical name as model.config
    if model._gf_auto.requested:
        out["compression_auto"] = model._gf_auto.reason
    return out
