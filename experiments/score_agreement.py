"""Does ``chunk_score="sampled_l1"`` send what the exact L1 sends, and what does it save?

``python experiments/score_agreement.py [--workloads resnet50 alexnet] [--steps 20] [--out DIR]``
(from the repository root)

For each workload, one rank (a one-process Gloo group) trains the bench's model on its synthetic
batch with CSC at density 0.1 (fp32 wire, ``warmup_steps=0``, SGD momentum 0.9, the exact score
deciding what is sent, as the paper does).  After every backward it rebuilds the accumulated
gradient the step scored (the residual v after the step plus the chunks it sent: with one rank and
an fp32 wire the pool holds exactly those) and scores it both ways:

1. **overlap**: the share of the exact top 10% chunks the sampled score also puts in its top 10%;
2. **L1 mass**: the exact L1 carried by the sampled top 10% over that of the exact top 10%
   (1.0 = as much gradient sent; what is not sent stays in the residual either way);
3. **ms per pass**: each score pass timed over the real residual (one thread, median of repeats).

Deterministic apart from the timings.  Writes ``results.json`` and ``table.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

DENSITY = 0.1
REPEATS = 9


def agreement(rows: torch.Tensor, density: float = DENSITY) -> dict[str, float]:
    """Overlap and L1-mass ratio of the sampled top-k against the exact top-k of ``rows``."""
    from gradientflow.exchange.selection import chunk_scores, n_selected, select_chunks

    exact = chunk_scores(rows)
    sampled = chunk_scores(rows, sampled=True)
    k = n_selected(density, rows.shape[0])
    best, picked = select_chunks(exact, k), select_chunks(sampled, k)
    overlap = len(set(best.tolist()) & set(picked.tolist())) / k
    return {"overlap": overlap, "mass": float(exact[picked].sum() / exact[best].sum())}


def _pass_ms(rows: torch.Tensor, sampled: bool) -> float:
    from gradientflow.exchange.selection import chunk_scores, score_scratch

    out = torch.empty(rows.shape[0])
    scratch = score_scratch(rows.shape[1], rows.dtype, sampled)
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        chunk_scores(rows, out=out, scratch=scratch, sampled=sampled)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(workload: str, steps: int, batch_size: int = 8) -> dict[str, Any]:
    """Train ``workload`` for ``steps`` steps on one rank; agreement per step, pass times at the end."""
    import gradientflow as gf
    from gradientflow.bench.models import build_model, synthetic_batch
    from gradientflow.exchange.selection import samples_chunks

    torch.manual_seed(0)
    model = gf.DistributedDataParallel(build_model(workload), density=DENSITY, warmup_steps=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = synthetic_batch(workload, batch_size, 0)
    noise = torch.Generator().manual_seed(1)  # a different batch each step, the same every run
    per_step = []
    rows = None
    for step in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x + 0.5 * torch.randn(x.shape, generator=noise)), y).backward()
        sync = model._gf_engine.sync
        scored = [sync.res.rows(k) + sync._pool_rows[k] for k in range(len(sync._pool_rows))]
        rows = torch.cat(scored)  # one global top-k over every pool buffer
        if not samples_chunks("sampled_l1", rows.shape[1]):
            raise ValueError(
                f"{workload}: chunks of {rows.shape[1]} are scored exactly even under sampled_l1; "
                "pick a model of at least 200 x 32768 parameters (resnet50, alexnet)"
            )
        per_step.append({"step": step + 1, **agreement(rows)})
        opt.step()
    assert rows is not None
    return {
        "workload": workload,
        "chunk_size": rows.shape[1],
        "n_chunks": rows.shape[0],
        "per_step": per_step,
        "exact_ms": _pass_ms(rows, False),
        "sampled_ms": _pass_ms(rows, True),
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | chunks | overlap (min / median) | L1 mass (min / median) | exact ms/pass | sampled ms/pass |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ov = [s["overlap"] for s in r["per_step"]]
        mass = [s["mass"] for s in r["per_step"]]
        lines.append(
            f"| {r['workload']} | {r['n_chunks']} x {r['chunk_size']} | {min(ov):.3f} / "
            f"{statistics.median(ov):.3f} | {min(mass):.4f} / {statistics.median(mass):.4f} | "
            f"{r['exact_ms']:.1f} | {r['sampled_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python experiments/score_agreement.py", description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["resnet50", "alexnet"])
    ap.add_argument("--steps", type=int, default=20, help="training steps per workload (default 20)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/score_agreement"))
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    torch.set_num_threads(1)
    store = dist.FileStore(tempfile.mktemp(prefix="gf-score-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        results = [measure(w, args.steps) for w in args.workloads]
    finally:
        dist.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    command = " ".join(["python experiments/score_agreement.py", *(argv if argv is not None else sys.argv[1:])])
    table = f"`{command}` ({datetime.date.today().isoformat()})\n\n" + markdown(results)
    (args.out / "table.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
