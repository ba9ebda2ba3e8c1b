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


def test_options_are_validated_when_the_strategy_or_accelerator_is_built() -> None:
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("accelerate")
    from gradientflow.integrations.accelerate import GradientFlowAccelerator
    from gradientflow.integrations.lightning import GradientFlowStrategy

    with pytest.raises(ValueError, match="density must be"):
        GradientFlowStrategy(density=2)
    with pytest.raises(ValueError, match="unknown option"):
        GradientFlowStrategy(densty=0.1)
    with pytest.raises(ValueError, match="comm_dtype must be"):
        GradientFlowAccelerator(comm_dtype="fp8")


def test_strategy_pickles_for_lightnings_spawn_launcher() -> None:
    pytest.importorskip("pytorch_lightning")
    import pickle

    from gradientflow.integrations.lightning import GradientFlowStrategy

    again = pickle.loads(pickle.dumps(GradientFlowStrategy(comm_dtype="fp16", density=0.1, static_graph=True)))
    assert type(again) is GradientFlowStrategy
    assert again.gf_options == {"comm_dtype": "fp16", "density": 0.1}
    assert again._ddp_kwargs == {"static_graph": True}
