"""``gradientflow demo``: train small_cnn on the shipped handwritten digits on N local ranks."""

from __future__ import annotations

import argparse
import sys

from . import types


def add_arguments(d: argparse.ArgumentParser) -> None:
    from gradientflow.options_base import COMM_DTYPES
    from gradientflow.recipes import PER_STEP_NAMES

    d.add_argument("--nproc", type=types.positive_int, default=2, help="number of local ranks (default 2)")
    d.add_argument("--steps", type=types.positive_int, default=400, help="training steps (default 400)")
    d.add_argument("--batch-size", type=types.positive_int, default=32, help="samples per rank per step (default 32)")
    d.add_argument(
        "--compression",
        type=types.compression,
        default=None,
        metavar="RECIPE",
        help=f"the recipe, as the library's compression= ({', '.join(PER_STEP_NAMES)}; docs/recipes.md) "
        "(default auto; none with --sync-every above 1, where nothing crosses between syncs)",
    )
    d.add_argument(
        "--sync-every",
        type=types.positive_int,
        default=1,
        metavar="H",
        help="fewer syncs: the ranks train on their own gradients and are averaged every H steps (through 3 bits), "
        "as the library's sync_every= (docs/fewer-syncs.md); compare its loss and bytes with a run without it "
        "(default 1: every step)",
    )
    d.add_argument(
        "--density",
        type=types.density,
        default=None,
        help="top-k: fraction of gradient chunks sent per step, in (0, 1]; 'none' = the recipe's, as the "
        "library's density=None (default: the recipe's)",
    )
    d.add_argument(
        "--comm-dtype",
        type=types.comm_dtype,
        default="fp32",
        metavar="{" + ",".join([*COMM_DTYPES, "half"]) + "}",
        help="dtype of gradients on the wire for the dense and top-k recipes, as the library's comm_dtype= "
        "(half: bf16 on CPU, fp16 on GPUs) (default fp32: the recipe's)",
    )
    d.add_argument(
        "--chunk-size",
        type=types.positive_int,
        default=1024,
        help="top-k chunk size in gradients; 1024 gives ~180 chunks for this model (default 1024)",
    )
    d.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    d.add_argument("--no-amp", action="store_true", help="train in fp32 instead of bf16 autocast")
    d.add_argument("--out", default=None, help="directory for demo.json (default: do not write)")


def run(args: argparse.Namespace) -> int:
    from gradientflow.bench.demo import DemoOptions, run_demo
    from gradientflow.config import GradientFlowConfig

    per_step = {"--compression": args.compression not in (None, "none"), "--density": args.density is not None}
    per_step["--comm-dtype"] = args.comm_dtype != "fp32"
    given = [flag for flag, set_ in per_step.items() if set_]
    if args.sync_every > 1 and given:  # the library's advice names its outer options, which the demo does not take
        print(
            f"gradientflow demo: error: --sync-every {args.sync_every} sends nothing between syncs, so the per-step "
            f"option {', '.join(given)} cannot apply (the replicas are averaged every {args.sync_every} steps "
            "through 3 bits): drop it, or drop --sync-every to run it every step",
            file=sys.stderr,
        )
        return 2
    compression = args.compression or ("none" if args.sync_every > 1 else "auto")
    try:  # the options together, as the library takes them, before any rank starts (one line, not N tracebacks)
        GradientFlowConfig(
            compression=compression, density=args.density, comm_dtype=args.comm_dtype, sync_every=args.sync_every
        )
    except ValueError as exc:
        print(f"gradientflow demo: error: {exc}", file=sys.stderr)
        return 2
    opts = DemoOptions(
        nproc=args.nproc,
        compression=compression,
        steps=args.steps,
        batch_size=args.batch_size,
        density=args.density,
        comm_dtype=args.comm_dtype,
        chunk_size=args.chunk_size,
        lr=args.lr,
        amp=not args.no_amp,
        out=args.out,
        sync_every=args.sync_every,
    )
    run_demo(opts)
    return 0
