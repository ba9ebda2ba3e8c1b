"""The README's benchmark tables are the committed results of their commands, not hand copies.

Each table in the README was made by its command (shown beside it) into ``benchmarks/<dir>/``; these
tests rebuild the table from the committed ``results.json`` / ``table.md`` and look for it, verbatim,
in the README.  A re-run that changes the results without the README (or the other way round) fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gradientflow.bench.report import readme_tables

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", ["resnet50_1gbit", "alexnet_1gbit", "resnet50_loopback"])
def test_readme_step_time_tables_are_the_committed_results(name: str) -> None:
    summary = json.loads((ROOT / "benchmarks" / name / "results.json").read_text())
    assert f"--out benchmarks/{name}`" in README  # the command that made them stands beside them
    assert readme_tables(summary) in README


@pytest.mark.parametrize("name", ["quality", "quality_ablation", "engine_resnet50_loopback", "adamw_bursts"])
def test_readme_quality_and_sweep_tables_are_the_committed_table_md(name: str) -> None:
    # engine_resnet50_loopback: the README quotes only its θ sweep table (the last one)
    table = (ROOT / "benchmarks" / name / "table.md").read_text()
    blocks = re.findall(r"(?:^\|.*\|\n)+", table, re.M)
    if name.startswith("engine"):
        blocks = blocks[-1:]
    assert blocks, table
    for block in blocks:
        assert block in README, block
