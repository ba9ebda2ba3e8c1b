"""Optimizer settings the top-k recipes (CSC) are measured to handle badly: what ``check_optimizer`` warns about.

A pure function of the optimizer's parameter groups and two CSC options, so the wrapper can run it
at every optimizer's first ``step()`` (see ``wrapper.checkpoint.OptimizerWatch``) and a
test can state each rule without a process group.
"""

from __future__ import annotations

import torch

ADAPTIVE_MIN_DENSITY = 0.3
"""Below this density Adam-type users are warned (the quality bench's AdamW transformer: 0.1 ends
13.7% above dense's validation loss, 0.3 5.4%; fp16 alone 0%, and first to dense's loss at 1 Gbit/s)."""


def optimizer_pitfalls(
    optimizer: torch.optim.Optimizer, density: float, momentum: float, quantized_chunks: bool = False
) -> list[str]:
    """The warnings for ``optimizer`` under CSC at ``density`` with momentum correction ``momentum``
    (``quantized_chunks``: ``compression="topk-3bit"``).

    1. An Adam-type optimizer (its groups have ``betas``) below ``ADAPTIVE_MIN_DENSITY``: a chunk
       reaches Adam in bursts every few steps, and Adam, normalising by what it sees, moves it
       less; ``gradientflow bench --quality`` measures the loss (docs/results/quality.md#the-adamw-studies).
    2. Momentum correction on (``momentum > 0``) while ``optimizer`` applies momentum as well.
    3. ``"topk-3bit"`` with an Adam-type optimizer: its density (0.3) is no pitfall of rule 1, but measured it loses as
       CSC does (docs/results/quality.md#sgd-momentum-cscs-chunks-quantised-cscq-2026-11-27).
    """
    groups = optimizer.param_groups
    found = []
    if density < ADAPTIVE_MIN_DENSITY and any("betas" in g for g in groups):
        found.append(
            f"gradientflow: CSC at density={density} with an Adam-type optimizer "
            f"({type(optimizer).__name__}) trains to a worse loss than dense (`gradientflow bench --quality`, "
            "docs/results/quality.md#the-adamw-studies). For Adam-type optimizers pass compression='auto' instead of "
            "density (3-bit quantised gradients with error feedback: 1.006-1.013x DDP's final loss on 0.0999 of its "
            "bytes, docs/results/adamw.md), or comm_dtype='fp16' without density (no measurable loss); "
            f"density={ADAPTIVE_MIN_DENSITY} loses less than {density}, and so does csc_scope='global' on a "
            "model cut into several slices."
        )
    if quantized_chunks and density >= ADAPTIVE_MIN_DENSITY and any("betas" in g for g in groups):
        found.append(
            f"gradientflow: compression='topk-3bit' (the top {density:g} of the chunks in 3-bit blocks) with an "
            f"Adam-type optimizer ({type(optimizer).__name__}) ended 1.063x torch DDP's final validation loss on the "
            "quality bench's AdamW transformer, where compression='auto' ended 1.012x (docs/results/quality.md). "
            "For Adam-type optimizers pass compression='auto' (the quantised recipe)."
        )
    if momentum > 0 and any(g.get("momentum", 0) or (g.get("betas") is not None and g["betas"][0] > 0) for g in groups):
        found.append(
            f"gradientflow: CSC applies momentum correction (momentum={momentum}); the "
            "optimizer applies momentum again. Use SGD(momentum=0), or momentum=0 in "
            "gradientflow.DistributedDataParallel to keep the optimizer's momentum."
        )
    return found
