"""``gradientflow simulate``: its options and what it prints.

Kept out of cli.py, which only registers the subcommand and calls :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from gradientflow.bench.models import resolve_model

from .config import CONFIGS, SimConfig, parse_bandwidth
from .model_profile import INPUT_DTYPES, ModelProfile, flop_profile, measured_profile
from .planner import plan, plan_markdown, recommendation
from .presets import IMAGENET_SHAPE, MEASURED_LATENCY_1GBIT, PAPER_COMMON, PAPER_MODEL, PAPER_TARGETS, paper_values
from .recipes import recipe_rows, recipes_markdown
from .report import ablation, ablation_markdown, paper_comparison, plot, to_json

DEFAULTS: dict[str, Any] = {
    "latency": 50e-6,
    "intra_latency": 10e-6,
    "batch": 32,
    "gpus_per_node": 1,
    "theta_mb": 25.0,
    "density": 0.1,
    "chunk_size": 32768,
}


def parse_seconds(text: str) -> float:
    """``50us`` / ``0.2ms`` / ``1e-5`` (seconds) -> seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)(s|ms|us|µs|ns)?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a time like 50us, 0.2ms or 1e-5 (seconds), got {text!r}")
    return float(m.group(1)) * {"s": 1.0, None: 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[m.group(2)]


def _bandwidth(text: str) -> float:
    try:
        return parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU counts like 1,8,64,512, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"GPU counts must be integers >= 1, got {text!r}")
    return sorted(set(vals))


