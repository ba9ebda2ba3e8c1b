"""``gradientflow bench``: step time of gradientflow's modes against torch DDP, side by side in one run
(its ``--quality`` options and run are in :mod:`gradientflow.cli.quality`)."""

from __future__ import annotations

import argparse
import logging
import sys

from ..bench.links import PROFILES
from . import quality, types

logger = logging.getLogger(__name__)


def add_arguments(b: argparse.ArgumentParser) -> None:
    from gradientflow.bench.runner_spec import EXTRA_MODES, MODES, OPTIMIZERS
    from gradientflow.sim.command import parse_shape

    b.add_argument(
        "--workload",
        type=types.workload,
        default=None,
        metavar="MODEL",
        help=f"{' | '.join(types.WORKLOAD_CHOICES)} | package.module:factory (your model: a zero-argument "
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
    b.add_argument(
        "--nproc",
        type=types.positive_int,
        default=2,
        help="ranks in all (default 2); nodes = NPROC / --nproc-per-node",
    )
    b.add_argument(
        "--nproc-per-node",
        type=types.positive_int,
        default=1,
        metavar="K",
        help="ranks per node (default 1: every rank its own node). K > 1: each node one torchrun with "
        "--nproc-per-node K and a c10d rendezvous across nodes, as on real machines; on an emulated "
        "cluster the ranks of a node talk over its loopback and only traffic between nodes crosses the "
        "shaped link (docs/multi-node.md). NPROC must be a multiple of K",
    )
    b.add_argument(
        "--steps",
        type=types.positive_int,
        default=None,
        help="timed steps per mode (default 20); with --quality training steps per workload (default 400)",
    )
    b.add_argument("--warmup", type=types.nonneg_int, default=3, help="untimed steps per mode first (default 3)")
    b.add_argument(
        "--modes",
        nargs="+",
        type=types.bench_mode,
        default=list(MODES),
        metavar="MODE",
        help=f"modes to compare (default all of {' '.join(MODES)}); also {' '.join(EXTRA_MODES)} "
        '(gf-RECIPE: compression="RECIPE", a row of docs/recipes.md; gf-auto: the --optimizer\'s recipe; hsdp, '
        "hsdp-bf16: torch's FSDP2 on the mesh (nodes, --nproc-per-node), its reduction between nodes in fp32 / bf16; "
        "fsdp-RECIPE: gradientflow.fsdp.fully_shard with that recipe there). A gradientflow mode may pass wrapper "
        "options after a colon (e.g. gf-topk-fp16:csc_scope=global) and end in @flat, @auto or @MxG: the "
        "engine's topology option (e.g. gf-fp16@flat beside gf-fp16); 'compute' is always added",
    )
    b.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="sgd",
        help="the step-time bench's optimizer (default sgd: SGD momentum 0.9; adamw: AdamW lr 1e-3, betas "
        "(0.9, 0.95), weight decay 0.1, with which gf-auto runs the quantised recipe)",
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
        type=types.bandwidth,
        default="1gbit",
        help="per-node link rate of the emulated cluster, e.g. 1gbit, 10gbit; 'none' = loopback "
        "(default 1gbit; needs root, else loopback)",
    )
    b.add_argument(
        "--links",
        type=types.links,
        default=None,
        metavar="PROFILES",
        help="the link-profile matrix instead of one --bandwidth: 'all' or a comma-separated list of "
        f"{', '.join(PROFILES)} (see docs/networks.md); per profile "
        "the link is measured first, then every mode; writes OUT/<profile>/ and OUT/matrix.{md,json,png} (needs root)",
    )
    b.add_argument(
        "--batch-size",
        type=types.positive_int,
        default=None,
        help="samples per rank per step (default 8; with --quality 16 windows for the transformer, 32 "
        "digits, 8 windows for time to accuracy)",
    )
    b.add_argument(
        "--fusion-mb",
        type=types.nonneg_float,
        default=25.0,
        help="gradientflow's fusion threshold θ in MB for the gf-* modes (default 25)",
    )
    b.add_argument(
        "--theta-sweep",
        type=types.nonneg_float,
        nargs="*",
        default=[],
        metavar="MB",
        help="also time gf-none and DDP at each of these θ / bucket_cap_mb (e.g. 0 1 4 25 100)",
    )
    b.add_argument(
        "--algorithm",
        choices=("native", "ring"),
        default="native",
        help="gradientflow's allreduce: the backend's (native) or its own ring (default native)",
    )
    b.add_argument(
        "--chunk-size",
        type=types.positive_int,
        default=None,
        help="CSC chunk size (default 32768, smaller for small models)",
    )
    b.add_argument(
        "--threads",
        type=types.positive_int,
        default=None,
        help="torch threads per rank (default cores/nproc; with --quality 1)",
    )
    b.add_argument(
        "--timeout", type=types.positive_int, default=1800, help="seconds before a launch of the ranks is killed (1800)"
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
        type=types.prefix,
        default="gfb",
        help="name prefix of the emulated cluster's namespaces and veths; concurrent runs need "
        "different ones (default gfb)",
    )
    b.add_argument(
        "--out", default=None, help="output directory (default benchmarks/results; with --quality benchmarks/quality)"
    )
    quality.add_arguments(b)


def run(args: argparse.Namespace) -> int:
    import torch

    from gradientflow.bench.runner import BenchOptions, run_bench

    if args.quality:
        from .quality import run as run_quality

        return run_quality(args)
    args.workload = args.workload or "resnet50"
    custom = ":" in args.workload
    err = None
    if custom and args.input_shape is None:
        err = f"--workload {args.workload} (your model) needs --input-shape, one sample's shape (e.g. 3,224,224)"
    elif not custom and args.input_shape is not None:
        err = f"--input-shape is for your own model (--workload package.module:factory); {args.workload} has its own"
    elif args.nproc % args.nproc_per_node:
        err = (
            f"--nproc {args.nproc} (ranks in all) is not a multiple of --nproc-per-node {args.nproc_per_node}: "
            f"pass e.g. --nproc {args.nproc_per_node * max(2, args.nproc // args.nproc_per_node)}"
        )
    elif args.links and args.nproc_per_node > 1:
        err = "--links measures one rank per node; drop --nproc-per-node or --links"
    elif args.device == "cuda" and not torch.cuda.is_available():
        err = "--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)"
    if err:
        print(f"gradientflow bench: error: {err}", file=sys.stderr)
        return 2
    opts = BenchOptions(
        workload=args.workload,
        input_shape=args.input_shape,
        nproc=args.nproc,
        nproc_per_node=args.nproc_per_node,
        optimizer=args.optimizer,
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
        transformer_size=args.transformer_size,
    )
    if args.workload == "alexnet" and opts.batch_size > 64:
        logger.warning("alexnet at batch %d per rank is slow on a CPU", opts.batch_size)
    if opts.links:
        from gradientflow.bench.links_matrix import run_links

        run_links(opts)
    else:
        run_bench(opts)
    return 0
