"""The README's benchmark tables are the committed results of their commands, not hand copies.

Each table in the README was made by its command (shown beside it) into ``benchmarks/<dir>/``; these
tests rebuild the table from the committed ``results.json`` / ``table.md`` and look for it, verbatim,
in the README.  A re-run that changes the results without the README (or the other way round) fails.
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


@pytest.mark.parametrize("name", ["resnet50_1gbit", "alexnet_1gbit", "resnet50_loopback"])
def test_readme_step_time_tables_are_the_committed_results(name: str) -> None:
    summary = json.loads((ROOT / "benchmarks" / name / "results.json").read_text())
    assert f"--out benchmarks/{name}`" in README  # the command that made them stands beside them
    assert readme_tables(summary) in README


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
    ],
)
def test_readme_quality_and_sweep_tables_are_the_committed_table_md(name: str) -> None:
    # engine_resnet50_loopback: the README quotes only its θ sweep table (the last one)
    table = (ROOT / "benchmarks" / name / "table.md").read_text()
    blocks = re.findall(r"(?:^\|.*\|\n)+", table, re.M)
    if name.startswith("engine"):
        blocks = blocks[-1:]
    assert blocks, table
    for block in blocks:
        assert block in README, block


def test_every_option_is_in_the_readme_options_table_with_its_default() -> None:
    """The options table lists each of the wrapper's own keyword options once, with the signature's default."""
    import inspect

    import gradientflow as gf
    from gradientflow.config import DEFAULT_TRACE_STEPS, GradientFlowConfig

    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", README, re.M))
    # defaults the signature spells as None (resolved at construction): the README says what they become
    special = {
        "fusion_threshold_mb": "`25.0` (= `bucket_cap_mb`)",
        "timeout": "the process group's",
        "trace_steps": f"`{DEFAULT_TRACE_STEPS}`",
    }
    sig = inspect.signature(gf.DistributedDataParallel.__init__).parameters
    own = [f.name for f in dataclasses.fields(GradientFlowConfig) if f.name != "broadcast_buffers"]
    for name in own:
        assert name in rows, f"README options table lacks `{name}`"
        shown = rows[name].strip()
        assert sig[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        expected = special.get(name, f"`{sig[name].default!r}`".replace("'", '"'))
        assert shown == expected, f"`{name}`: README says {shown}, the signature's default is {expected}"
        if name not in special:
            assert sig[name].default == getattr(GradientFlowConfig(), name), name
