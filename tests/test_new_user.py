"""What a torch DDP user meets in the first hour (issue 38, items 5, 14, 15, 16), written as user code.

- options spelled as a DDP user spells them: ``compression="Auto"``, ``comm_dtype=torch.float16``, and a
  mistyped name answered with the closest one; ``bucket_cap_mb=-1`` refused under that name;
- ``compression="auto"`` with an optimizer whose quality under its recipe nobody measured warns, once;
- ``comm_stats(total=True)``: the run's totals, kept across the engine's rebuilds and checkpoints;
- ``model.config`` shows what runs (``trace_steps`` resolved).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from gradientflow import GradientFlowConfig
from gradientflow.policy.auto_choice import unmeasured_warning

from _dist import run_distributed


# ---- 14. options as a torch DDP user writes them ----------------------------------------------
@pytest.mark.parametrize(
    ("given", "runs"),
    [("Auto", "auto"), ("QUANTIZED", "3bit"), ("quantised", "3bit"), (" csc ", "topk-fp16"), ("3BIT", "3bit")],
)
def test_recipe_names_ignore_case_and_spelling(given: str, runs: str) -> None:
    assert GradientFlowConfig(compression=given).compression == runs


@pytest.mark.parametrize(
    ("option", "given", "closest"),
    [("compression", "quantizd", "quantized"), ("compression", "atuo", "auto"), ("algorithm", "rign", "ring")],
)
def test_a_mistyped_name_is_answered_with_the_closest(option: str, given: str, closest: str) -> None:
    with pytest.raises(ValueError) as err:
        GradientFlowConfig(**{option: given})
    first = str(err.value)[:120]  # the answer comes first, before the list of everything accepted
    assert f"did you mean {closest!r}?" in first and repr(given) in first, str(err.value)


@pytest.mark.parametrize(
    ("given", "wire"),
    [(torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32"), ("float16", "fp16"), ("FP16", "fp16")],
)
def test_comm_dtype_takes_torch_dtypes(given: object, wire: str) -> None:
    assert GradientFlowConfig(comm_dtype=given).comm_dtype == wire  # type: ignore[arg-type]


def test_comm_dtype_refuses_other_dtypes_naming_what_it_takes() -> None:
    with pytest.raises(ValueError, match=r"comm_dtype must be one of .*torch\.float16.*got torch\.int8"):
        GradientFlowConfig(comm_dtype=torch.int8)  # type: ignore[arg-type]


# ---- 16. model.config shows what runs ---------------------------------------------------------
def test_config_shows_the_traced_steps() -> None:
    assert GradientFlowConfig(trace_path="trace.json").trace_steps == (1, 4)
    assert GradientFlowConfig().trace_steps is None  # nothing traced


def test_every_config_field_is_documented_in_options_md() -> None:
    import dataclasses

    text = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text()
    undocumented = [f.name for f in dataclasses.fields(GradientFlowConfig) if f"`{f.name}`" not in text]
    assert not undocumented, f"docs/options.md does not name {undocumented}"


# ---- 15. "auto" with an optimizer nobody measured ---------------------------------------------
def test_unmeasured_optimizers_are_named_and_measured_ones_are_not() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    for opt in (torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.optim.Adam(p), torch.optim.AdamW(p)):
        assert unmeasured_warning(opt, "quantized") is None
    message = unmeasured_warning(torch.optim.Adagrad(p), "quantized")
    assert message is not None and "Adagrad" in message and "Adam / AdamW" in message and "SGD" in message


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=gen)).square().mean().backward()
        opt.step()  # the line a warning about the optimizer must point at


def _user_worker(rank: int, world: int) -> dict:
    import gradientflow as gf

    out: dict = {}
    try:  # torch DDP's name for θ, a bad value: the message names the argument the user passed
        gf.DistributedDataParallel(_net(), bucket_cap_mb=-1)
    except ValueError as exc:
        out["bucket_cap_mb"] = str(exc)
    out["torch dtype"] = gf.DistributedDataParallel(_net(), comm_dtype=torch.float16).config.comm_dtype
    out["trace_steps"] = gf.DistributedDataParallel(_net(), trace_path="unused.json").config.trace_steps

    out["warnings"] = {}
    for make in (torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.AdamW):
        model = gf.DistributedDataParallel(_net(), compression="auto")
        opt = make(model.parameters(), lr=1e-3)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _train(model, opt, 3, rank)
        ours = [w for w in seen if 'compression="auto"' in str(w.message)]
        out["warnings"][make.__name__] = [(str(w.message), Path(w.filename).name) for w in ours]
        if make is torch.optim.Adagrad:  # "auto" rebuilt the engine after step 0: the totals go on
            out["auto totals"] = model.comm_stats(total=True)

    # Run totals: cumulative since construction, whatever checkpoints do.
    model = gf.DistributedDataParallel(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, opt, 3, rank)
    one = model.comm_stats()
    before = model.comm_stats(total=True)
    model.load_comm_state_dict(model.comm_state_dict())
    out["totals"] = (one, before, model.comm_stats(total=True))
    return out


def test_a_ddp_users_first_hour_on_two_ranks() -> None:
    for r in run_distributed(_user_worker, 2):
        assert r["bucket_cap_mb"].startswith("bucket_cap_mb must be a number >= 0"), r["bucket_cap_mb"]
        assert "fusion_threshold_mb" not in r["bucket_cap_mb"]  # an argument the user never passed
        assert r["torch dtype"] == "fp16" and r["trace_steps"] == (1, 4)

        for name in ("Adagrad", "RMSprop"):  # warned once, at the user's optimizer.step() line
            (message, where), *more = r["warnings"][name]
            assert not more and name in message and "not measured" in message, r["warnings"][name]
            assert where == Path(__file__).name, where
        assert r["warnings"]["AdamW"] == []  # measured: docs/results/adamw.md
        assert r["auto totals"]["steps"] == 3 and r["auto totals"]["compression"] == "3bit"

        one, before, after = r["totals"]
        assert before == after  # loading a checkpoint changes no counter of the run
        assert before["steps"] == 3 and before["payload_bytes"] == 3 * one["payload_bytes"] > 0
        assert before["dense_bytes"] == 3 * one["dense_bytes"] and before["collectives"] == 3 * one["collectives"]
        assert set(one) | {"steps"} >= set(before)  # the same keys as one step's, plus steps
