"""gradientflow: GradientFlow-style gradient communication for PyTorch data-parallel training.

The public names are imported on first use (PEP 562): ``import gradientflow`` alone does not import
torch, so the ``gradientflow`` command starts without it when the subcommand does not need it
(``--help``, ``trace-summary``).  ``gradientflow.DistributedDataParallel`` and the other names below
behave as if imported here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import GradientFlowConfig
    from .diagnostics.errors import CommunicationError, ConsistencyError
    from .wrapper.ddp import DistributedDataParallel

__all__ = ["CommunicationError", "ConsistencyError", "DistributedDataParallel", "GradientFlowConfig"]
__version__ = "0.1.0"

_HOME = {
    "CommunicationError": ".diagnostics.errors",
    "ConsistencyError": ".diagnostics.errors",
    "DistributedDataParallel": ".wrapper.ddp",
    "GradientFlowConfig": ".config",
}
"""Where each public name lives."""


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# Trainer(strategy="gradientflow") once Lightning is imported; imports no client (nor torch).
from .integrations import _autoregister  # noqa: E402

_autoregister.install()