def parse_shape(text: str) -> tuple[int, ...]:
    """``--input-shape``: one sample's shape, e.g. ``3,224,224`` (positive ints); shared with ``bench``."""
    try:
        shape = tuple(int(t) for t in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected a per-sample shape like 3,224,224, got {text!r}")
    return shape


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``gradientflow simulate``; unset ones come from --preset, else DEFAULTS."""
    p.add_argument("--model", default="resnet50", help="alexnet | resnet50 | module:factory (default resnet50)")
    p.add_argument("--gpus", type=_ints, default=[1, 8, 64, 512], help="GPU counts (default 1,8,64,512)")
    p.add_argument("--preset", choices=("paper",), help="the paper's cluster: V100, 56 Gbit/s (docs/cost-model.md)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs sharing one node's link (default 1)")
    p.add_argument("--bandwidth", type=_bandwidth, help="one node's link, e.g. 56gbit, 10gbit, 12gb/s")
    p.add_argument("--intra-bandwidth", type=_bandwidth, help="between GPUs of a node, e.g. 15.75gb/s")
    p.add_argument(
        "--latency",
        type=parse_seconds,
        help="α per inter-node collective (default 50us: assumed, the paper's InfiniBand; measured here on 1 Gbit/s "
        "Ethernet with Gloo: 423us)",
    )
    p.add_argument("--intra-latency", type=parse_seconds, help="α per intra-node collective (default 10us)")
    p.add_argument("--batch", type=int, help="images per GPU per iteration (default 32)")
    p.add_argument("--gpu-images-per-s", type=float, help="one GPU's compute-only throughput, images/s")
    p.add_argument("--theta-mb", type=float, help="θ of lazy allreduce in MiB of fp32 gradient (default 25)")
    p.add_argument("--density", type=float, help="top-k (the paper's CSC): fraction of chunks sent (default 0.1)")
    p.add_argument("--chunk-size", type=int, help="top-k (the paper's CSC): gradients per chunk (default 32768)")
    p.add_argument(
        "--pass-gbps",
        type=float,
        help="GB/s of one elementwise pass over the fp32 gradient pool "
        "(default: free; --preset paper: 450; --profile times the engine's own passes here instead)",
    )
    p.add_argument(
        "--input-shape",
        type=parse_shape,
        help="per-sample input shape (default 3,224,224; with "
        "--profile of a built-in model, the bench's: 3,32,32 resnet50, 3,64,64 alexnet)",
    )
    p.add_argument(
        "--input-dtype",
        choices=tuple(INPUT_DTYPES),
        help="what the model's input is made of: float, or token ids (long, int) for a language model "
        "(default: long where the model's first layer is an nn.Embedding, else float)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="time forward/backward/update of the model here "
        "(CPU, 1 thread, --batch) instead of scaling FLOP shares to --gpu-images-per-s",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="planner: DDP, DDP + fp16 and gradientflow at several densities, with the best θ per GPU count",
    )
    p.add_argument(
        "--recipes",
        action="store_true",
        help="also model every recipe of the table (compression=..., docs/recipes.md) at --theta-mb; "
        "'auto' as it runs for --optimizer (default sgd)",
    )
    p.add_argument(
        "--optimizer",
        choices=("sgd", "adamw"),
        help='with --plan: what compression="auto" runs for this optimizer (sgd: top-k, modelled as "topk-fp16"; '
        'adamw, also Adam and other adaptive ones: "3bit"), its step time and bytes against DDP',
    )
    p.add_argument(
        "--validate",
        metavar="RESULTS_JSON",
        help="compare the model's step time with a `gradientflow bench` run (its results.json), mode by mode, "
        "on the run's layout (nodes x ranks per node, flat and two-level); with --alpha-beta and, for nodes "
        "of several ranks, --loopback-fit (python -m gradientflow.sim.measure [--loopback]); "
        "see docs/cost-model.md",
    )
    p.add_argument(
        "--alpha-beta",
        default="benchmarks/sim_validation/alpha_beta.json",
        help="with --validate: α and B of the bench's link (default %(default)s)",
    )
    p.add_argument("--loopback-fit", help="with --validate: α and B inside a node, measured on loopback")
    p.add_argument(
        "--validate-out", help="with --validate: where validation.{md,json} go (default: beside RESULTS_JSON)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="write the speedup-vs-GPUs plot (PNG) here; needs matplotlib (pip install 'gradientflow[plot]'), "
        "without it the tables are printed and no plot is written (default: no plot)",
    )


def build(args: argparse.Namespace) -> tuple[str, ModelProfile, SimConfig, dict[str, Any]]:
    """1. Resolve the model; 2. merge preset, defaults and options; 3. profile; 4. validate."""
    name, factory = resolve_model(args.model)
    values: dict[str, Any] = dict(DEFAULTS)
    if args.preset == "paper":
        values.update(paper_values(name))
    given = {
        "gpus_per_node": args.gpus_per_node,
        "bandwidth": args.bandwidth,
        "latency": args.latency,
        "intra_bandwidth": args.intra_bandwidth,
        "intra_latency": args.intra_latency,
        "batch": args.batch,
        "gpu_images_per_s": args.gpu_images_per_s,
        "theta_mb": args.theta_mb,
        "density": args.density,
        "chunk_size": args.chunk_size,
        "pass_bytes_per_s": None if args.pass_gbps is None else args.pass_gbps * 1e9,
    }
    values.update({k: v for k, v in given.items() if v is not None})
    if "bandwidth" not in values:
        raise ValueError("give --bandwidth (one node's link, e.g. 10gbit) or --preset paper")
    dtype = None if args.input_dtype is None else INPUT_DTYPES[args.input_dtype]
    if args.profile:
        from gradientflow.bench.models import WORKLOADS

        shape = args.input_shape or (WORKLOADS[name].input_shape if name in WORKLOADS else IMAGENET_SHAPE)
        profile = measured_profile(name, factory, shape, int(values["batch"]), input_dtype=dtype)
        values["gpu_images_per_s"] = values["batch"] / sum(profile.times or (1.0,))
    else:
        if "gpu_images_per_s" not in values:
            raise ValueError("give --gpu-images-per-s (one GPU's compute-only images/s), --profile, or --preset paper")
        profile = flop_profile(name, factory, args.input_shape or IMAGENET_SHAPE, dtype)
    cfg = SimConfig(**values)
    assumptions: dict[str, Any] = {
        k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in cfg.as_dict().items()
    }
    assumptions["profile"] = profile.source
    assumptions["n_params"] = profile.n_params
    if profile.times is not None:
        assumptions["measured_forward_backward_update_s"] = list(profile.times)
        assumptions["measured_local_passes_s"] = profile.local_s
    if args.preset == "paper":
        assumptions["sources"] = {a.name: a.source for a in (*PAPER_COMMON, *PAPER_MODEL[name])}
    assumptions["latency_source"] = latency_source(args)
    return name, profile, cfg, assumptions


def latency_source(args: argparse.Namespace) -> str:
    """Where α came from, with the measured 1 Gbit/s value beside an assumed one."""
    if args.latency is not None:
        return f"given: --latency {args.latency * 1e6:g}us"
    measured = f"measured on 1 Gbit/s Ethernet with Gloo: {MEASURED_LATENCY_1GBIT.shown} (--latency 423us)"
    return f"assumed {DEFAULTS['latency'] * 1e6:g} µs per collective (the paper's InfiniBand, not measured); {measured}"


def run(args: argparse.Namespace) -> int:
    """Print the ablation (or the plan) as a table or JSON; write the plot if asked (or, with
    ``--validate``, the model against a bench's results.json: :mod:`gradientflow.sim.validate`)."""
    if args.validate:
        from .validate import main as validate_main  # noqa: PLC0415 — imports the bench's modules

        argv = ["--bench", args.validate, "--alpha-beta", args.alpha_beta]
        argv += ["--out", args.validate_out or str(Path(args.validate).parent / "validation")]
        if args.loopback_fit:
            argv += ["--loopback-fit", args.loopback_fit]
        return validate_main(argv)
    try:
        name, profile, cfg, assumptions = build(args)
        rows = ablation(profile, cfg, args.gpus)
        planned = plan(profile, cfg, args.gpus) if args.plan else None
        per_recipe = recipe_rows(profile, cfg, args.gpus, args.optimizer or "sgd") if args.recipes else None
    except ValueError as exc:
        print(f"gradientflow simulate: {exc}", file=sys.stderr)
        return 2
    plotted = False  # a plot only where one was asked for (--plot), and only claimed where it was written
    if args.plot:
        targets = [(n, sp, f"{c} {sp:g}x") for m, n, c, sp, _ in PAPER_TARGETS if m == name and n in args.gpus]
        plotted = plot(name, rows, args.plot, targets if args.preset == "paper" else None)
    if args.json:
        out = to_json(name, assumptions, rows)
        if planned is not None:
            out["plan"] = [
                {
                    "gpus": r.gpus,
                    "system": r.system,
                    "theta_mb": r.theta_mb,
                    "iteration_s": r.result.iteration_s,
                    "speedup": r.result.speedup,
                    "bytes_per_gpu": r.result.bytes_per_gpu,
                }
                for r in planned
            ]
            if args.optimizer is not None:
                out["recommendation"] = recommendation(planned, args.optimizer).splitlines()
        if per_recipe is not None:
            out["recipes"] = [
                {"gpus": r.gpus, "recipe": r.config, "iteration_s": r.iteration_s, "speedup": r.speedup,
                 "bytes_per_gpu": r.bytes_per_gpu}
                for r in per_recipe
            ]  # fmt: skip
        print(json.dumps(out, indent=1, default=lambda v: None))
        return 0
    print(
        f"{name}: {profile.n_params:,} parameters, layer times from {profile.source}; t(1) = "
        f"{rows[0].compute_s * 1e3:.1f} ms per iteration; configs cumulative: {', '.join(CONFIGS)}\n"
    )
    print(ablation_markdown(rows))
    if args.preset == "paper":
        print(paper_comparison(name, profile, cfg))
    if planned is not None:
        print(plan_markdown(planned, args.optimizer))
        print(f"Latency α: {assumptions['latency_source']}.")
        if args.optimizer is not None:
            print(recommendation(planned, args.optimizer))
    if per_recipe is not None:
        print(recipes_markdown(per_recipe, args.optimizer or "sgd"))
    if plotted:
        print(f"plot: {Path(args.plot)}")
    return 0
