"""``gradientflow trace-summary FILE...``: where the time went in traces written with ``trace_path=``.

Imports neither torch nor the engine: reading a trace is plain JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

EXPECTED = "the Chrome-trace JSON that gradientflow.DistributedDataParallel(trace_path=...) writes"


def add_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument("files", nargs="+", metavar="FILE", help="trace file(s), e.g. trace.rank0.json")


def _fail(message: str) -> int:
    print(f"gradientflow trace-summary: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from gradientflow.diagnostics.trace_summary import summarize

    reports = []
    for path in args.files:
        try:
            reports.append(summarize(path))
        except OSError as exc:
            return _fail(f"cannot read {path}: {exc.strerror or exc}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _fail(f"{path} is not a trace: expected {EXPECTED}, but it is not JSON ({exc})")
        except ValueError as exc:  # JSON, but no traceEvents list
            return _fail(f"{exc}: expected {EXPECTED}")
        except (KeyError, TypeError, AttributeError) as exc:  # JSON events unlike the ones the engine writes
            return _fail(f"{path} is not a trace: expected {EXPECTED}, but its events are not ({exc!r})")
    print("\n\n".join(reports))
    return 0
