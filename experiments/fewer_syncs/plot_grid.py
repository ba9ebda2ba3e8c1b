"""Final validation loss over DDP's against the bytes between replicas, for every ``sync_every`` recipe of the
4,000-step seed-0 launches (docs/results/fewer-syncs.md, "The grid at 4,000 steps"); run from the repository root:

    python experiments/fewer_syncs/plot_grid.py benchmarks/diloco_grid/seed0 benchmarks/diloco_topk/kept_seed0 \
        --old-defaults benchmarks/diloco_long/seed0 --out benchmarks/diloco_grid/loss_vs_bytes.png

Each point's ratio is to the DDP run of its own launch (same seed, same batches); its bytes are the mean per step
handed to the exchange between replicas (``comm_stats()['payload_bytes']``, measured) over DDP's 4 bytes a
parameter a step.  ``--old-defaults``: launches run before 2026-12-02's change of defaults, when an option a recipe
did not name was DiLoCo's (``outer_lr=0.7, outer_momentum=0.9, outer_compression="none"``).  A point measured in
two launches is plotted from the first folder given.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def points(folder: Path) -> dict[str, tuple[float, float]]:
    """``{recipe: (bytes over DDP's, final validation loss over DDP's)}`` of one launch."""
    job = json.loads((folder / "raw-quality.json").read_text())["jobs"][0]
    dense = 4.0 * job["n_params"]
    base = next(r for r in job["runs"] if r["recipe"] == "ddp")["evals"][-1]["val_loss"]
    out = {}
    for run in job["runs"]:
        payload = [s["payload_bytes"] for s in run["stats"] if s.get("payload_bytes") is not None]
        out[run["recipe"]] = (
            sum(payload) / len(payload) / dense if payload else 1.0,
            run["evals"][-1]["val_loss"] / base,
        )
    return out


def family(recipe: str, old: bool) -> str:
    """The line a recipe belongs to: its outer exchange and optimizer (the H is the point on the line)."""
    if not recipe.startswith("gf-"):
        return {"ddp": "torch DDP", "ddp-postlocal": "torch post-local SGD"}.get(recipe, recipe)
    opts = dict(kv.split("=") for kv in recipe.split(":", 1)[1].split(","))
    compression = opts.get("outer_compression", "none" if old else "3bit")
    if opts.get("outer_momentum", "0.9" if old else "0.0") != "0.0":
        return f"DiLoCo's Nesterov (lr 0.7, 0.9), {'fp32' if compression == 'none' else compression}"
    if "sync_fragments" in opts:
        return f"streaming, {opts['sync_fragments']} fragments, delay {opts.get('sync_delay', '0')} ({compression})"
    return {
        "none": "averaged, fp32",
        "3bit": "averaged, 3 bits (the defaults)",
        "topk-2bit": "averaged, top-k + 2 bits",
    }[compression]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--old-defaults", nargs="*", type=Path, default=[], help="launches under DiLoCo's defaults")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen: dict[tuple[str, str], tuple[float, float]] = {}
    for folder in [*args.folders, *args.old_defaults]:
        for recipe, point in points(folder).items():
            h = re.search(r"sync_every=(\d+)", recipe)
            label = f"H={h.group(1)}" if h else ("period 8" if recipe == "ddp-postlocal" else "")
            seen.setdefault((family(recipe, folder in args.old_defaults), label), point)
    lines: dict[str, list[tuple[float, float, str]]] = {}
    for (name, label), (b, loss) in seen.items():
        lines.setdefault(name, []).append((b, loss, label))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for b, loss, label in pts:
            ax.annotate(label, (b, loss), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(1.02, color="grey", linestyle="--", linewidth=0.8)
    ax.axvline(0.01, color="grey", linestyle=":", linewidth=0.8)
    ax.axvline(0.001, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes between replicas / torch DDP's (log)")
    ax.set_ylabel("final validation loss / DDP's")
    ax.set_title("AdamW transformer, 2 ranks, 4,000 steps, seed 0 (dashed: 1.02x; dotted: 0.01, 0.001)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    for name, pts in lines.items():
        print(name, ", ".join(f"{label or '-'} {b:.5f} {loss:.3f}" for b, loss, label in pts))


if __name__ == "__main__":
    main()
