"""A script that never calls destroy_process_group() exits cleanly (issue 29; gradientflow.wrapper.shutdown).

3 torchrun launches of the README's usage block here (~10 s each); the 20-launch check is
``python -m gradientflow.bench.torch_suite.exit_check --launches 20`` (docs/torch-ddp-suite.md).
"""

from __future__ import annotations

from pathlib import Path

from gradientflow.bench.torch_suite.exit_check import launch_without_destroy, usage_block

ROOT = Path(__file__).resolve().parents[2]


def test_readme_usage_without_destroy_exits_cleanly() -> None:
    failed = launch_without_destroy(usage_block(ROOT / "README.md"), launches=3)
    assert not failed, failed
