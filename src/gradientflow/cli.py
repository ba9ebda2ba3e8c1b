"""The ``gradientflow`` command: ``demo`` (train a real model on N local ranks) and ``bench``."""

from __future__ import annotations

import argparse
import logging
import re
import sys

logger = logging.getLogger(__name__)

WORKLOAD_CHOICES = ("resnet50", "alexnet", "small_cnn", "tiny_transformer")


def _int_at_least(low: int):
    """An argparse type: an integer >= ``low``, with a one-line error otherwise."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
        return v

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return v


def _density(text: str) -> float:
    v = _nonneg_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"density must be in [0, 1] (0 = dense), got {text}")
    return v


def _bandwidth(text: str) -> str:
    from gradientflow.bench.cluster import parse_rate

    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (e.g. 1gbit, 10gbit, none)") from None
    return text.strip().lower()


def _links(text: str) -> list[str]:
    from gradientflow.bench.links import parse_links

    try:
        return [p.name for p in parse_links(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prefix(text: str) -> str:
    if not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9]{0,9}", text):
        raise argparse.ArgumentTypeError(f"expected 1-10 letters/digits starting with a letter, got {text!r}")
    return text


def _size(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip().lower())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"expected D_MODELxLAYERS, e.g. 128x2, got {text!r}")
    d, layers = int(m.group(1)), int(m.group(2))
    if d % 32 and d > 32:
        raise argparse.ArgumentTypeError(f"d_model must be at most 32 or a multiple of 32 (heads of 32), got {d}")
    return d, layers


def _workload(text: str) -> str:
    """A built-in model, or the user's ``package.module:factory`` (imported here, so a typo fails now)."""
    if text in WORKLOAD_CHOICES:
        return text
    if ":" not in text:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(WORKLOAD_CHOICES)} or your model as package.module:factory, got {text!r}"
        )
    from gradientflow.bench.models import resolve_model

    try:
        resolve_model(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--model", "--workload")) from None
    return text


def _recipe(text: str) -> str:
    from gradientflow.bench.quality import parse_recipe

    try:
        parse_recipe(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``gradientflow`` and its subcommands."""
    from gradientflow.bench.quality import RECIPES
    from gradientflow.bench.runner import MODES
    from gradientflow.sim.command import add_arguments as add_simulate_arguments
    from gradientflow.sim.command import parse_shape

    p = argparse.ArgumentParser(
        prog="gradientflow",
        description="GradientFlow-style gradient communication for PyTorch data-parallel training.",
        epilog="Run 'gradientflow COMMAND --help' for the options of a command.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    d = sub.add_parser(
        "demo",
        help="train a small CNN on scikit-learn's digits on N local ranks (fp16 wire + sparse CSC)",
        description="Launch N local ranks with torchrun's API (Gloo, 127.0.0.1) and train small_cnn on "
        "scikit-learn's 8x8 handwritten digits with gradientflow.DistributedDataParallel in its best mode: "
        "fp16 on the wire and coarse-grained sparse communication (CSC). Reports test accuracy, steps/s and "
        "the bytes sent next to what torch DDP would have sent.",
    )
    d.add_argument("--nproc", type=_positive_int, default=2, help="number of local ranks (default 2)")
    d.add_argument("--steps", type=_positive_int, default=400, help="training steps (default 400)")
    d.add_argument("--batch-size", type=_positive_int, default=32, help="samples per rank per step (default 32)")
    d.add_argument(
        "--density",
        type=_density,
        default=0.1,
        help="CSC: fraction of gradient chunks sent per step; 0 = dense (default 0.1)",
    )
    d.add_argument(
        "--comm-dtype",
        choices=("fp32", "fp16", "bf16"),
        default="fp16",
        help="dtype of gradients on the wire (default fp16)",
    )
    d.add_argument(
        "--chunk-size",
        type=_positive_int,
        default=1024,
        help="CSC chunk size in gradients; 1024 gives ~180 chunks for this model (default 1024)",
    )
    d.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    d.add_argument("--no-amp", action="store_true", help="train in fp32 instead of bf16 autocast")
    d.add_argument("--out", default=None, help="directory for demo.json (default: do not write)")

    b = sub.add_parser(
        "bench",
        help="step time of gradientflow's modes vs torch DDP (+ hooks), side by side in one run",
        description="Time gradientflow's modes against torch DDP, DDP + fp16_compress_hook and DDP + PowerSGD, "
        "all in one launch of the ranks (step by step interleaved), plus 'compute' (no communication) as the "
        "1-rank reference for the speedup ratio. With --bandwidth and root: every rank in its own network "
        "namespace, links shaped with tc. Writes results.json, table.md and bench.png to --out. "
        "With --quality: model quality instead of step time (see the --quality options below).",
    )
    b.add_argument(
        "--workload",
        type=_workload,
        default=None,
        metavar="MODEL",
        help=f"{' | '.join(WORKLOAD_CHOICES)} | package.module:factory (your model: a zero-argument "
        "callable returning an nn.Module; give --input-shape) (default resnet50; with --quality "
        "tiny_transformer or small_cnn alone, default both)",
    )
    b.add_argument(
        "--input-shape",
        type=parse_shape,
        default=None,
        metavar="C,H,W",
        help="one sample's input shape for your model (--workload package.module:factory); it is fed "
        "N(0, 1) inputs and trained on the mean square of its outputs",
    )
    b.add_argument("--nproc", type=_positive_int, default=2, help="ranks (= emulated nodes) (default 2)")
    b.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="timed steps per mode (default 20); with --quality training steps per workload (default 400)",
    )
    b.add_argument("--warmup", type=_nonneg_int, default=3, help="untimed steps per mode first (default 3)")
    b.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        metavar="MODE",
        help=f"modes to compare (default all): {' '.join(MODES)}; 'compute' is always added",
    )
    b.add_argument(
        "--no-alone",
        dest="alone",
        action="store_false",
        help="do not time each mode again on a one-rank group (the table's 'alone' column and own-CPU "
        "share: what a mode costs apart from the network); a quarter to a third less time",
    )
    b.add_argument(
        "--bandwidth",
        type=_bandwidth,
        default="1gbit",
        help="per-node link rate of the emulated cluster, e.g. 1gbit, 10gbit; 'none' = loopback "
        "(default 1gbit; needs root, else loopback)",
    )
    b.add_argument(
        "--links",
        type=_links,
        default=None,
        metavar="PROFILES",
        help="the link-profile matrix instead of one --bandwidth: 'all' or a comma-separated list of "
        "1g-burst, 1g-small, 1g-htb, 10g, 100m, 1g-bridge4 (see docs/networks.md); per profile the link is "
        "measured first, then every mode; writes OUT/<profile>/ and OUT/matrix.{md,json,png} (needs root)",
    )
    b.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="samples per rank per step (default 8; with --quality 16 windows for the transformer, 32 "
        "digits, 8 windows for time to accuracy)",
    )
    b.add_argument(
        "--fusion-mb",
        type=_nonneg_float,
        default=25.0,
        help="gradientflow's fusion threshold θ in MB for the gf-* modes (default 25)",
    )
    b.add_argument(
        "--theta-sweep",
        type=_nonneg_float,
        nargs="*",
        default=[],
        metavar="MB",
        help="also time gf-fp32 and DDP at each of these θ / bucket_cap_mb (e.g. 0 1 4 25 100)",
    )
    b.add_argument(
        "--algorithm",
        choices=("native", "ring"),
        default="native",
        help="gradientflow's allreduce: the backend's (native) or its own ring (default native)",
    )
    b.add_argument(
        "--chunk-size",
        type=_positive_int,
        default=None,
        help="CSC chunk size (default 32768, smaller for small models)",
    )
    b.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch threads per rank (default cores/nproc; with --quality 1)",
    )
    b.add_argument(
        "--timeout", type=_positive_int, default=1800, help="seconds before a launch of the ranks is killed (1800)"
    )
    b.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where every rank trains (default cpu); cuda: GPU local-rank mod the GPU count, over NCCL "
        "when each rank of a node has a GPU of its own, else Gloo (which carries CUDA tensors)",
    )
    b.add_argument(
        "--netns-prefix",
        type=_prefix,
        default="gfb",
        help="name prefix of the emulated cluster's namespaces and veths; concurrent runs need "
        "different ones (default gfb)",
    )
    b.add_argument(
        "--out", default=None, help="output directory (default benchmarks/results; with --quality benchmarks/quality)"
    )
    q = b.add_argument_group(
        "--quality options",
        "Train a character-level transformer (AdamW) and the digits CNN (SGD, momentum 0.9) with "
        "each recipe side by side from the same seed and batches, and report final validation loss / accuracy, its "
        "ratio to torch DDP, bytes sent per step and the share of sparse steps; with --bandwidth (root) also time to "
        "accuracy of a bigger transformer and of digits_wide (AlexNet-shaped, 8.4M parameters) on the emulated "
        "cluster, ddp vs gf-recommended (the transformer also gf-fp16-dense and gf-density-0.3). Writes "
        "results.json, table.md, quality_*.png and tta*.png to --out. "
        "See README 'Quality'.",
    )
    q.add_argument("--quality", action="store_true", help="run the quality benchmark instead of timing steps")
    q.add_argument(
        "--recipes",
        nargs="+",
        type=_recipe,
        default=None,
        metavar="RECIPE",
        help=f"recipes to train (default all that apply; ddp is always added): {' '.join(RECIPES)}; "
        "a gf-* recipe may change wrapper options, e.g. gf-recommended:warmup_steps=300,dense_1d=False "
        "(an ablation, trained beside the others on the same seed and batches)",
    )
    q.add_argument(
        "--transformer-size",
        type=_size,
        default=(128, 2),
        metavar="DxL",
        help="d_model x layers of the quality transformer (default 128x2: 0.43M parameters)",
    )
    q.add_argument(
        "--tta-size",
        type=_size,
        default=(256, 4),
        metavar="DxL",
        help="d_model x layers of the time-to-accuracy transformer (default 256x4: 3.2M parameters)",
    )
    q.add_argument("--tta-steps", type=_positive_int, default=300, help="time-to-accuracy training steps (default 300)")
    q.add_argument(
        "--eval-every", type=_positive_int, default=None, help="steps between validations (default steps/20)"
    )
    q.add_argument("--seed", type=_nonneg_int, default=0, help="seed of models and batches (default 0)")

    add_simulate_arguments(
        sub.add_parser(
            "simulate",
            help="cost model: predicted speedup of each technique on 1..512 GPUs, and a planner",
            description="Model one training iteration on N GPUs (ring allreduce α + 2(N-1)/N·bytes/B on a serialised "
            "link, two levels for multi-GPU nodes) with the engine's own layout and CSC arithmetic, for the cumulative "
            "configurations baseline, ring, overlap, fp16, lazy, csc. See README 'Cost model'.",
        )
    )

    t = sub.add_parser(
        "trace-summary",
        help="where the time went in a trace written with trace_path=",
        description="Summarise Chrome traces written by gradientflow.DistributedDataParallel(trace_path=..., "
        "trace_steps=...): per rank file, ms per step in forward, backward, bucket hand-over, the final wait and "
        "CSC phases; collectives by kind with their bytes; blocking waits.",
    )
    t.add_argument("files", nargs="+", metavar="FILE", help="trace file(s), e.g. trace.rank0.json")
    return p


def _trace_summary(args: argparse.Namespace) -> int:
    from gradientflow.diagnostics.trace_summary import summarize

    try:
        print("\n\n".join(summarize(path) for path in args.files))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"gradientflow trace-summary: {exc}", file=sys.stderr)
        return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from gradientflow.bench.demo import DemoOptions, run_demo

    opts = DemoOptions(
        nproc=args.nproc,
        steps=args.steps,
        batch_size=args.batch_size,
        density=args.density or None,
        comm_dtype=args.comm_dtype,
        chunk_size=args.chunk_size,
        lr=args.lr,
        amp=not args.no_amp,
        out=args.out,
    )
    run_demo(opts)
    return 0


def _quality(args: argparse.Namespace) -> int:
    from gradientflow.bench.quality import WORKLOAD_OF_CLI, QualityOptions, run_quality

    if args.device != "cpu":
        print(
            "gradientflow bench: error: --quality trains on CPU (its figures are CPU ones); drop --device",
            file=sys.stderr,
        )
        return 2
    if args.workload is not None and args.workload not in WORKLOAD_OF_CLI:
        print(
            f"gradientflow bench: error: --quality trains {' or '.join(WORKLOAD_OF_CLI)}, not {args.workload}",
            file=sys.stderr,
        )
        return 2
    workloads = [WORKLOAD_OF_CLI[args.workload]] if args.workload else list(WORKLOAD_OF_CLI.values())
    opts = QualityOptions(
        workloads=workloads,
        recipes=args.recipes,
        nproc=args.nproc,
        steps=args.steps or 400,
        tta_steps=args.tta_steps,
        eval_every=args.eval_every,
        batch_size=args.batch_size,
        transformer_size=args.transformer_size,
        tta_size=args.tta_size,
        bandwidth=args.bandwidth,
        threads=args.threads or 1,
        seed=args.seed,
        timeout_s=float(args.timeout),
        prefix=args.netns_prefix,
        out=args.out or "benchmarks/quality",
    )
    run_quality(opts)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from gradientflow.bench.runner import BenchOptions, run_bench

    if args.quality:
        return _quality(args)
    args.workload = args.workload or "resnet50"
    custom = ":" in args.workload
    err = None
    if custom and args.input_shape is None:
        err = f"--workload {args.workload} (your model) needs --input-shape, one sample's shape (e.g. 3,224,224)"
    elif not custom and args.input_shape is not None:
        err = f"--input-shape is for your own model (--workload package.module:factory); {args.workload} has its own"
    elif args.device == "cuda" and not torch.cuda.is_available():
        err = "--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)"
    if err:
        print(f"gradientflow bench: error: {err}", file=sys.stderr)
        return 2
    opts = BenchOptions(
        workload=args.workload,
        input_shape=args.input_shape,
        nproc=args.nproc,
        steps=args.steps or 20,
        warmup=args.warmup,
        modes=list(dict.fromkeys(args.modes)),
        alone=args.alone,
        bandwidth=args.bandwidth,
        batch_size=args.batch_size or 8,
        fusion_mb=args.fusion_mb,
        theta_sweep=list(dict.fromkeys(args.theta_sweep)),
        algorithm=args.algorithm,
        chunk_size=args.chunk_size,
        threads=args.threads,
        timeout_s=float(args.timeout),
        prefix=args.netns_prefix,
        out=args.out or ("benchmarks/links" if args.links else "benchmarks/results"),
        device=args.device,
        links=args.links or [],
    )
    if args.workload == "alexnet" and opts.batch_size > 64:
        logger.warning("alexnet at batch %d per rank is slow on a CPU", opts.batch_size)
    if opts.links:
        from gradientflow.bench.links_matrix import run_links

        run_links(opts)
    else:
        run_bench(opts)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gradientflow`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        if args.command == "simulate":
            from gradientflow.sim.command import run as run_simulate

            return run_simulate(args)
        if args.command == "trace-summary":
            return _trace_summary(args)
        return _demo(args) if args.command == "demo" else _bench(args)
    except KeyboardInterrupt:
        print("gradientflow: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"gradientflow {args.command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # torchrun's ChildFailedError: its table of failed ranks is printed above
        if type(exc).__name__ != "ChildFailedError":
            raise
        print(f"gradientflow {args.command}: a rank failed (see its traceback above)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
