"""``gradientflow torch-suite``: torch's own DDP tests (from the installed wheel) as the oracle.

Runs the DDP tests of ``torch/testing/_internal/distributed/distributed_test.py`` with 2 Gloo
ranks on the CPU (CUDA mapped onto it, see :mod:`.harness`), once on torch's
``DistributedDataParallel`` and once on gradientflow's, and prints/writes the table of outcomes.

    python -m gradientflow.bench.torch_suite [--all | --ci | TEST ...] [--out DIR]
    gradientflow torch-suite [--all | --ci | TEST ...] [--out DIR]        # the same, from the CLI

    gradientflow torch-suite --fsdp PATH [TEST ...] [--out DIR]  # torch's FSDP2 tests from a pytorch checkout

Default selection: :data:`DEFAULT`, the DDP tests torch DDP itself passes here; ``--all``: every
DDP test of the module (``test_DistributedDataParallel*``, ``test_ddp_*`` and the others that
construct DDP).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .selection import CI, DEFAULT

if TYPE_CHECKING:
    from .runner import Outcome

__all__ = ["CI", "DEFAULT", "add_arguments", "main", "run"]

DEFAULT_OUT = "results/torch_suite"  # --fsdp: results/torch_fsdp_suite


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The runner's options (also ``gradientflow torch-suite``'s)."""
    parser.add_argument("tests", nargs="*", help="test names (default: the default selection)")
    parser.add_argument("--all", action="store_true", help="every DDP test of torch's distributed_test.py")
    parser.add_argument("--ci", action="store_true", help="the CI-sized selection tests/compat runs")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where table.md and results.json go")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout per test (s)")
    parser.add_argument(
        "--fsdp",
        metavar="PATH",
        help="torch's FSDP2 tests instead: a pytorch checkout's test/distributed/_composable/fsdp (or one of its "
        "test_fully_shard*.py); the tests reaching a 2-D mesh, on torch's fully_shard and on gradientflow's",
    )
    parser.add_argument(
        "--compression", default="none", help="--fsdp: gradientflow's recipe (default none: torch's HSDP reduction)"
    )
    parser.add_argument(
        "--deadline", type=float, default=900.0, help="--fsdp: seconds one test may run (per implementation)"
    )
    parser.add_argument(
        "--only",
        choices=("torch", "gradientflow"),
        help="run one implementation; the other's outcomes are read from --out's results.json (an earlier run)",
    )


def run(args: argparse.Namespace, command: str) -> int:
    """Run the selection on torch DDP, then on gradientflow; print and write the table (``command``: how
    it was invoked, recorded in the table)."""
    from gradientflow.diagnostics.extras import require

    if args.fsdp is not None:  # torch's FSDP2 tests from the user's checkout (bench/torch_suite/fsdp.py)
        require("expecttest", "running torch's own FSDP2 tests")
        from .fsdp import run as run_fsdp

        if args.out == DEFAULT_OUT:
            args.out = "results/torch_fsdp_suite"
        return run_fsdp(args, command)
    # torch's test modules (torch.testing._internal.common_utils) import expecttest, a test-only package
    require("expecttest", "running torch's own DDP tests")
    from .harness import all_ddp_tests
    from .runner import read_other, run_tests, write

    if args.all:
        names = all_ddp_tests()
    elif args.ci:
        names = list(CI)
    else:
        names = args.tests or list(DEFAULT)
    note = ""
    other: dict[str, list[Outcome]] = {}
    if args.only is not None:  # torch DDP's outcomes do not depend on gradientflow's code: re-use them
        # read before running: a missing column is the user's to fix now, not after minutes of tests
        other, source = read_other(args.out, args.only, names)
        note = f"; the other column re-used from: {source}"
    impls = ("torch", "gradientflow") if args.only is None else (args.only,)
    by_impl = {impl: run_tests(impl, names, args.pg_timeout) for impl in impls}
    by_impl.update(other)
    print(write(args.out, names, by_impl, command.strip(), note))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gradientflow.bench.torch_suite [options]``."""
    parser = argparse.ArgumentParser(prog="gradientflow torch-suite", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(parser.parse_args(argv), "python -m gradientflow.bench.torch_suite " + " ".join(argv))
