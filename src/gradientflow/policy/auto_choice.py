"""Which compression recipe ``compression="auto"`` gives an optimizer, and the ranks' agreement on it.

Measured (``gradientflow bench --quality``, docs/results/quality.md, docs/results/adamw.md): SGD with momentum
keeps its quality under CSC; with its chunks quantised (``"topk-3bit"``: density 0.3 at 3 bits) it ends closer to
DDP than fp16 CSC at 0.1 on half the bytes, and reaches DDP's loss sooner on digits_wide; Adam-type
optimizers lose quality under sparsification (CSC at 0.1: 1.137x DDP's validation loss) but not
under 3-bit quantisation with error feedback, which sends every coordinate every step.  The
choice goes by the optimizer's class, so every rank that runs the same script chooses the same;
:func:`agree_on_recipe` makes sure of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..diagnostics.watchdog import Watchdog

SGD_RECIPE = "topk-3bit"
"""What ``"auto"`` gives ``torch.optim.SGD`` (with or without momentum; subclasses too)."""
ADAM_RECIPE = "3bit"
"""What ``"auto"`` gives Adam-type optimizers and any other (before the layout's and the link's rules:
:func:`adam_recipe`, :mod:`.width`)."""
AUTO_RECIPES = ("topk-fp16", ADAM_RECIPE, SGD_RECIPE)
"""The optimizer's pick ranks agree on (their index is what ranks exchange); ``"topk-fp16"``: what ``"auto"`` gave
SGD until 2026-11-27, still read from checkpoints saved then."""


CSCQ_MANY_DENSITY = 0.5
"""The density ``"auto"`` gives ``"topk-3bit"`` where its chunks' exchange has more than two parties: nodes of several
ranks (two-level) or more than two flat ranks; on two ranks the recipe's 0.3.  More than two parties quantise the chunks
twice (the quantised ring's reduce-scatter, then the sum; two-level adds the node sums), where a pair exchanges each
rank's rows once; a denser selection delays fewer coordinates and wins that back.  Two-level sends each rank's shard
of its node's rows, 1/G of them, so 0.5 costs the slow link less than 0.3 flat.  Measured, 3 seeds
(docs/results/quality.md): the SGD transformer at 4 ranks 1.0151x DDP's final loss on 0.040 of its bytes as 2 x 2
(0.3: 1.0213x), 1.0192x on 0.067 flat (0.3: 1.0266x); digits keeps DDP's accuracy on 0.040 and 0.067; on 2 ranks
0.3 ends 1.0149x on 0.047 with less of the codec's CPU (0.5: 1.0095x on 0.067)."""


MANY_PARTIES_ADAM = "3bit-precond"
"""What ``"auto"`` gives an Adam-type optimizer where the quantised exchange has more than two parties (more than
two flat ranks, or more than two nodes): 3 bits, preconditioned (each coordinate quantised in units of its own RMS,
``exchange.precondition``).  There every segment's sum is quantised once more after the contributions, and AdamW
divides each coordinate's step by its RMS, so a max-abs block's noise on its small coordinates weighs most; the
preconditioner spreads it by each coordinate's RMS.  Measured at 4 flat ranks (docs/results/adamw.md, the AdamW
transformer): 1.016x DDP's final loss against plain 3 bits' 1.028x, seed 0, one launch, the same bytes; on the
AdamW matrix (7 settings, 3 seeds) 1.0098-1.0192x.  Two parties (2 ranks, 2 nodes) keep plain 3 bits (or
``"2bit-precond"``'s choice on 2 ranks): measured there within 1.02x."""


def adam_recipe(parties: int) -> str:
    """The quantiser ``"auto"`` runs for an Adam-type optimizer whose exchange has ``parties`` parties (before
    ``"2bit-precond"``'s width rule on two flat ranks): :data:`MANY_PARTIES_ADAM` beyond two, else ``"3bit"``."""
    return MANY_PARTIES_ADAM if parties > 2 else ADAM_RECIPE


def recipe_options(recipe: str, world_size: int) -> dict[str, float]:
    """The options ``"auto"`` sets beside ``recipe`` on ``world_size`` ranks: ``"topk-3bit"`` at
    :data:`CSCQ_MANY_DENSITY` beyond a pair of ranks (nodes of several ranks are always more than two), nothing else."""
    return {"density": CSCQ_MANY_DENSITY} if recipe == SGD_RECIPE and world_size > 2 else {}


def recipe_for_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """:data:`SGD_RECIPE` for ``torch.optim.SGD`` (with or without momentum; subclasses too), else
    :data:`ADAM_RECIPE`.

    Adam, AdamW and the other adaptive optimizers (and anything unknown) get the quantised recipe:
    it delays no coordinate, so it cannot starve a per-coordinate normaliser.
    """
    return SGD_RECIPE if isinstance(optimizer, torch.optim.SGD) else ADAM_RECIPE


FSDP_SGD_RECIPE = "4bit"
"""What ``"auto"`` gives ``torch.optim.SGD`` under ``gradientflow.fsdp`` (HSDP: the gradient shards' exchange
between nodes), where DDP's ``"auto"`` gives :data:`SGD_RECIPE`.  Measured on 2 nodes x 2 (Gloo loopback), the
SGD-momentum transformer, 200 steps, 3 seeds (docs/results/fsdp.md): every coordinate of the shard at 4 bits ended
0.9999-1.0060x torch's HSDP final loss on 0.129 of its fp32 bytes between nodes; at 3 bits 1.0066-1.0213x (0.098),
the shard's top-k chunks (``"topk-3bit"``) 1.026-1.049x (0.037)."""


def fsdp_recipe_for_optimizer(optimizer: torch.optim.Optimizer, nodes: int) -> str:
    """The recipe ``"auto"`` runs under ``gradientflow.fsdp`` on ``nodes`` nodes: :data:`FSDP_SGD_RECIPE` for
    ``torch.optim.SGD`` (subclasses too), else :func:`adam_recipe` of the nodes (the 2-bit width rule of two flat
    ranks does not apply: it measures a flat exchange).  The ranks agree on :func:`recipe_for_optimizer`'s pick,
    of which this is a function (with the mesh, the same on every rank)."""
    return FSDP_SGD_RECIPE if isinstance(optimizer, torch.optim.SGD) else adam_recipe(nodes)


MEASURED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""The optimizer classes (and their subclasses) whose quality ``gradientflow bench --quality`` and
docs/results/adamw.md measured under the recipe ``"auto"`` gives them."""


def unmeasured_warning(optimizer: torch.optim.Optimizer, recipe: str) -> str | None:
    """The warning for an optimizer ``"auto"`` gives ``recipe`` without a measurement behind it (Adagrad,
    RMSprop, ...), else ``None``: the quantised recipe delays no coordinate, but nobody checked its loss."""
    if isinstance(optimizer, MEASURED_OPTIMIZERS):
        return None
    name = type(optimizer).__name__
    return (
        f'gradientflow: compression="auto" picked the {recipe!r} recipe for {name}, whose training quality under '
        "it was not measured: quality was measured for SGD (-> 'topk-3bit', digits: DDP's accuracy) and Adam / "
        "AdamW (-> '3bit': 1.006-1.013x DDP's final loss, docs/results/adamw.md) only. Compare a short run against "
        f"compression='none' (torch DDP's exact gradients); pass compression={recipe!r} to keep this choice "
        "without this warning."
    )


def agree_on_recipe(
    recipe: str, reason: str, group: dist.ProcessGroup, watchdog: Watchdog, device: torch.device
) -> None:
    """Raise ``ValueError`` on every rank unless every rank picked ``recipe`` (one tiny allgather)."""
    mine = torch.tensor([AUTO_RECIPES.index(recipe)], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    watchdog.wait(work, 'compression="auto" agreement', 8)
    picks = [AUTO_RECIPES[int(g)] for g in gathered]
    if len(set(picks)) > 1:
        per_rank = ", ".join(f"rank {r}: {p}" for r, p in enumerate(picks))
        raise ValueError(
            f'gradientflow: compression="auto" picked different recipes on different ranks ({per_rank}; this '
            f"rank: {reason}). Every rank must step the model with the same optimizer class, or pass the "
            "recipe by name (compression='topk-3bit' or '3bit')."
        )
