"""The one recipe table (gradientflow/recipes.py): names, aliases, the rule for options beside a recipe, and
every place that names recipes reading it (the docs, the bench's modes, the quality bench, ``simulate``)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradientflow import recipes
from gradientflow.config import GradientFlowConfig
from gradientflow.recipes import ALIASES, RECIPES, Recipe

ROOT = Path(__file__).resolve().parents[1]


# ---- the table --------------------------------------------------------------------------------------------
def test_names_are_words_in_ascii_lower_case_and_each_defined_once() -> None:
    names = [r.name for r in RECIPES]
    assert len(set(names)) == len(names)
    for name in [*names, *ALIASES]:
        assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", name), name
    assert not set(names) & set(ALIASES), "an alias shadows a name"
    # each recipe's name is written once in the package's source: in its row (grep finds one definition)
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "gradientflow").rglob("*.py"))
    for name in ("topk-fp16", "topk-3bit", "3bit-precond", "2bit-precond"):
        assert source.count(f'name="{name}"') == 1, name


@pytest.mark.parametrize(("alias", "name"), sorted(ALIASES.items()))
def test_every_alias_is_the_same_config_as_its_name(alias: str, name: str) -> None:
    """An earlier name runs exactly the row it maps to: the same options, the same canonical name."""
    assert GradientFlowConfig(compression=alias) == GradientFlowConfig(compression=name)
    assert GradientFlowConfig(compression=alias.upper()).compression == name


@pytest.mark.parametrize(
    ("shorthand", "name", "options"),
    [
        ("q3", "3bit", {}),
        ("q32", "32bit", {"quant_bits": 32}),
        ("q4b64", "4bit", {"quant_bits": 4, "quant_block": 64}),
        ("q3u", "3bit", {"quant_levels": "uniform"}),
        ("q2npw2", "2bit-precond", {"quant_warmup_steps": 2}),
        # one letter from "q2npw20" and another quantiser: no preconditioning, so another name
        ("q2nw20", "2bit", {"quant_bits": 2, "quant_levels": "zeroless", "quant_warmup_steps": 20}),
    ],
)
def test_the_experiments_shorthand_names_the_family_member_and_its_options(
    shorthand: str, name: str, options: dict
) -> None:
    assert GradientFlowConfig(compression=shorthand) == GradientFlowConfig(compression=name, **options)


def test_the_quantised_family_by_width() -> None:
    four = GradientFlowConfig(compression="4bit")
    assert (four.compression, four.quant_bits, four.quant_block, four.quant_levels) == ("4bit", 4, 128, "fitted")
    assert GradientFlowConfig(compression="2bit-precond").quantizer() == (2, 128, "zeroless", True, 20, 0.0)
    assert GradientFlowConfig(compression="3bit-precond").quantizer() == (3, 128, "fitted", True, 0, 0.0)
    for bad in ("9bit", "q9", "1bit", "3bits", "topk-2bit"):
        with pytest.raises(ValueError, match="compression must be a recipe's name"):
            GradientFlowConfig(compression=bad)


def test_the_4bit_row_runs_what_the_width_ran_before_it_was_a_row() -> None:
    """The "4bit" row (what FSDP's "auto" gives SGD) has exactly the settings "4bit" had as a width of the family:
    4 bits with the "3bit" row's other settings, the same names fixed, the same conflicts refused."""
    four = GradientFlowConfig(compression="4bit")
    assert four == GradientFlowConfig(compression="q4")  # the shorthand still reads as a width over "3bit"'s row
    three = GradientFlowConfig(compression="3bit")
    for f in dataclasses.fields(four):
        expected = 4 if f.name == "quant_bits" else "4bit" if f.name == "compression" else getattr(three, f.name)
        assert getattr(four, f.name) == expected, f.name
    assert GradientFlowConfig(compression="auto").with_recipe("4bit") == four
    with pytest.raises(ValueError, match="is quant_bits=4 by its name"):
        GradientFlowConfig(compression="4bit", quant_bits=3)
    with pytest.raises(ValueError, match="is quant_precondition=False by its name"):
        GradientFlowConfig(compression="4bit", quant_precondition=True)


def test_every_recipe_the_policy_gives_is_a_row() -> None:
    import torch

    from gradientflow.policy import auto_choice, width

    gives = {auto_choice.SGD_RECIPE, auto_choice.ADAM_RECIPE, auto_choice.MANY_PARTIES_ADAM, width.FEWER_BITS}
    model = torch.nn.Linear(2, 2)
    for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters())):
        gives |= {auto_choice.fsdp_recipe_for_optimizer(optimizer, nodes) for nodes in (2, 3, 8)}
    assert gives <= set(recipes.NAMES), gives - set(recipes.NAMES)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert auto_choice.fsdp_recipe_for_optimizer(sgd, 2) == auto_choice.FSDP_SGD_RECIPE == "4bit"


