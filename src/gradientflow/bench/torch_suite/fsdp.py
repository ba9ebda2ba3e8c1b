"""``gradientflow torch-suite --fsdp PATH``: torch's own FSDP2 tests, from the user's pytorch checkout, as the oracle.

torch's FSDP2 tests are not in the wheel (only their harness, ``common_fsdp.py``, is): PATH is a pytorch checkout's
``test/distributed/_composable/fsdp`` (or one of its ``test_fully_shard*.py``).  The tests that reach a 2-D mesh
(:mod:`.fsdp_selection`; positional names narrow them) run once on torch's ``fully_shard`` and once with
gradientflow's substituted where the 2-D mesh reaches it (:mod:`.fsdp_substitute`), each in a process of its own
(:mod:`.fsdp_rank`: torch's harness spawns the ranks from it, or runs them as threads) with a deadline; the table
of outcomes is written as the DDP runner writes its own (:func:`.runner.write`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import gradientflow

from .fsdp_selection import select, test_files
from .runner import Outcome, read_other, write

IMPLS = ("torch", "gradientflow")


def run_one(impl: str, path: str, test_id: str, compression: str, deadline: float) -> Outcome:
    """``test_id`` of ``path`` on ``impl`` in a process of its own (a session: the ranks it spawns end with it)."""
    with tempfile.TemporaryDirectory(prefix="gf-fsdp-suite-") as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "gradientflow.bench.torch_suite.fsdp_rank",
            impl,
            compression,
            path,
            test_id,
            result,
        ]
        t0 = time.perf_counter()
        # in a scratch directory (torch's harness writes files where it runs), this gradientflow importable from it
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(gradientflow.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp, env=env
        )
        try:
            out, _ = proc.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this runner started for the test: it and its ranks
            proc.communicate()
            return Outcome(
                test_id, "fail", time.perf_counter() - t0, f"no result before the deadline ({deadline:.0f} s)"
            )
        seconds = time.perf_counter() - t0
        try:
            with open(result) as f:
                got = json.load(f)
        except (OSError, ValueError):
            tail = out.decode(errors="replace")[-3000:]
            return Outcome(test_id, "fail", seconds, f"the test process exited {proc.returncode}: {tail}")
        return Outcome(test_id, got["outcome"], seconds, got["detail"])


def run(args: argparse.Namespace, command: str) -> int:
    """Select, run on torch's ``fully_shard`` and on gradientflow's, print and write the table."""
    picked = select(test_files(args.fsdp), args.tests)
    if not picked:
        print(f"gradientflow torch-suite --fsdp: no test reaching a 2-D mesh in {args.fsdp} matches {args.tests}")
        return 1
    names = [t for _, t in picked]
    other: dict[str, list[Outcome]] = {}
    note = f"; tests from {os.path.abspath(args.fsdp)}; gradientflow with compression={args.compression!r}"
    if args.only is not None:
        other, source = read_other(args.out, args.only, names)
        note += f"; the other column re-used from: {source}"
    impls = IMPLS if args.only is None else (args.only,)
    by_impl: dict[str, list[Outcome]] = {impl: [] for impl in impls}
    for path, test_id in picked:
        for impl in impls:
            o = run_one(impl, path, test_id, args.compression, args.deadline)
            by_impl[impl].append(o)
            print(f"  {impl:12s} {o.outcome:4s} {o.seconds:6.1f}s {test_id}", flush=True)
    by_impl.update(other)
    print(write(args.out, names, by_impl, command.strip(), note, oracle="torch fully_shard"))
    return 0
