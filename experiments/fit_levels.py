"""Fit the quantiser's levels: a 1-D Lloyd-Max (k-means) fit to block-normalised contributions of the
quality bench's AdamW transformer, as ``comm.levels.CODEBOOKS`` / ``ZEROLESS`` were fitted.

    python experiments/fit_levels.py --out benchmarks/fit_levels

Trains the bench's transformer job (seed 0, its AdamW and schedule) in one process as the 2-rank
quantised recipe does: per step each of the two ranks' batches gives a gradient ``g_r``, the rank's
contribution ``x_r = g_r / 2 + e_r`` is quantised with error feedback (``--train`` levels, blocks of
``--block``), and the optimizer gets the sum of the decoded contributions.  At the ``--at`` steps it keeps
``|x_r| / max |x_r|`` of every block and fits, on those magnitudes, the levels of each layout: with a zero
level (``0, ±l_1 .. ±l_L``: one magnitude per code but "-0") and without one (``±l_0 .. ±l_{K-1}``: all
``2**bits`` codes used).  It reports each fit's error energy (the mean squared error in units of the block's
scale, and weighted by the scale squared: the gradient's own units) against the library's current levels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from gradientflow.bench.quality import QualityOptions, plan_jobs
from gradientflow.bench.quality_data import WorkloadData
from gradientflow.bench.quality_lr import lr_schedule
from gradientflow.comm.levels import CODEBOOKS, ZEROLESS

LAYOUTS = {"zero": True, "zeroless": False}


def quantize_levels(u: torch.Tensor, mags: torch.Tensor, zero: bool) -> torch.Tensor:
    """Nearest of ``±mags`` (and 0 where ``zero``) to each of ``u`` (already block-normalised)."""
    lv = torch.cat([mags.new_zeros(1), mags]) if zero else mags
    k = (u.abs()[..., None] - lv).abs().argmin(-1)
    return lv[k].copysign(u)


def lloyd_max(a: torch.Tensor, n: int, zero: bool, w: torch.Tensor | None = None, iters: int = 200) -> torch.Tensor:
    """``n`` magnitudes minimising the mean squared error of ``a`` (>= 0) to the nearest of them (and 0),
    each sample weighted by ``w`` (default 1)."""
    mags = torch.linspace(0.1, 0.8, n, dtype=torch.float64)
    a = a.double()
    w = torch.ones_like(a) if w is None else w.double()
    for _ in range(iters):
        lv = torch.cat([mags.new_zeros(1), mags]) if zero else mags
        cell = (a[:, None] - lv).abs().argmin(1)
        sums = torch.zeros_like(lv).index_add_(0, cell, a * w)
        counts = torch.zeros_like(lv).index_add_(0, cell, w)
        new = torch.where(counts > 0, sums / torch.where(counts > 0, counts, 1), lv)
        mags = new[1:] if zero else new
    return mags


def blocks_of(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in rows of ``block``, zero-padded; each row's max |x|)."""
    pad = (-x.numel()) % block
    rows = F.pad(x, (0, pad)).view(-1, block)
    return rows, rows.abs().amax(1, keepdim=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="the job's length (its LR schedule)")
    ap.add_argument("--at", type=int, nargs="+", default=[5, 60, 119], help="steps whose contributions are fitted")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--train", default="3", help="error-feedback levels while training: 3 / 2 / 2n (the library's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bits = int(args.train.rstrip("n"))
    train_zero = not args.train.endswith("n")
    train_mags = torch.tensor(CODEBOOKS[bits] if train_zero else ZEROLESS[bits])
    job = plan_jobs(QualityOptions(workloads=["transformer"], steps=args.steps, bandwidth="none"))[0][0]
    ranks = [WorkloadData(job, 0, r, 2) for r in range(2)]
    model = ranks[0].build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=job.lr, betas=(0.9, job.beta2), weight_decay=0.1)
    sched = lr_schedule(opt, job)
    batches = [d.batches() for d in ranks]
    n = sum(p.numel() for p in params)
    err = [torch.zeros(n) for _ in ranks]
    samples: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    for step in range(max(args.at) + 1):
        total = torch.zeros(n)
        for r, it in enumerate(batches):
            x, y = next(it)
            opt.zero_grad(set_to_none=True)
            out = model(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            contrib = torch.cat([p.grad.reshape(-1) for p in params]) / 2 + err[r]  # type: ignore[union-attr]
            rows, s = blocks_of(contrib, args.block)
            if step in args.at:
                keep = s[:, 0] > 0
                samples.append((rows[keep] / s[keep]).abs().reshape(-1))
                weights.append(s[keep].expand(-1, args.block).reshape(-1).square())
            safe = torch.where(s > 0, s, torch.ones_like(s))
            dec = (quantize_levels(rows / safe, train_mags, train_zero) * s).reshape(-1)[:n]
            err[r] = contrib - dec
            total += dec
        off = 0
        for p in params:
            p.grad = total[off : off + p.numel()].view_as(p).clone()
            off += p.numel()
        opt.step()
        sched.step()
    a, w = torch.cat(samples).double(), torch.cat(weights).double()
    result: dict[str, object] = {"args": vars(args), "n_samples": a.numel(), "fits": {}}
    current = {"zero": CODEBOOKS.get(args.bits), "zeroless": ZEROLESS.get(args.bits)}
    L = 2 ** (args.bits - 1)
    for name, zero in LAYOUTS.items():
        k = L - 1 if zero else L
        fits = {"fitted": lloyd_max(a, k, zero), "fitted_weighted": lloyd_max(a, k, zero, w), "library": current[name]}
        for label, mags in fits.items():
            if mags is None:
                continue
            mt = torch.as_tensor(mags, dtype=torch.float64)
            e2 = (a - quantize_levels(a, mt, zero)).square()
            result["fits"][f"{name}/{label}"] = {  # type: ignore[index]
                "levels": [round(float(v), 4) for v in mt],
                "mse_normalised": float(e2.mean()),
                "mse_weighted": float((e2 * w).sum() / w.sum()),
            }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"fit_b{args.bits}_block{args.block}_train{args.train}.json").write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
