"""The recipe options are one definition (``gradientflow.recipe_options.RecipeOptions``) that the config extends and
both doors take: the wrapper's constructor and ``fully_shard`` state them as explicit keywords (for ``help()`` and
type checkers), so their names, types and defaults are checked against it here, and each door hands every option it
takes to the config as given (no option accepted and dropped)."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace
from typing import Any

import pytest
from torch import nn

import gradientflow as gf
from gradientflow.config import GradientFlowConfig
from gradientflow.fsdp import api as fsdp_api
from gradientflow.recipe_options import RecipeOptions
from gradientflow.wrapper import ddp as ddp_module

OWN_DEFAULTS = {("fully_shard", "compression"): "auto"}  # a door's own default: fully_shard picks for the optimizer
DOORS = {"DistributedDataParallel": gf.DistributedDataParallel.__init__, "fully_shard": fsdp_api.fully_shard}


@pytest.mark.parametrize("door", sorted(DOORS))
def test_each_door_takes_every_recipe_option_as_defined(door: str) -> None:
    params = inspect.signature(DOORS[door]).parameters
    for f in dataclasses.fields(RecipeOptions):
        p = params.get(f.name)
        assert p is not None, f"{door} does not take the recipe option {f.name}"
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, (door, f.name)
        assert p.annotation == f.type, f"{door}'s {f.name}: {p.annotation}, RecipeOptions says {f.type}"
        assert p.default == OWN_DEFAULTS.get((door, f.name), f.default), (door, f.name, p.default)


def test_the_config_is_the_recipe_options_and_the_wrappers_own() -> None:
    recipe = [f.name for f in dataclasses.fields(RecipeOptions)]
    config = [f.name for f in dataclasses.fields(GradientFlowConfig)]
    assert issubclass(GradientFlowConfig, RecipeOptions) and config[: len(recipe)] == recipe
    keywords = [
        n
        for n, p in inspect.signature(gf.DistributedDataParallel.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    # every keyword but the membership engine is a config field: replicas= is an object the wrapper holds (a torchft
    # Manager, outer/membership.py), not a value of the recipe; broadcast_buffers is torch's forward_sync_buffers
    assert sorted(k for k in keywords if k != "replicas") == sorted(set(config) - {"broadcast_buffers"})


class _Stop(Exception):
    """Raised by a recorder in place of building the config (not caught by the wrapper's construction)."""


def _recorder(seen: dict[str, Any]) -> Any:
    def record(*args: Any, **kwargs: Any) -> Any:
        assert not args
        seen.update(kwargs)
        raise _Stop

    return record


def test_the_wrapper_hands_every_argument_on(monkeypatch: pytest.MonkeyPatch) -> None:
    params = inspect.signature(gf.DistributedDataParallel.__init__).parameters
    given = {n: object() for n in list(params)[2:]}  # a marker per argument, after self and module
    resolved = SimpleNamespace(fusion_threshold_mb=object(), forward_sync_buffers=object())
    to_torch: dict[str, Any] = {}
    to_config: dict[str, Any] = {}

    def resolve(module: nn.Module, **kwargs: Any) -> Any:
        to_torch.update(kwargs)
        return resolved

    monkeypatch.setattr(ddp_module, "resolve_ddp_args", resolve)
    monkeypatch.setattr(ddp_module, "GradientFlowConfig", _recorder(to_config))
    with pytest.raises(_Stop):
        gf.DistributedDataParallel(nn.Linear(2, 2), **given)
    no_effect = {"check_reduction", "skip_all_reduce_unused_params", "batched_grad_copy"}  # accepted, no effect
    torch_args = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][2:]
    assert to_torch == {n: given[n] for n in [*torch_args, "fusion_threshold_mb"] if n not in no_effect}
    own = [
        n
        for n, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in ("fusion_threshold_mb", "replicas")  # replicas: held
    ]
    assert to_config == {
        **{n: given[n] for n in own},
        "fusion_threshold_mb": resolved.fusion_threshold_mb,
        "broadcast_buffers": resolved.forward_sync_buffers,
    }


def test_fully_shard_hands_every_recipe_option_to_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    given = {f.name: object() for f in dataclasses.fields(RecipeOptions)}
    seen: dict[str, Any] = {}
    monkeypatch.setattr(fsdp_api, "GradientFlowConfig", _recorder(seen))
    with pytest.raises(_Stop):
        fsdp_api.fully_shard(nn.Linear(2, 2), **given)
    # and fewer syncs' options at their defaults (sync_every=1: the config leaves them unset), the wrapper's names
    from gradientflow.outer_options import OUTER_OPTIONS

    assert seen == {**given, "sync_every": 1, **dict.fromkeys(OUTER_OPTIONS)}
