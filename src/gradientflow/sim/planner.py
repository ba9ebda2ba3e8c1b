"""A user's question: on my cluster, what would DDP, DDP + fp16 and gradientflow give, at which θ?

Torch DDP is modelled with the same machinery as gradientflow's configurations: a ring
allreduce overlapped with backward, buckets of ``bucket_cap_mb`` = 25 MiB (torch's default) in
backward order, fp32 (or fp16 with ``fp16_compress_hook``).  Its 1 MiB first bucket is ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .config import SimConfig
from .model_profile import ModelProfile
from .schedule import TECHNIQUES, THREE_BIT, Iteration, Technique, simulate

DDP_BUCKET_MB = 25.0
DDP = Technique("ring", True, 4, True, False, "fp32")
DDP_FP16 = Technique("ring", True, 2, True, False, "fp16")
THETAS_MB = (0.0, 1.0, 4.0, 16.0, 25.0, 64.0, 256.0, math.inf)
DENSITIES = (0.5, 0.2, 0.1, 0.05, 0.01)


@dataclass(frozen=True)
class PlanRow:
    gpus: int
    system: str
    theta_mb: float
    result: Iteration


def best_theta(profile: ModelProfile, cfg: SimConfig, gpus: int, thetas: tuple[float, ...] = THETAS_MB) -> float:
    """The θ (of ``thetas``) with the shortest dense fp16 iteration; the smaller θ on a tie within 0.1%."""
    times = [(simulate(profile, dataclasses.replace(cfg, theta_mb=t), gpus, "lazy").iteration_s, t) for t in thetas]
    fastest = min(s for s, _ in times)
    return min(t for s, t in times if s <= fastest * 1.001)


def plan(
    profile: ModelProfile, cfg: SimConfig, gpus_list: list[int], densities: tuple[float, ...] = DENSITIES
) -> list[PlanRow]:
    """For every GPU count:
    1. DDP and DDP + fp16 at 25 MiB buckets;
    2. the best θ for gradientflow's dense fp16 lazy allreduce (``"fp16"``), and that configuration;
    3. gradientflow's ``"topk-fp16"`` at each density, and ``"3bit"``, at that θ.
    """
    rows: list[PlanRow] = []
    ddp_cfg = dataclasses.replace(cfg, theta_mb=DDP_BUCKET_MB)
    for n in gpus_list:
        rows.append(PlanRow(n, "DDP (fp32)", DDP_BUCKET_MB, simulate(profile, ddp_cfg, n, "ddp", DDP)))
        rows.append(PlanRow(n, "DDP + fp16 hook", DDP_BUCKET_MB, simulate(profile, ddp_cfg, n, "ddp-fp16", DDP_FP16)))
        theta = best_theta(profile, cfg, n)
        gf_cfg = dataclasses.replace(cfg, theta_mb=theta)
        rows.append(PlanRow(n, FP16_SYSTEM, theta, simulate(profile, gf_cfg, n, "lazy")))
        for d in densities:
            res = simulate(profile, dataclasses.replace(gf_cfg, density=d), n, "csc", TECHNIQUES["csc"])
            rows.append(PlanRow(n, topk_system(d), theta, res))
        rows.append(PlanRow(n, THREE_BIT_SYSTEM, theta, simulate(profile, gf_cfg, n, "3bit", THREE_BIT)))
    return rows


FP16_SYSTEM = 'gradientflow "fp16"'
THREE_BIT_SYSTEM = 'gradientflow "3bit"'
"""The planner's names of gradientflow's recipes: ``compression=`` as the recipe table names it."""


def topk_system(density: float) -> str:
    """The planner's name of ``compression="topk-fp16"`` at ``density``."""
    return f'gradientflow "topk-fp16" density {density:g}'


AUTO_PICK = {"sgd": topk_system(0.1), "adamw": THREE_BIT_SYSTEM}
"""What the planner takes for ``compression="auto"`` with an optimizer: Adam, AdamW and the rest -> ``"3bit"``;
SGD -> ``"topk-fp16"`` (fp16 + density 0.1), the top-k recipe it models (``"auto"`` itself runs ``"topk-3bit"``
with SGD, which the plan has no row of: docs/cost-model.md)."""
OPTIMIZERS = ("sgd", "adamw")

