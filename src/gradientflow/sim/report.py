"""Tables, JSON and plots of the cost model's answers."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from ..diagnostics.extras import can_plot
from .config import CONFIGS, SimConfig
from .model_profile import ModelProfile
from .presets import PAPER_TARGETS, SENSITIVITY
from .schedule import Iteration, simulate

logger = logging.getLogger(__name__)


def ablation(
    profile: ModelProfile, cfg: SimConfig, gpus_list: list[int], configs: tuple[str, ...] = CONFIGS
) -> list[Iteration]:
    """Every configuration at every GPU count, GPU count major."""
    return [simulate(profile, cfg, n, c) for n in gpus_list for c in configs]


def to_json(model: str, assumptions: dict[str, Any], rows: list[Iteration]) -> dict[str, Any]:
    """The ``--json`` object: model, assumptions, and one row per (GPU count, configuration)."""
    return {
        "model": model,
        "assumptions": assumptions,
        "rows": [
            {
                "gpus": r.gpus,
                "config": r.config,
                "iteration_s": r.iteration_s,
                "speedup": r.speedup,
                "efficiency": r.efficiency,
                "bytes_per_gpu": int(r.bytes_per_gpu),
            }
            for r in rows
        ],
    }


def ablation_markdown(rows: list[Iteration]) -> str:
    """Configurations down, GPU counts across; each cell 'speedup (efficiency)'; then iteration ms."""
    gpus = sorted({r.gpus for r in rows})
    configs = list(dict.fromkeys(r.config for r in rows))
    cell = {(r.config, r.gpus): r for r in rows}
    head = "| config | " + " | ".join(f"{n} GPU{'s' * (n > 1)}: speedup (eff.), ms" for n in gpus) + " | MB/GPU/step |"
    lines = [head, "|---|" + "---|" * len(gpus) + "---|"]
    for c in configs:
        cells = [
            f"{cell[c, n].speedup:.1f} ({cell[c, n].efficiency:.0%}), {cell[c, n].iteration_s * 1e3:.1f}" for n in gpus
        ]
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {cell[c, gpus[-1]].bytes_per_gpu / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def paper_comparison(model: str, profile: ModelProfile, cfg: SimConfig) -> str:
    """Predictions next to the paper's figures, and how far one assumption at a time moves them."""
    lines = [
        "| model | GPUs | config | paper | predicted | difference | paper's source |",
        "|---|---|---|---|---|---|---|",
    ]
    sens = [
        "| model | GPUs | config | preset | " + " | ".join(label for _, label, _ in SENSITIVITY) + " |",
        "|---|---|---|---|" + "---|" * len(SENSITIVITY),
    ]
    for m, n, c, target, src in PAPER_TARGETS:
        if m != model:
            continue
        pred = simulate(profile, cfg, n, c).speedup
        lines.append(f"| {m} | {n} | {c} | {target:g}x | {pred:.1f}x | {(pred - target) / target:+.0%} | {src} |")
        cells = []
        for field, _, factor in SENSITIVITY:
            if getattr(cfg, field) is None:
                cells.append("—")
                continue
            value = getattr(cfg, field) * factor
            moved = dataclasses.replace(cfg, **{field: int(value) if isinstance(getattr(cfg, field), int) else value})
            cells.append(f"{simulate(profile, moved, n, c).speedup:.1f}")
        sens.append(f"| {m} | {n} | {c} | {pred:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nSensitivity (speedup with one assumption moved):\n\n" + "\n".join(sens) + "\n"


def plot(
    model: str, rows: list[Iteration], path: str | Path, targets: list[tuple[int, float, str]] | None = None
) -> bool:
    """Speedup against GPU count, one line per configuration, ideal dashed, ``targets`` (GPUs,
    speedup, label) as black stars; False (and a line saying so) without matplotlib."""
    if not can_plot():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = sorted({r.gpus for r in rows})
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(gpus, gpus, "k--", lw=1, label="ideal")
    for c in dict.fromkeys(r.config for r in rows):
        pts = sorted((r.gpus, r.speedup) for r in rows if r.config == c)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
    for i, (n, sp, label) in enumerate(targets or []):
        ax.plot([n], [sp], "k*", ms=11, label="paper" if i == 0 else None)
        ax.annotate(label, (n, sp), textcoords="offset points", xytext=(-8, -14), fontsize=7, ha="right")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(gpus, [str(n) for n in gpus])
    ticks = [2.0**k for k in range(0, 11, 2)]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup  N·t(1)/t(N)")
    ax.set_title(f"{model}: predicted speedup (gradientflow simulate)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
