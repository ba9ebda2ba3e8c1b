"""Why AdamW loses quality under CSC: how far each coordinate moves, by how often its chunk is sent.

``torchrun --nproc-per-node 2 experiments/adamw_bursts.py [--steps 400] [--out DIR]`` (from the repository root)

Trains the quality bench's transformer (the same job: model, data, AdamW, LR schedule, seed) twice,
side by side: torch DDP and ``gf.DistributedDataParallel(comm_dtype="fp16", density=0.1)``.  Over
the second half of the run it counts, per parameter element, the steps on which its chunk was sent
(a nonzero synchronised gradient).  At the end it groups the elements by that frequency and reports,
per group, the median of: AdamW's second moment under CSC over DDP's, the size of the update AdamW
would take (``|m| / sqrt(v)``) in each run, and how far the elements moved over the second half.

The analytic side (:func:`burst_travel`): a coordinate that receives one burst S and then zeros moves
``lr * (1 - b1) / sqrt(1 - b2) * sum_j (b1 / sqrt(b2)) ** j`` in all, whatever S carries, because Adam
divides the burst by its own root mean square.  A chunk sent once in k steps therefore moves at most
that far per k steps, while dense training moves it about ``k * |E g| / rms(g)`` learning rates.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BANDS = ((0.0, 0.02), (0.02, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 0.5), (0.5, 1.0))
"""Send-frequency bands (share of the counted steps; the last one includes 1)."""


def burst_travel(beta1: float, beta2: float) -> float:
    """Total AdamW step (in learning rates) after one isolated gradient burst from empty moments.

    After the burst, m_j = (1 - b1) S b1**j and v_j = (1 - b2) S**2 b2**j, so each step is
    (1 - b1) / sqrt(1 - b2) * (b1 / sqrt(b2)) ** j: a geometric series (bias correction, which
    is ~1 late in training, and epsilon left out).
    """
    if beta2 == 0:  # v forgets the burst at once: m / sqrt(v) is the burst's sign, then m / eps
        return 1.0 if beta1 == 0 else math.inf
    ratio = beta1 / math.sqrt(beta2)
    if ratio >= 1:
        return math.inf
    return (1 - beta1) / math.sqrt(1 - beta2) / (1 - ratio)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


def band_table(
    freq: torch.Tensor, v_ratio: torch.Tensor, step_ddp: torch.Tensor, step_gf: torch.Tensor, moved_ratio: torch.Tensor
) -> list[dict[str, Any]]:
    """Medians per send-frequency band (see :data:`BANDS`); bands without elements are left out."""
    rows = []
    for lo, hi in BANDS:
        sel = (freq >= lo) & ((freq < hi) if hi < 1 else (freq <= hi))
        n = int(sel.sum())
        if n == 0:
            continue
        rows.append(
            {
                "band": [lo, hi],
                "elements": n,
                "v_gf_over_ddp": float(v_ratio[sel].median()),
                "adam_step_ddp": float(step_ddp[sel].median()),
                "adam_step_gf": float(step_gf[sel].median()),
                "moved_gf_over_ddp": float(moved_ratio[sel].median()),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], total: int, counted: int, travel: float, betas: tuple[float, float]) -> str:
    lines = [
        "| chunk sent on | elements | AdamW v, CSC / DDP | AdamW step \\|m\\|/√v, DDP | the same, CSC "
        f"| moved over the last {counted} steps, CSC / DDP |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["band"]
        lines.append(
            f"| {lo:.0%}–{hi:.0%} of steps | {r['elements']:,} ({r['elements'] / total:.0%}) "
            f"| {r['v_gf_over_ddp']:.2f} | {r['adam_step_ddp']:.3f} | {r['adam_step_gf']:.3f} "
            f"| {r['moved_gf_over_ddp']:.2f} |"
        )
    lines += ["", f"One isolated burst moves a coordinate {travel:.2f} learning rates in all (betas {tuple(betas)})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from gradientflow.bench.quality_data import cross_entropy
    from gradientflow.bench.quality_lr import lr_schedule
    from gradientflow.bench.quality_recipes import build_recipe

    from _study import start_transformer_study

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="training steps (default 400, as the quality bench)")
    p.add_argument("--out", default="benchmarks/adamw_bursts", help="directory for results.json and table.md")
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error("--steps must be at least 4")

    job, data = start_transformer_study(args.steps)
    rank = dist.get_rank()
    runs = {}
    for kind, recipe in (("ddp", "ddp"), ("gf", "gf-recommended")):  # the quality bench's own recipes
        wrapped, opt, _ = build_recipe(recipe, data.build_model(), job)
        runs[kind] = (wrapped, opt, lr_schedule(opt, job), data.batches())
    betas = runs["gf"][1].param_groups[0]["betas"]

    half = args.steps // 2
    sent: torch.Tensor | None = None
    start: dict[str, torch.Tensor] = {}
    for step in range(args.steps):
        if step == half:
            start = {k: _flat(list(w.parameters())) for k, (w, *_) in runs.items()}
        for kind, (wrapped, opt, sched, batches) in runs.items():
            x, y = next(batches)
            opt.zero_grad(set_to_none=True)
            cross_entropy(wrapped(x), y).backward()
            if kind == "gf" and step >= half:
                # a sent chunk carries a nonzero synchronised gradient; the others are exactly 0
                now = torch.cat(
                    [
                        (q.grad != 0).flatten() if q.grad is not None else torch.zeros(q.numel(), dtype=bool)
                        for q in wrapped.parameters()
                    ]
                ).float()
                sent = now if sent is None else sent + now
            opt.step()
            sched.step()

    if rank == 0:
        assert sent is not None
        state = {k: (opt.state, list(w.parameters())) for k, (w, opt, *_) in runs.items()}
        v = {k: _flat([s[q]["exp_avg_sq"] for q in ps]) for k, (s, ps) in state.items()}
        m = {k: _flat([s[q]["exp_avg"] for q in ps]) for k, (s, ps) in state.items()}
        moved = {k: (_flat(ps) - start[k]).abs() for k, (_, ps) in state.items()}
        counted = args.steps - half
        rows = band_table(
            sent / counted,
            v["gf"] / v["ddp"].clamp_min(1e-30),
            m["ddp"].abs() / (v["ddp"].sqrt() + 1e-8),
            m["gf"].abs() / (v["gf"].sqrt() + 1e-8),
            moved["gf"] / moved["ddp"].clamp_min(1e-30),
        )
        travel = burst_travel(*betas)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        total = int(sent.numel())
        (out / "results.json").write_text(
            json.dumps(
                {
                    "steps": args.steps,
                    "counted_steps": counted,
                    "elements": total,
                    "burst_travel_lr": travel,
                    "job": {
                        "d_model": job.d_model,
                        "n_layers": job.n_layers,
                        "lr": job.lr,
                        "batch_size": job.batch_size,
                    },
                    "bands": rows,
                },
                indent=1,
            )
        )
        table = markdown(rows, total, counted, travel, betas)
        (out / "table.md").write_text(table)
        print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