KEEPS_QUALITY: dict[str, dict[str, str]] = {
    # The plan's systems measured to keep DDP's quality with each optimizer, and the measurement
    # (docs/results/adamw.md, "Which recipe for which training"); the planner recommends nothing else.
    "adamw": {
        "DDP (fp32)": "the reference",
        "DDP + fp16 hook": "1.000x DDP's loss",
        FP16_SYSTEM: "1.000x DDP's loss",
        THREE_BIT_SYSTEM: "1.006-1.013x DDP's loss, 3 seeds x 7 settings",
    },
    "sgd": {
        "DDP (fp32)": "the reference",
        "DDP + fp16 hook": "same loss as DDP",
        FP16_SYSTEM: "same loss as DDP",
        topk_system(0.1): "digits 97.5% vs DDP's 96.7%; digits_wide DDP's loss 4x sooner",
    },
}
NOT_KEPT = {
    "adamw": '"topk-fp16" (any density): 1.07-1.13x DDP\'s loss at density 0.1 (docs/results/adamw.md)',
    "sgd": '"topk-fp16" at densities other than 0.1 and "3bit": not measured with SGD',
}


def recommendation(rows: list[PlanRow], optimizer: str) -> str:
    """What the planner assumed, then per GPU count the fastest system measured to keep ``optimizer``'s
    quality (:data:`KEEPS_QUALITY`) and what ``compression="auto"`` runs, step time and bytes against
    torch DDP's."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)} (adam and the others: adamw), got {optimizer!r}")
    kept = KEEPS_QUALITY[optimizer]
    lines = [
        f"Recommended for {optimizer}: only what was measured to keep its quality ({', '.join(kept)}); "
        f"left out: {NOT_KEPT[optimizer]}."
    ]
    for n in dict.fromkeys(r.gpus for r in rows):
        if n == 1:
            continue  # one GPU sends nothing
        ddp = next(r for r in rows if r.gpus == n and r.system == "DDP (fp32)")
        best = min((r for r in rows if r.gpus == n and r.system in kept), key=lambda r: r.result.iteration_s)
        auto = next(r for r in rows if r.gpus == n and r.system == AUTO_PICK[optimizer])

        lines.append(f"- {n} GPUs, {optimizer}: {best.system} ({kept[best.system]}): {_vs(best, ddp)}.")
        if best is not auto:
            lines.append(f'  compression="auto" runs {auto.system}: {_vs(auto, ddp)}.')
    return "\n".join(lines) + "\n"


def _vs(r: PlanRow, ddp: PlanRow) -> str:
    """``r``'s step time and bytes against torch DDP's."""
    return (
        f"{r.result.iteration_s * 1e3:.1f} ms per step ({ddp.result.iteration_s / r.result.iteration_s:.2f}x "
        f"DDP's speed), {r.result.bytes_per_gpu / max(1, ddp.result.bytes_per_gpu):.3f} of DDP's bytes"
    )


def plan_markdown(rows: list[PlanRow], optimizer: str | None = None) -> str:
    lines = [
        "| GPUs | system | θ MiB | iteration ms | speedup | efficiency | MB per GPU per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        it = r.result
        lines.append(
            f"| {r.gpus} | {r.system} | {r.theta_mb:g} | {it.iteration_s * 1e3:.1f} | {it.speedup:.1f} | "
            f"{it.efficiency:.1%} | {it.bytes_per_gpu / 1e6:.1f} |"
        )
    lines.append("")
    if optimizer is None:
        lines.append(
            "Speed alone (the model knows no quality): give --optimizer sgd|adamw for what keeps DDP's quality; "
            'with AdamW, "topk-fp16" reaches 1.07-1.13x DDP\'s loss (docs/results/adamw.md).'
        )
    for n in dict.fromkeys(r.gpus for r in rows):
        best = min((r for r in rows if r.gpus == n), key=lambda r: r.result.iteration_s)
        caveat = ""
        if optimizer is not None and best.system not in KEEPS_QUALITY[optimizer]:
            caveat = f"; not measured to keep {optimizer}'s quality, see the recommendation below"
        lines.append(
            f"- {n} GPUs: fastest on speed alone is {best.system} at θ = {best.theta_mb:g} MiB "
            f"({best.result.speedup:.1f}x, {best.result.efficiency:.0%} efficiency{caveat})."
        )
    return "\n".join(lines) + "\n"
