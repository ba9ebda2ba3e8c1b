"""The ``gradientflow`` command: ``demo``, ``bench``, ``simulate``, ``trace-summary`` and ``torch-suite``.

One module per subcommand, each with ``add_arguments(parser)`` and ``run(args) -> exit code``.  Only
the subcommand named on the command line is imported and given its options: building the options of
``bench`` imports torch and the bench (their vocabularies), which ``gradientflow --help`` and
``gradientflow trace-summary`` have no use for (with the lazy ``gradientflow/__init__.py``, those two
start without importing torch).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NamedTuple

logger = logging.getLogger(__name__)


class Command(NamedTuple):
    module: str
    """The module holding ``add_arguments(parser)`` and ``run(args)``."""
    help: str
    """One line in ``gradientflow --help``; argparse %-formats it, so a literal percent sign is written ``%%``."""
    description: str
    """The command's ``--help`` text; argparse does not %-format a description (it has no ``%(prog)``), so a
    percent sign is written as is."""


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "gradientflow.cli.demo",
        "train a small CNN on handwritten digits (shipped with the package) on N local ranks (compression='auto')",
        "Launch N local ranks with torchrun's API (Gloo, 127.0.0.1) and train small_cnn on "
        "the 8x8 handwritten digits scikit-learn also ships (in the package: no download, no scikit-learn) "
        "with gradientflow.DistributedDataParallel(compression='auto'), the recommended call: SGD with "
        "momentum, so after its first step the top 30% of the gradient's chunks in 3-bit blocks "
        "(the 'topk-3bit' recipe, docs/recipes.md). Reports test accuracy, steps/s and "
        "the bytes sent next to what torch DDP would have sent.",
    ),
    "bench": Command(
        "gradientflow.cli.bench",
        "step time of gradientflow's modes vs torch DDP (+ hooks), side by side in one run",
        "Time gradientflow's modes against torch DDP, DDP + fp16_compress_hook and DDP + PowerSGD, "
        "all in one launch of the ranks (step by step interleaved), plus 'compute' (no communication) as the "
        "1-rank reference for the speedup ratio. With --bandwidth and root: every rank in its own network "
        "namespace, links shaped with tc. Writes results.json, table.md and bench.png (with matplotlib: "
        "pip install 'gradientflow[plot]') to --out. "
        "With --quality: model quality instead of step time (see the --quality options below).",
    ),
    "simulate": Command(
        "gradientflow.sim.command",
        "cost model: predicted speedup of each technique on 1..512 GPUs, and a planner",
        "Model one training iteration on N GPUs (ring allreduce α + 2(N-1)/N·bytes/B on a serialised "
        "link, two levels for multi-GPU nodes) with the engine's own layout and CSC arithmetic, for the cumulative "
        "configurations baseline, ring, overlap, fp16, lazy, csc. See docs/cost-model.md.",
    ),
    "trace-summary": Command(
        "gradientflow.cli.trace_summary",
        "where the time went in a trace written with trace_path=",
        "Summarise Chrome traces written by gradientflow.DistributedDataParallel(trace_path=..., "
        "trace_steps=...): per rank file, ms per step in forward, backward, bucket hand-over, the final wait and "
        "CSC phases; collectives by kind with their bytes; blocking waits.",
    ),
    "torch-suite": Command(
        "gradientflow.cli.torch_suite",
        "torch's own DDP tests (from the installed wheel) on torch DDP and on gradientflow, side by side",
        "Run the DDP tests of torch's distributed_test.py with 2 Gloo ranks on the CPU (CUDA mapped onto it), "
        "once on torch's DistributedDataParallel and once on gradientflow's, and print/write the table of "
        "outcomes (table.md, results.json in --out). Default: the tests torch DDP passes here; --all: every "
        "DDP test; --ci: the CI selection. Needs expecttest (pip install 'gradientflow[torch-suite]'). "
        "See docs/torch-ddp-suite.md.",
    ),
}


def _named_command(argv: list[str]) -> str | None:
    """The subcommand on the command line: the first word that is not an option (the top level takes
    only flags), if it names one."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def _version() -> str:
    """The installed package's version (its metadata: no import of torch or of the package itself)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gradientflow")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``gradientflow``; only the subcommand named in ``argv`` gets its options (every
    subcommand does when ``argv`` is None)."""
    p = argparse.ArgumentParser(
        prog="gradientflow",
        description="GradientFlow-style gradient communication for PyTorch data-parallel training.",
        epilog="Run 'gradientflow COMMAND --help' for the options of a command.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    named = None if argv is None else _named_command(argv)
    for name, command in COMMANDS.items():
        parser = sub.add_parser(name, help=command.help, description=command.description)
        if argv is None or name == named:
            importlib.import_module(command.module).add_arguments(parser)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gradientflow`` console script."""
    from gradientflow.diagnostics.extras import EXIT_MISSING_EXTRA, MissingExtra

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(argv).parse_args(argv)
    except MissingExtra as exc:  # a subcommand's options need an optional package
        print(f"gradientflow: {exc}", file=sys.stderr)
        return EXIT_MISSING_EXTRA
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        return int(importlib.import_module(COMMANDS[args.command].module).run(args))
    except MissingExtra as exc:  # checked before any rank or long work started: one line, no traceback
        print(f"gradientflow {args.command}: {exc}", file=sys.stderr)
        return EXIT_MISSING_EXTRA
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
