"""torch's own DDP tests (from the installed wheel) on gradientflow: the CI-sized selection.

The full table, torch DDP beside gradientflow on every DDP test, is
``python -m gradientflow.bench.torch_suite --all`` (docs/torch-ddp-suite.md); here the tests of
``selection.CI`` (each passes on torch DDP) must pass on gradientflow too.
"""

from __future__ import annotations

from gradientflow.bench.torch_suite import CI
from gradientflow.bench.torch_suite.runner import run_tests


def test_torch_ddp_suite_ci_selection_passes_on_gradientflow() -> None:
    outcomes = run_tests("gradientflow", list(CI), pg_timeout=30.0, progress=False)
    failed = {o.test: o.detail[-1500:] for o in outcomes if o.outcome != "pass"}
    assert not failed, failed
