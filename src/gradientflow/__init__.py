"""gradientflow: GradientFlow-style gradient communication for PyTorch data-parallel training."""

from .config import GradientFlowConfig
from .diagnostics.errors import CommunicationError, ConsistencyError
from .integrations import _autoregister
from .wrapper.ddp import DistributedDataParallel

__all__ = ["CommunicationError", "ConsistencyError", "DistributedDataParallel", "GradientFlowConfig"]
__version__ = "0.1.0"

_autoregister.install()  # Trainer(strategy="gradientflow") once Lightning is imported; imports no client
