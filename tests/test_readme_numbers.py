"""The documented benchmark tables are the committed results of their commands, not hand copies.

Each table in ``docs/results/benchmarks.md`` and ``docs/results/quality.md`` was made by its command (shown beside it)
into ``benchmarks/<dir>/``; these tests rebuild the table from the committed ``results.json`` /
``table.md`` and look for it, verbatim, on its page.  The README's headline table is a few columns of
one of them, cell for cell.  A re-run that changes the results without the pages (or the other way
round) fails.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from gradientflow.bench.report import readme_tables

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "results" / "benchmarks.md").read_text()
QUALITY = (ROOT / "docs" / "results" / "quality.md").read_text()


@pytest.mark.parametrize("name", ["resnet50_1gbit", "alexnet_1gbit", "resnet50_loopback"])
def test_step_time_tables_are_the_committed_results(name: str) -> None:
    summary = json.loads((ROOT / "benchmarks" / name / "results.json").read_text())
    assert f"--out benchmarks/{name}`" in BENCHMARKS  # the command that made them stands beside them
    assert readme_tables(summary) in BENCHMARKS


def _rows(markdown: str, header: str) -> dict[str, list[str]]:
    """The rows of the table under ``header`` (its first line), by their first cell."""
    start = markdown.index(header)
    rows = {}
    for line in markdown[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_readme_headline_table_is_cells_of_the_committed_resnet50_1gbit_table() -> None:
    summary = json.loads((ROOT / "benchmarks" / "resnet50_1gbit" / "results.json").read_text())
    full = _rows(readme_tables(summary), "| mode | step ms (p10–p90) | alone ms | speedup | wire MB/step |")
    headline = _rows(README, "| mode | step ms (p10–p90) | speedup | wire MB/step |")
    assert "--out benchmarks/resnet50_1gbit`" in README
    assert len(headline) >= 5, headline
    for mode, (step, speedup, wire) in headline.items():
        assert mode in full, f"README headline row {mode!r} is not a mode of benchmarks/resnet50_1gbit"
        assert [step, speedup, wire] == [full[mode][0], full[mode][2], full[mode][3]], mode


@pytest.mark.parametrize(
    "name",
    [
        "quality",
        "quality_ablation",
        "quality_chunk_score",
        "score_agreement",
        "engine_resnet50_loopback",
        "adamw_bursts",
        "adamw_variants",
        "quality_long",
        "quality_long_4000/adamw_2x2_seed0",  # 4 ranks as 2 x 2, 4,000 steps
        "quality_long_4000/sgd_2x2_seed0",
        "quality_long_4000/sgd_2x2_seed1",
        "quality_long_4000/sgd_2x2_seed2",
        "step_overhead",
    ],
)
def test_quality_and_sweep_tables_are_the_committed_table_md(name: str) -> None:
    page = BENCHMARKS if name.startswith(("engine", "step_overhead")) else QUALITY
    table = (ROOT / "benchmarks" / name / "table.md").read_text()
    blocks = re.findall(r"(?:^\|.*\|\n)+", table, re.M)
    assert blocks, table
    for block in blocks:
        assert block in page, block


def test_every_option_is_in_the_options_table_with_its_default() -> None:
    """docs/options.md's table lists each of the wrapper's own keyword options once, its default cell starting
    with the signature's default."""
    import inspect

    import gradientflow as gf
    from gradientflow.config import DEFAULT_TRACE_STEPS, GradientFlowConfig

    page = (ROOT / "docs" / "options.md").read_text()
    found = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", page, re.M)
    rows = dict(found)
    assert len(rows) == len(found), "an option with two rows"
    # defaults the signature spells as None (resolved at construction): the page says what they become
    special = {
        "fusion_threshold_mb": "`25.0` (= `bucket_cap_mb`)",
        "timeout": "the process group's",
        "trace_steps": f"`{DEFAULT_TRACE_STEPS}`",
    }
    sig = inspect.signature(gf.DistributedDataParallel.__init__).parameters
    own = [f.name for f in dataclasses.fields(GradientFlowConfig) if f.name != "broadcast_buffers"]  # torch's
    for name in own:
        assert name in rows, f"docs/options.md's options table lacks `{name}`"
        shown = rows[name].strip()
        assert sig[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        expected = special.get(name, f"`{sig[name].default!r}`".replace("'", '"'))
        assert shown.startswith(expected), (
            f"`{name}`: docs/options.md says {shown}, the signature's default is {expected}"
        )
        if name not in special:
            assert sig[name].default == getattr(GradientFlowConfig(), name), name


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("adamw_matrix", 7),  # 5 settings of the 0.43M model, 2 of the 1.4M one
        ("adamw_matrix_2bit_precond", 7),
        ("adamw_matrix_2bit_precond_floor", 7),
        ("adamw_matrix_2bit_precond_fused", 7),  # the same on the fused code (28f688b)
        ("adamw_matrix_2bit_precond_2x2", 7),
        ("adamw_matrix_2x2", 7),
        ("adamw_matrix_auto_200mbit", 7),  # "auto" behind a 200 Mbit/s link: it picked 2 bits
        ("adamw_matrix_4flat", 7),  # "auto" at 4 flat ranks: "q3p"
    ],
)
def test_adamw_matrix_rows_on_the_page_are_the_committed_table(name: str, settings: int) -> None:
    """docs/results/adamw.md's AdamW matrices: every row (model, setting, per-seed ratios, mean, bytes) is the committed
    ``table.md`` row of ``experiments/adamw_matrix.py``'s output, and the page names the command's ``--out``."""
    page = (ROOT / "docs" / "results" / "adamw.md").read_text()
    table = (ROOT / "benchmarks" / name / "table.md").read_text()
    rows = [line for line in table.splitlines() if re.match(r"\| \d+x\d+ \|", line)]
    assert len(rows) == settings, table
    assert re.search(rf"--out benchmarks/{name}(?![\w/])", page), f"the page does not name the command of {name}"
    for row in rows:
        assert row in page, row
