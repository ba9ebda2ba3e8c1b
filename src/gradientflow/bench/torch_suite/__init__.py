"""``gradientflow torch-suite``: torch's own DDP tests (from the installed wheel) as the oracle.

Runs the DDP tests of ``torch/testing/_internal/distributed/distributed_test.py`` with 2 Gloo
ranks on the CPU (CUDA mapped onto it, see :mod:`.harness`), once on torch's
``DistributedDataParallel`` and once on gradientflow's, and prints/writes the table of outcomes.

    python -m gradientflow.bench.torch_suite [--all | TEST ...] [--out DIR] [--only torch|gradientflow]

Default selection: :data:`DEFAULT`, the DDP tests torch DDP itself passes here; ``--all``: every
DDP test of the module (``test_DistributedDataParallel*``, ``test_ddp_*`` and the others that
construct DDP).
"""

from __future__ import annotations

import argparse
import sys

from .selection import CI, DEFAULT

__all__ = ["CI", "DEFAULT", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradientflow torch-suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", help="test names (default: the default selection)")
    parser.add_argument("--all", action="store_true", help="every DDP test of torch's distributed_test.py")
    parser.add_argument("--ci", action="store_true", help="the CI-sized selection tests/compat runs")
    parser.add_argument("--out", default="results/torch_suite", help="where table.md and results.json go")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout per test (s)")
    args = parser.parse_args(argv)
    from .harness import all_ddp_tests
    from .runner import run_tests, write

    if args.all:
        names = all_ddp_tests()
    elif args.ci:
        names = list(CI)
    else:
        names = args.tests or list(DEFAULT)
    by_impl = {impl: run_tests(impl, names, args.pg_timeout) for impl in ("torch", "gradientflow")}
    command = "python -m gradientflow.bench.torch_suite " + " ".join(argv if argv is not None else sys.argv[1:])
    print(write(args.out, names, by_impl, command.strip()))
    return 0
