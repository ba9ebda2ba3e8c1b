"""The contract between ``bench --quality``'s parent and its ranks: a :class:`Job` (one workload trained by several
recipes in one launch, with its sizes, steps and optimizer settings) and the :class:`QualitySpec` the parent writes
to JSON for every rank (:mod:`.quality_worker`) to read.  Plain data: planned by :mod:`.quality`, built into models
and optimizers by :mod:`.quality_recipes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Job:
    """One workload trained by several recipes in one launch (``name``: transformer, digits or tta)."""

    name: str
    workload: str  # "transformer" | "digits"
    steps: int
    batch_size: int
    eval_every: int
    recipes: list[str]
    lr: float  # peak LR of the user's optimizer (AdamW / SGD momentum 0.9)
    paper_lr: float  # peak LR of gf-paper's (and ddp-sgd's) SGD
    paper_warmup_steps: int  # gf-paper's dense CSC warm-up
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    val_windows: int = 256
    lr_warmup_frac: float = 0.05
    probe_steps: int = 20  # compute-only steps spread over the run (no communication): the step's compute share
    model: str = "small_cnn"  # digits: the network (bench.models); the transformer is sized by d_model/n_layers
    beta2: float = 0.95  # AdamW betas = (0.9, beta2), the transformer's and the AdamW digits jobs'
    optimizer: str = "adamw"  # "adamw" (at lr), or "sgd" (momentum 0.9: the transformer's at paper_lr, digits' at lr)
    device: str = "cpu"  # "cuda": every rank on GPU local-rank mod the GPU count (Gloo: ranks may share one)
    corpus: str = "help-topics"  # the transformer's text: "help-topics" (characters) or "stdlib" (bytes, 31.5 MB)


@dataclass
class QualitySpec:
    """Everything a worker needs; written to JSON by the parent, read by every rank."""

    jobs: list[dict[str, Any]]
    out_path: str
    seed: int = 0
    threads: int = 1
    pg_timeout_s: float = 120.0