def test_model_config_and_comm_stats_use_one_name() -> None:
    """The name stored is the table's (the alias is gone), and dataclasses.replace keeps it (a rebuilt config)."""
    cfg = GradientFlowConfig(compression="cscq")
    assert cfg.compression == "topk-3bit" and cfg.mechanism == "topk-quantized"
    assert dataclasses.replace(cfg) == cfg


# ---- the rule ---------------------------------------------------------------------------------------------
def test_rule_1_the_recipe_sets_its_rows_options() -> None:
    for r in (r for r in RECIPES if "per step" in r.scopes):  # the outer rows: tests/test_diloco.py
        cfg = GradientFlowConfig(compression=r.name)
        for option, value in r.settings().items():
            assert getattr(cfg, option) == value, (r.name, option)


@pytest.mark.parametrize(
    ("given", "option", "runs"),
    [
        ({"compression": "topk-3bit", "density": 0.5}, "density", 0.5),
        ({"compression": "topk-fp16", "density": 0.2}, "density", 0.2),
        ({"compression": "2bit-precond", "quant_warmup_steps": 0}, "quant_warmup_steps", 0),
        ({"compression": "3bit", "quant_block": 256}, "quant_block", 256),
        ({"compression": "3bit", "quant_levels": "uniform"}, "quant_levels", "uniform"),
        ({"compression": "none", "comm_dtype": "bf16"}, "comm_dtype", "bf16"),
    ],
)
def test_rule_2_an_explicit_option_overrides_the_row(given: dict, option: str, runs: object) -> None:
    cfg = GradientFlowConfig(**given)
    assert getattr(cfg, option) == runs
    assert cfg.compression == GradientFlowConfig(compression=given["compression"]).compression  # the same name


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"compression": "3bit", "quant_bits": 2}, "is quant_bits=3 by its name"),
        ({"compression": "3bit", "quant_precondition": True}, "is quant_precondition=False by its name"),
        ({"compression": "3bit-precond", "quant_precondition": False}, "is quant_precondition=True by its name"),
        ({"compression": "2bit-precond", "quant_bits": 3}, "is quant_bits=2 by its name"),
        ({"compression": "fp16", "comm_dtype": "bf16"}, "is comm_dtype='fp16' by its name"),
        ({"compression": "topk-fp16", "comm_dtype": "bf16"}, "is comm_dtype='fp16' by its name"),
        ({"compression": "topk-3bit", "quant_bits": 2}, "is quant_bits=3 by its name"),
        ({"compression": "q2npw20", "quant_precondition": False}, "is quant_precondition=True by its name"),
    ],
)
def test_rule_2_but_not_an_option_the_name_states(given: dict, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        GradientFlowConfig(**given)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"compression": "3bit", "density": 0.1}, "sends every coordinate"),
        ({"compression": "3bit", "comm_dtype": "fp16"}, "puts its own codes on the wire"),
        ({"compression": "fp16", "quant_bits": 2}, "does not quantise"),
        ({"compression": "none", "quant_block": 64}, "does not quantise"),
        ({"compression": "topk-fp16", "quant_bits": 3}, "does not quantise"),
        ({"compression": "topk-3bit", "quant_warmup_steps": 5}, "does not quantise"),
        ({"compression": "fp16", "density": 0.1}, "sends every coordinate"),
        ({"compression": "auto", "density": 0.3}, "picks density itself"),
        ({"compression": "auto", "quant_bits": 2}, "picks quant_bits itself"),
        ({"compression": "auto", "comm_dtype": "fp16"}, "picks comm_dtype itself"),
    ],
)
def test_rule_3_an_option_the_mechanism_does_not_read_is_an_error(given: dict, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        GradientFlowConfig(**given)


def test_with_recipe_switches_to_the_new_rows_options() -> None:
    """``"auto"``'s switch: the old recipe's quantiser does not leak into the new one."""
    two = GradientFlowConfig(compression="2bit-precond")
    assert two.with_recipe("3bit") == dataclasses.replace(GradientFlowConfig(compression="3bit"))
    assert two.with_recipe("topk-3bit", density=0.5).density == 0.5


# ---- everything that names recipes reads the table -------------------------------------------------------
def test_the_docs_table_is_the_recipe_table() -> None:
    page = (ROOT / "docs" / "recipes.md").read_text()
    table = page.split("<!-- recipes-table: made by gradientflow.recipes.markdown_table() -->\n")[1]
    assert table.split("\n<!-- /recipes-table -->")[0] == recipes.markdown_table()
    for r in RECIPES:
        anchor = r.doc.partition("#")[2]
        assert f"\n## {anchor.replace('-and-', ' and ')}\n" in page or f"\n## {anchor}\n" in page, r.doc
        for alias in r.aliases:
            assert f'| `"{alias}"` | `"{r.name}"` |' in page


NEW_ROW = Recipe(
    name="topk-4bit",
    mechanism="topk-quantized",
    summary="the top 20% of the chunks in 4-bit blocks",
    when="a test's row",
    options={"density": 0.2, "quant_bits": 4},
    named=("quant_bits",),
    doc="docs/recipes.md#topk-4bit",
)
ADD_ROW = f"""
from gradientflow.recipes import Recipe, add_row
add_row({NEW_ROW!r})
"""


def _with_new_row(code: str) -> str:
    """Run ``code`` in a fresh interpreter whose recipe table has one more row (``topk-4bit``)."""
    proc = subprocess.run([sys.executable, "-c", ADD_ROW + code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_row_added_to_the_table_reaches_the_wrapper_the_bench_simulate_and_the_docs_check() -> None:
    out = _with_new_row(
        """
from gradientflow.config import GradientFlowConfig
cfg = GradientFlowConfig(compression="topk-4bit")
print("config", cfg.compression, cfg.mechanism, cfg.density, cfg.quant_bits)
from gradientflow.cli import build_parser
import contextlib, io
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    try:
        build_parser().parse_args(["bench", "--help"])
    except SystemExit:
        pass
import re
print("bench-help", "gf-topk-4bit" in re.sub(r"-\\n\\s*", "-", buf.getvalue()))  # argparse wraps at a hyphen
from gradientflow.bench.runner_spec import split_mode
print("bench-mode", split_mode("gf-topk-4bit@flat"))
from gradientflow.bench.quality_recipes import parse_recipe
print("quality", parse_recipe("gf-topk-4bit"))
from gradientflow.cli import main
argv = ["--model", "resnet50", "--bandwidth", "1gbit", "--gpu-images-per-s", "1000", "--gpus", "8", "--recipes"]
main(["simulate", *argv])
from gradientflow.recipes import markdown_table
print("docs-table", "topk-4bit" in markdown_table())
"""
    )
    assert "config topk-4bit topk-quantized 0.2 4" in out
    assert "bench-help True" in out and "bench-mode ('gf-topk-4bit', 'flat')" in out
    assert "quality ('gf-topk-4bit', {})" in out
    assert re.search(r"\| 8 \| `topk-4bit` \| [\d.]+ \|", out), out
    # the docs check compares docs/recipes.md with markdown_table(): a new row fails it until the page has it
    assert "docs-table True" in out
