"""gradientflow: GradientFlow-style gradient communication for PyTorch data-parallel training."""

from .config import GradientFlowConfig
from .diagnostics.errors import CommunicationError, ConsistencyError
from .wrapper.ddp import DistributedDataParallel

__all__ = ["CommunicationError", "ConsistencyError", "DistributedDataParallel", "GradientFlowConfig"]
__version__ = "0.1.0"
