"""``gradientflow torch-suite``: torch's own DDP tests, run on torch DDP and on gradientflow side by side.

The runner is :mod:`gradientflow.bench.torch_suite` (also ``python -m gradientflow.bench.torch_suite``);
imported only when this subcommand is named (its harness imports torch's test modules).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gradientflow.bench import torch_suite

    torch_suite.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from gradientflow.bench import torch_suite

    return torch_suite.run(args, "gradientflow " + " ".join(sys.argv[1:]))
