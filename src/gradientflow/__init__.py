"""gradientflow: GradientFlow-style gradient communication for PyTorch data-parallel training."""

from .config import GradientFlowConfig
from .ddp import DistributedDataParallel
from .errors import CommunicationError, ConsistencyError

__all__ = ["CommunicationError", "ConsistencyError", "DistributedDataParallel", "GradientFlowConfig"]
__version__ = "0.1.0"
