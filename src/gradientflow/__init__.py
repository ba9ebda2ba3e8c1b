"""gradientflow: GradientFlow-style gradient communication for PyTorch data-parallel training."""

from .config import GradientFlowConfig
from .ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel", "GradientFlowConfig"]
__version__ = "0.1.0"
