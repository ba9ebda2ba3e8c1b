"""``gradientflow bench --quality``: model quality (and time to accuracy) of each recipe against torch DDP."""

from __future__ import annotations

import argparse
import sys

from . import types


def add_arguments(b: argparse.ArgumentParser) -> None:
    """The ``--quality options`` group of ``gradientflow bench``."""
    from gradientflow.bench.quality_recipes import RECIPES, TABLE_RECIPES
    from gradientflow.bench.quality_torchft import DEFAULT_SYNC_EVERY

    q = b.add_argument_group(
        "--quality options",
        "Train a character-level transformer (AdamW) and the digits CNN (SGD, momentum 0.9) with "
        "each recipe side by side from the same seed and batches, and report final validation loss / accuracy, its "
        "ratio to torch DDP, bytes sent per step and the share of sparse steps; with --bandwidth (root) also time to "
        "accuracy of a bigger transformer and of digits_wide (AlexNet-shaped, 8.4M parameters) on the emulated "
        "cluster, ddp vs gf-recommended (the transformer also gf-fp16-dense and gf-density-0.3). Writes "
        "results.json, table.md, quality_*.png and tta*.png to --out. "
        "See docs/results/quality.md.",
    )
    q.add_argument("--quality", action="store_true", help="run the quality benchmark instead of timing steps")
    q.add_argument(
        "--recipes",
        nargs="+",
        type=types.recipe,
        default=None,
        metavar="RECIPE",
        help=f"recipes to train (default all that apply; ddp is always added): {' '.join(RECIPES)}; also every "
        f"recipe of the table (docs/recipes.md): {' '.join(TABLE_RECIPES)}; "
        "a gf-* recipe may change wrapper options, e.g. gf-recommended:warmup_steps=300,dense_1d=False "
        "(an ablation, trained beside the others on the same seed and batches); torchft's DiLoCo peers "
        "(the torchft extra): torchft-diloco and torchft-diloco-quantized (fp8; CUDA with triton), each with "
        f"sync_every=H (default {DEFAULT_SYNC_EVERY}), e.g. torchft-diloco:sync_every=30",
    )
    q.add_argument(
        "--tta-recipes",
        nargs="+",
        type=types.recipe,
        default=None,
        metavar="RECIPE",
        help="recipes on the time-to-accuracy clock instead of the default ones (ddp is always added), e.g. "
        "gf-auto gf-2bit-precond",
    )
    q.add_argument(
        "--transformer-size",
        type=types.size,
        default=(128, 2),
        metavar="DxL",
        help="d_model x layers of the quality transformer, and of the step-time bench's --workload tiny_transformer "
        "(default 128x2: 0.43M parameters)",
    )
    q.add_argument(
        "--tta-size",
        type=types.size,
        default=(256, 4),
        metavar="DxL",
        help="d_model x layers of the time-to-accuracy transformer (default 256x4: 3.2M parameters)",
    )
    q.add_argument(
        "--tta-steps", type=types.positive_int, default=300, help="time-to-accuracy training steps (default 300)"
    )
    q.add_argument(
        "--quality-on-link",
        action="store_true",
        help="train the quality launch behind the emulated --bandwidth link instead of on loopback (compression="
        "'auto' measures the link it runs on), and skip the time-to-accuracy launch",
    )
    q.add_argument(
        "--eval-every", type=types.positive_int, default=None, help="steps between validations (default steps/20)"
    )
    q.add_argument(
        "--corpus",
        choices=("help-topics", "stdlib"),
        default="help-topics",
        help="the transformers' text: Python's help topics (characters, 465 kB, overfitted within a few thousand "
        "steps; the published tables') or the standard library's sources (bytes, 31.5 MB on CPython 3.11, every "
        "20th file held out for validation: a corpus a run does not exhaust) (default help-topics)",
    )
    q.add_argument("--seed", type=types.nonneg_int, default=0, help="seed of models and batches (default 0)")
    q.add_argument(
        "--adamw-lr",
        type=types.positive_float,
        default=None,
        help="peak learning rate of the quality transformer's AdamW (default 6e-3 x 128 / d_model)",
    )
    q.add_argument(
        "--transformer-optimizer",
        choices=("adamw", "sgd"),
        default="adamw",
        help="the quality transformer's optimizer, every recipe's (default adamw; sgd: SGD momentum 0.9, peak "
        "LR 0.3, the language workload for SGD users)",
    )
    q.add_argument(
        "--digits-optimizer",
        choices=("sgd", "adamw"),
        default="sgd",
        help="the digits jobs' optimizer (small_cnn, and digits_wide on the time-to-accuracy clock), every recipe's "
        "(default sgd: SGD momentum 0.9, peak LR 0.05; adamw: AdamW, peak LR 3e-4, the transformer's betas and "
        "weight decay; gf-paper keeps its SGD)",
    )
    q.add_argument(
        "--adamw-beta2",
        type=types.beta,
        default=0.95,
        help="beta2 of the quality transformer's AdamW (default 0.95; users also run 0.999)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from gradientflow.bench.quality import WORKLOAD_OF_CLI, QualityOptions, run_quality
    from gradientflow.bench.quality_torchft import check_device as check_torchft_device

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gradientflow bench: error: --device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    if args.workload is not None and args.workload not in WORKLOAD_OF_CLI:
        print(
            f"gradientflow bench: error: --quality trains {' or '.join(WORKLOAD_OF_CLI)}, not {args.workload}",
            file=sys.stderr,
        )
        return 2
    if args.nproc % args.nproc_per_node:
        print(
            f"gradientflow bench: error: --nproc {args.nproc} (ranks in all) is not a multiple of --nproc-per-node "
            f"{args.nproc_per_node}: pass e.g. --nproc {2 * args.nproc_per_node}",
            file=sys.stderr,
        )
        return 2
    try:  # torchft's quantised DiLoCo runs on CUDA only (the extra itself is checked by run_quality)
        check_torchft_device(args.recipes or [], args.device)
    except ValueError as exc:
        print(f"gradientflow bench: error: {exc}", file=sys.stderr)
        return 2
    workloads = [WORKLOAD_OF_CLI[args.workload]] if args.workload else list(WORKLOAD_OF_CLI.values())
    opts = QualityOptions(
        workloads=workloads,
        recipes=args.recipes,
        nproc=args.nproc,
        nproc_per_node=args.nproc_per_node,
        steps=args.steps or 400,
        tta_steps=args.tta_steps,
        eval_every=args.eval_every,
        batch_size=args.batch_size,
        transformer_size=args.transformer_size,
        tta_size=args.tta_size,
        bandwidth=args.bandwidth,
        quality_on_link=args.quality_on_link,
        threads=args.threads or 1,
        seed=args.seed,
        device=args.device,
        adamw_lr=args.adamw_lr,
        adamw_beta2=args.adamw_beta2,
        transformer_optimizer=args.transformer_optimizer,
        corpus=args.corpus,
        digits_optimizer=args.digits_optimizer,
        tta_recipes=args.tta_recipes,
        timeout_s=float(args.timeout),
        prefix=args.netns_prefix,
        out=args.out or "benchmarks/quality",
    )
    run_quality(opts)
    return 0
