"""AdamW settings x seeds: ``compression="auto"`` against torch DDP, one ``gradientflow bench --quality``
launch per (model, lr, beta2, seed), then one table of the means.

    python experiments/adamw_matrix.py --out benchmarks/adamw_matrix            # run what is missing, tabulate
    python experiments/adamw_matrix.py --out benchmarks/adamw_matrix --table    # tabulate only
    python experiments/adamw_matrix.py --recipe gf-auto:compression=q2npw20 --out benchmarks/adamw_matrix_2bit_precond

``--recipe``: the gradientflow recipe (or variant) trained beside ``ddp`` (default ``gf-auto``).
``--layout 2x2``: every launch at 4 ranks as 2 nodes x 2 (``--nproc 4 --nproc-per-node 2``; default 2 ranks).
``--bandwidth 200mbit``: every launch's training behind the emulated link (the bench's ``--quality-on-link``;
default ``none``: loopback); the losses do not depend on the link, but ``compression="auto"``'s choice may (it
measures the link: 2 bits on a slow one, 2 ranks).

Each launch trains ``ddp`` and ``gf-auto`` side by side from the same seed and batches (the quality
bench's transformer: 400 steps, 5% warm-up then cosine to 10%, AdamW weight decay 0.1, 2 ranks) and
writes ``OUT/<model>-lr<lr>-b<beta2>-s<seed>/results.json``; a launch whose results exist is not run
again, so the matrix can be filled in several sittings (the table says the date of each launch).
Ratio = gf-auto's final validation loss / DDP's in the same launch; bytes = gf-auto's measured bytes per
step over the whole run / DDP's (4 per gradient).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MODELS = {"128x2": "the bench's transformer (0.43M parameters)", "192x3": "the issue's probe size (1.4M)"}
SETTINGS = {  # model -> (lr, beta2) pairs: the AdamW settings users run (CSC's loss moved with them)
    "128x2": [(6e-3, 0.95), (3e-3, 0.95), (3e-3, 0.999), (1e-3, 0.95), (1e-3, 0.999)],
    "192x3": [(3e-3, 0.95), (1e-3, 0.999)],
}
SEEDS = (0, 1, 2)
DEFAULT_RECIPE = "gf-auto"


def launch_dir(out: Path, model: str, lr: float, beta2: float, seed: int) -> Path:
    return out / f"{model}-lr{lr:g}-b{beta2:g}-s{seed}"


def layout_args(layout: str | None) -> list[str]:
    """``"NxG"`` -> the bench's ``--nproc N*G --nproc-per-node G``; None -> the bench's 2 ranks."""
    if layout is None:
        return []
    nodes, per_node = (int(x) for x in layout.split("x"))
    return ["--nproc", str(nodes * per_node), "--nproc-per-node", str(per_node)]


def run_missing(
    out: Path,
    models: list[str],
    recipe: str,
    layout: str | None = None,
    seeds: tuple[int, ...] = SEEDS,
    bandwidth: str = "none",
) -> None:
    for model in models:
        for lr, beta2 in SETTINGS[model]:
            for seed in seeds:
                d = launch_dir(out, model, lr, beta2, seed)
                if (d / "results.json").exists():
                    continue
                cmd = [
                    *("gradientflow", "bench", "--quality", "--workload", "tiny_transformer"),
                    *("--recipes", "ddp", recipe, "--steps", "400", "--bandwidth", bandwidth),
                    *(["--quality-on-link"] if bandwidth != "none" else []),
                    *("--transformer-size", model, "--adamw-lr", f"{lr:g}", "--adamw-beta2", f"{beta2:g}"),
                    *("--seed", str(seed), *layout_args(layout), "--out", str(d)),
                ]
                print(" ".join(cmd), flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def tabulate(out: Path, recipe: str = DEFAULT_RECIPE, layout: str | None = None, bandwidth: str = "none") -> str:
    lines = [
        f"| model | AdamW lr | beta2 | seeds | {recipe} final val loss / DDP's, per seed | mean "
        "| bytes / DDP's (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    dates: set[str] = set()
    picked: set[str] = set()  # what compression="auto" picked (the reasons' first words)
    for model, settings in SETTINGS.items():
        for lr, beta2 in settings:
            ratios, fracs, seeds = [], [], []
            for seed in SEEDS:
                f = launch_dir(out, model, lr, beta2, seed) / "results.json"
                if not f.exists():
                    continue
                res = json.loads(f.read_text())
                dates.add(res["date"])
                rows = {r["recipe"]: r for r in res["workloads"]["transformer"]["rows"]}
                if rows[recipe].get("picked"):
                    picked.add(rows[recipe]["picked"].split(" (")[0])
                ratios.append(rows[recipe]["ratio_to_ddp"])
                fracs.append(rows[recipe]["bytes_per_step"] / rows["ddp"]["bytes_per_step"])
                seeds.append(seed)
            if not ratios:
                continue
            per_seed = ", ".join(f"{r:.4f}" for r in ratios)
            lines.append(
                f"| {model} | {lr:g} | {beta2:g} | {', '.join(map(str, seeds))} | {per_seed} | "
                f"**{statistics.mean(ratios):.4f}** | {statistics.mean(fracs):.4f} |"
            )
    flags = ("" if recipe == DEFAULT_RECIPE else " --recipe " + recipe) + (
        "" if layout is None else " --layout " + layout
    )
    flags += "" if bandwidth == "none" else " --bandwidth " + bandwidth
    launch = "".join(a + " " for a in layout_args(layout))
    on_link = "--quality-on-link " if bandwidth != "none" else ""
    head = (
        f"`python experiments/adamw_matrix.py{flags} --out {out}` "
        f"(launches dated {', '.join(sorted(dates))}); "
        f"each launch: `gradientflow bench --quality --workload tiny_transformer --recipes ddp {recipe} --steps 400 "
        f"--bandwidth {bandwidth} {on_link}--transformer-size MODEL --adamw-lr LR --adamw-beta2 BETA2 "
        f"--seed SEED {launch}"
        "--out DIR` "
        "with the model, lr, beta2 and seed of each row"
        + (f'; `"auto"` picked: {", ".join(sorted(picked))}' if picked else "")
        + "\n\n"
    )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/adamw_matrix"))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--table", action="store_true", help="only tabulate what exists")
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="the gradientflow recipe beside ddp (default gf-auto)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="the seeds to run (default 0 1 2)")
    p.add_argument("--layout", default=None, help="NxG: N nodes of G ranks (default: 2 ranks, one per node)")
    p.add_argument("--bandwidth", default="none", help="the emulated link of every launch (default none: loopback)")
    args = p.parse_args(argv)
    if not args.table:
        run_missing(args.out, args.models, args.recipe, args.layout, tuple(args.seeds), args.bandwidth)
    table = tabulate(args.out, args.recipe, args.layout, args.bandwidth)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
