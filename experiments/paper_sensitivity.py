"""What one assumption of the paper's preset would have to be for the model to give a stated figure.

    python experiments/paper_sensitivity.py --out benchmarks/sim_paper_sensitivity

For each of the paper's 512-GPU figures (:data:`~gradientflow.sim.presets.PAPER_TARGETS`, ``csc``) and
each assumption, with every other assumption at the preset (``--preset paper``): the value of that one
assumption at which the predicted speedup equals the paper's (bisection on a log scale, the speedup
being monotone in each), or "not reached" inside the searched range.  Nothing is changed in the
preset: this says how far an assumption would have to move, to judge whether it plausibly could.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from gradientflow.bench.models import resolve_model
from gradientflow.sim.config import SimConfig
from gradientflow.sim.model_profile import ModelProfile, flop_profile
from gradientflow.sim.presets import IMAGENET_SHAPE, PAPER_TARGETS, paper_values
from gradientflow.sim.schedule import simulate

KNOBS: tuple[tuple[str, str, float, float, str], ...] = (
    # field, label, searched from, to (as factors of the preset), unit shown
    ("bandwidth", "inter-node B", 1e-4, 1.0, "gbit"),
    ("latency", "α per inter-node collective", 1.0, 1e4, "us"),
    ("intra_bandwidth", "intra-node B", 1e-4, 1.0, "gb/s"),
    ("intra_latency", "α per intra-node collective", 1.0, 1e5, "us"),
    ("pass_bytes_per_s", "local pass rate", 1e-4, 1.0, "gb/s"),
    ("batch", "batch per GPU", 1 / 128, 1.0, "img"),
)


def _shown(field: str, unit: str, v: float) -> str:
    if unit == "gbit":
        return f"{v * 8 / 1e9:.3g} Gbit/s"
    if unit == "gb/s":
        return f"{v / 1e9:.3g} GB/s"
    if unit == "us":
        return f"{v * 1e6:.3g} µs"
    return f"{v:.3g}"


def speedup(profile: ModelProfile, cfg: SimConfig, gpus: int, config: str, field: str, value: float) -> float:
    v: float | int = max(1, round(value)) if field == "batch" else value
    moved = dataclasses.replace(cfg, **{field: v})  # type: ignore[arg-type]  # one field, by name
    return simulate(profile, moved, gpus, config).speedup


def break_even(
    profile: ModelProfile, cfg: SimConfig, gpus: int, config: str, target: float, field: str, lo: float, hi: float
) -> float | None:
    """The value of ``field`` in [lo, hi] (either order of effect) where the speedup crosses ``target``."""
    f_lo, f_hi = (speedup(profile, cfg, gpus, config, field, x) - target for x in (lo, hi))
    if f_lo * f_hi > 0:
        return None
    a, b = math.log(lo), math.log(hi)
    for _ in range(60):
        mid = (a + b) / 2
        f_mid = speedup(profile, cfg, gpus, config, field, math.exp(mid)) - target
        if (f_mid > 0) == (f_lo > 0):
            a, f_lo = mid, f_mid
        else:
            b = mid
    return math.exp((a + b) / 2)


def study(model: str) -> list[dict]:
    name, factory = resolve_model(model)
    profile = flop_profile(name, factory, IMAGENET_SHAPE)
    cfg = SimConfig(**paper_values(name))  # type: ignore[arg-type]  # as command.build: the preset's fields
    rows = []
    for m, gpus, config, target, _ in PAPER_TARGETS:
        if m != name or gpus != 512:
            continue
        pred = simulate(profile, cfg, gpus, config).speedup
        row: dict = {"model": name, "gpus": gpus, "config": config, "paper": target, "predicted": pred, "knobs": []}
        for field, label, lo_f, hi_f, unit in KNOBS:
            base = getattr(cfg, field)
            if base is None or base == 0 or math.isinf(base):
                base = {"latency": 1e-6, "intra_latency": 1e-6}.get(field, base)
            if base is None or math.isinf(base):
                row["knobs"].append({"field": field, "label": label, "preset": None, "value": None})
                continue
            v = break_even(profile, cfg, gpus, config, target, field, base * lo_f, base * hi_f)
            row["knobs"].append(
                {
                    "field": field,
                    "label": label,
                    "preset": getattr(cfg, field),
                    "value": v,
                    "factor": None if v is None else v / getattr(cfg, field),
                    "preset_shown": _shown(field, unit, getattr(cfg, field)),
                    "value_shown": "not reached" if v is None else _shown(field, unit, v),
                }
            )
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| figure | paper | predicted | assumption | preset | value giving the paper's figure | factor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for k in r["knobs"]:
            if k["preset"] is None:
                continue
            factor = "—" if k["value"] is None else f"{k['factor']:.3g}x"
            lines.append(
                f"| {r['model']} {r['gpus']} {r['config']} | {r['paper']:g}x | {r['predicted']:.1f}x | {k['label']} | "
                f"{k['preset_shown']} | {k['value_shown']} | {factor} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["alexnet", "resnet50"])
    p.add_argument("--out", help="write OUT.md and OUT.json")
    args = p.parse_args(argv)
    rows = [r for m in args.models for r in study(m)]
    md = f"`python experiments/paper_sensitivity.py {' '.join(argv)}`\n\n" + markdown(rows)
    print(md)
    if args.out:
        Path(args.out + ".md").write_text(md)
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
