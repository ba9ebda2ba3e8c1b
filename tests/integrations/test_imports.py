"""``import gradientflow`` imports no client, and Lightning learns "gradientflow" when it is imported later."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
import gradientflow
assert not any(m in sys.modules for m in ("pytorch_lightning", "lightning", "accelerate")), "a client was imported"
import pytorch_lightning as pl
strategy = pl.strategies.StrategyRegistry.get("gradientflow")
print(type(strategy).__name__, type(strategy).__mro__[1].__name__)
"""


def test_import_gradientflow_imports_no_client_and_registers_on_lightnings_import() -> None:
    pytest.importorskip("pytorch_lightning")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["GradientFlowStrategy", "DDPStrategy"]
