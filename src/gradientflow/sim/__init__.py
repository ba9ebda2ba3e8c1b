"""Cost model of data-parallel training on clusters beyond this machine (``gradientflow simulate``).

config.py      SimConfig: every assumption, validated
cost.py        allreduce cost formulas (ring, tree; flat and two-level)
model_profile  parameter sizes, backward order and ready times (FLOP shares or measured here)
schedule.py    the event model of one iteration, on the engine's own layout and CSC arithmetic
presets.py     the paper's setting: every assumed figure with its source, and the paper's targets
planner.py     DDP / DDP + fp16 / gradientflow at several densities, and the best θ
report.py      tables, JSON, plot
command.py     the CLI subcommand
measure.py     α and B measured on this machine's emulated cluster (validation)
validate.py    the model against ``gradientflow bench``, mode by mode
"""

from .config import CONFIGS, SimConfig
from .cost import allreduce_s, ring_flat_s, tree_flat_s
from .model_profile import ModelProfile, flop_profile, measured_profile
from .schedule import TECHNIQUES, Iteration, simulate

__all__ = [
    "CONFIGS",
    "SimConfig",
    "allreduce_s",
    "ring_flat_s",
    "tree_flat_s",
    "ModelProfile",
    "flop_profile",
    "measured_profile",
    "TECHNIQUES",
    "Iteration",
    "simulate",
]
