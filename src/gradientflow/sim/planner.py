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
from .schedule import QUANTIZED, TECHNIQUES, Iteration, Technique, simulate

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
    2. the best θ for gradientflow's dense fp16 lazy allreduce, and that configuration;
    3. gradientflow with CSC at each density, at that θ.
    """
    rows: list[PlanRow] = []
    ddp_cfg = dataclasses.replace(cfg, theta_mb=DDP_BUCKET_MB)
    for n in gpus_list:
        rows.append(PlanRow(n, "DDP (fp32)", DDP_BUCKET_MB, simulate(profile, ddp_cfg, n, "ddp", DDP)))
        rows.append(PlanRow(n, "DDP + fp16 hook", DDP_BUCKET_MB, simulate(profile, ddp_cfg, n, "ddp-fp16", DDP_FP16)))
        theta = best_theta(profile, cfg, n)
        gf_cfg = dataclasses.replace(cfg, theta_mb=theta)
        rows.append(PlanRow(n, "gradientflow fp16 (lazy)", theta, simulate(profile, gf_cfg, n, "lazy")))
        for d in densities:
            res = simulate(profile, dataclasses.replace(gf_cfg, density=d), n, "csc", TECHNIQUES["csc"])
            rows.append(PlanRow(n, f"gradientflow CSC density {d:g}", theta, res))
        rows.append(PlanRow(n, QUANTIZED_SYSTEM, theta, simulate(profile, gf_cfg, n, "quantized", QUANTIZED)))
    return rows


QUANTIZED_SYSTEM = "gradientflow quantized 3-bit"
AUTO_PICK = {"sgd": "gradientflow CSC density 0.1", "adamw": QUANTIZED_SYSTEM}
"""What ``compression="auto"`` runs for an optimizer (:mod:`gradientflow.strategies.recipes`): SGD
(with or without momentum) -> CSC, fp16 + density 0.1; Adam, AdamW and the rest -> 3-bit quantised."""
OPTIMIZERS = ("sgd", "adamw")


def recommendation(rows: list[PlanRow], optimizer: str) -> str:
    """Per GPU count: what ``compression="auto"`` runs for ``optimizer``, its predicted step time and
    bytes, against torch DDP's (the quality side: docs/adamw.md's measured table)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)} (adam and the others: adamw), got {optimizer!r}")
    pick = AUTO_PICK[optimizer]
    lines = []
    for n in dict.fromkeys(r.gpus for r in rows):
        ddp = next(r for r in rows if r.gpus == n and r.system == "DDP (fp32)")
        mine = next((r for r in rows if r.gpus == n and r.system == pick), None)
        if mine is None or n == 1:
            continue  # one GPU sends nothing
        lines.append(
            f'- {n} GPUs, {optimizer}: compression="auto" runs {pick}: {mine.result.iteration_s * 1e3:.1f} ms per '
            f"step ({ddp.result.iteration_s / mine.result.iteration_s:.2f}x DDP's), "
            f"{mine.result.bytes_per_gpu / max(1, ddp.result.bytes_per_gpu):.3f} of DDP's bytes."
        )
    return "\n".join(lines) + "\n"


def plan_markdown(rows: list[PlanRow]) -> str:
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
    for n in dict.fromkeys(r.gpus for r in rows):
        best = min((r for r in rows if r.gpus == n), key=lambda r: r.result.iteration_s)
        lines.append(
            f"- {n} GPUs: fastest is {best.system} at θ = {best.theta_mb:g} MiB "
            f"({best.result.speedup:.1f}x, {best.result.efficiency:.0%} efficiency)."
        )
    return "\n".join(lines) + "\n"
