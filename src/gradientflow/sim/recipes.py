"""Every recipe of the table (:mod:`gradientflow.recipes`) as the cost model's :class:`~.schedule.Technique`.

``gradientflow simulate --recipes`` prints one row per recipe; ``simulate --validate`` models a bench's
``gf-<recipe>`` modes with the same mapping.  A recipe is modelled by its mechanism and its settings, so a row
added to the table is modelled without a line here:

- ``"dense"``: lazy allreduce of every gradient, 4 bytes (fp32) or 2 (fp16, bf16) each on the wire;
- ``"topk"``: CSC at the recipe's density, its chunks in ``comm_dtype``;
- ``"quantized"``: every gradient in ``quant_bits``-bit blocks of ``quant_block`` with a bf16 scale each;
- ``"topk-quantized"``: CSC at the recipe's density, the selected chunks in those blocks;
- ``"auto"``: what it picks for the optimizer (:func:`gradientflow.policy.auto_choice.recipe_for_optimizer`'s
  rows: SGD ``"topk-3bit"``, AdamW ``"3bit"``).
"""

from __future__ import annotations

import dataclasses

from gradientflow import mechanisms, recipes
from gradientflow.config import GradientFlowConfig
from gradientflow.policy.auto_choice import ADAM_RECIPE, SGD_RECIPE
from gradientflow.recipes import RECIPES, Recipe

from .config import SimConfig
from .model_profile import ModelProfile
from .planner import DDP
from .schedule import TECHNIQUES, THREE_BIT, TOPK_3BIT, Iteration, Technique, simulate

AUTO_FOR = {"sgd": SGD_RECIPE, "adamw": ADAM_RECIPE}
"""The row ``"auto"`` runs for the bench's and the planner's two optimizers."""


def quantized_wire_bytes(bits: int, block: int) -> float:
    """Bytes per gradient of the quantised wire: the codes and one bf16 scale per block (3 bits, 128: 0.39)."""
    return bits / 8 + 2 / block


def recipe_technique(recipe: Recipe, optimizer: str = "sgd") -> Technique:
    """The technique the cost model runs for ``recipe`` (``"auto"``: its pick for ``optimizer``): its mechanism's
    form at the door ``"sim"`` (:mod:`gradientflow.mechanisms`)."""
    return mechanisms.builder(recipe.mechanism, "sim")(recipe, optimizer)


@mechanisms.form("auto", "sim")
def _auto(recipe: Recipe, optimizer: str) -> Technique:
    return recipe_technique(next(r for r in RECIPES if r.name == AUTO_FOR[optimizer]), optimizer)


@mechanisms.form("dense", "sim")
def _dense(recipe: Recipe, optimizer: str) -> Technique:
    cfg = GradientFlowConfig(compression=recipe.name)
    return DDP if cfg.comm_dtype == "fp32" else TECHNIQUES["lazy"]


@mechanisms.form("topk", "sim")
def _topk(recipe: Recipe, optimizer: str) -> Technique:
    cfg = GradientFlowConfig(compression=recipe.name)
    return dataclasses.replace(TECHNIQUES["csc"], wire_bytes=2 if cfg.comm_dtype != "fp32" else 4, density=cfg.density)


@mechanisms.form("quantized", "sim")
def _quantized(recipe: Recipe, optimizer: str) -> Technique:
    q = GradientFlowConfig(compression=recipe.name).quantizer()
    return dataclasses.replace(THREE_BIT, wire_bytes=quantized_wire_bytes(q.bits, q.block), block=q.block)


@mechanisms.form("topk-quantized", "sim")
def _topk_quantized(recipe: Recipe, optimizer: str) -> Technique:
    cfg = GradientFlowConfig(compression=recipe.name)
    q = cfg.quantizer()
    wire = quantized_wire_bytes(q.bits, q.block)
    return dataclasses.replace(TOPK_3BIT, wire_bytes=wire, block=q.block, density=cfg.density)


def recipe_label(recipe: Recipe) -> str:
    """A recipe's row in ``simulate --recipes``: ``gradientflow compression="3bit"``."""
    return f'gradientflow compression="{recipe.name}"'


def recipe_rows(profile: ModelProfile, cfg: SimConfig, gpus_list: list[int], optimizer: str = "sgd") -> list[Iteration]:
    """One modelled iteration per recipe of the table per GPU count, at ``cfg``'s θ (``"auto"``: its pick for
    ``optimizer``)."""
    return [
        simulate(profile, cfg, n, recipe.name, recipe_technique(recipe, optimizer))
        for n in gpus_list
        for recipe in per_step_rows()
    ]


def per_step_rows() -> list[Recipe]:
    """The rows the cost model runs: those of every step (the outer rows run every ``sync_every`` steps, which the
    cost model's one iteration does not model), the table's and any added since (:func:`gradientflow.recipes.
    add_row`)."""
    return [r for r in recipes.BY_NAME.values() if "per step" in r.scopes]


def recipes_markdown(rows: list[Iteration], optimizer: str) -> str:
    """``simulate --recipes``'s table: every recipe's modelled step, speedup and bytes per GPU."""
    out = [
        f'Every recipe of the table (docs/recipes.md), modelled; "auto" as it runs for {optimizer}:\n',
        "| GPUs | recipe | iteration ms | speedup | MB per GPU per step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.gpus} | `{r.config}` | {r.iteration_s * 1e3:.1f} | {r.speedup:.2f} | {r.bytes_per_gpu / 1e6:.2f} |"
        )
    return "\n".join(out) + "\n"
