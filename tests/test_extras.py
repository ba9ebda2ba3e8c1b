"""Every ``gradientflow`` subcommand without each optional package: it runs, or it stops within seconds
with one line naming the extra to install; never a traceback (issue 41).

A package is made unimportable by a ``sitecustomize.py`` put first on the ``PYTHONPATH`` of the command
(its ranks inherit it): every finder of ``sys.meta_path`` is wrapped so that none finds it, as if it
were not installed, and every attempt to import a watched package, from any process, is written to a
log (lookups that import nothing, ``importlib.util.find_spec``, are not: torch._dynamo looks up where
scikit-learn is installed, to skip its files when tracing).

Which runs cover "each optional package made unimportable, one at a time": for each subcommand, with
its smallest settings,

1. U: nothing blocked, every optional package watched: the packages it imports, A_U;
2. for each P in A_U, a run with P alone blocked.

A run's only contact with a package is an attempt to import it, so with P blocked, a command that
never attempted P runs exactly as U did: the runs of 2 are the only ones that can differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradientflow.bench.cluster import can_emulate
from gradientflow.diagnostics.extras import EXIT_MISSING_EXTRA, EXTRAS, NO_PLOT

SRC = Path(__file__).resolve().parents[1] / "src"
OPTIONAL = sorted({*EXTRAS, "sklearn", "lightning"})  # + what the demo needed before, and Lightning's other name
STOP_S = 15.0  # "within seconds": a stop comes before any rank starts (importing torch takes a few here)

BLOCKER = """
import sys

BLOCKED, WATCHED, LOG = {blocked!r}, {watched!r}, {log!r}


class _Uninstalled:
    # Wraps each finder of sys.meta_path: a blocked package is found by none of them, as if not installed
    # (``import`` raises ModuleNotFoundError, ``importlib.util.find_spec`` returns None).
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        # an import, not a lookup (importlib.util.find_spec: torch._dynamo probes scikit-learn's path)
        if top in WATCHED and sys._getframe(2).f_code.co_name != "find_spec":
            with open(LOG, "a") as f:
                f.write(top + "\\n")
        if top in BLOCKED:
            return None
        find = getattr(self.finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Uninstalled(f) for f in sys.meta_path]
"""

CAN, _ = can_emulate()
SMALLEST: dict[str, list[str]] = {
    "demo": ["demo", "--nproc", "1", "--steps", "2"],
    "bench": ["bench", "--workload", "small_cnn", "--nproc", "1", "--steps", "1", "--warmup", "0"]
    + ["--modes", "gf-none", "--no-alone", "--bandwidth", "none", "--out", "{out}"],
    "bench --quality": ["bench", "--quality", "--workload", "small_cnn", "--recipes", "ddp", "--nproc", "1"]
    + ["--steps", "2", "--bandwidth", "none", "--out", "{out}"],
    "bench --links": ["bench", "--links", "1g-htb", "--workload", "small_cnn", "--nproc", "2", "--steps", "1"]
    + ["--warmup", "0", "--modes", "gf-none", "--no-alone", "--netns-prefix", "gfxt", "--out", "{out}"],
    "simulate": ["simulate", "--model", "alexnet", "--bandwidth", "1gbit", "--gpu-images-per-s", "100"]
    + ["--gpus", "1,2", "--plot", "{out}/simulate.png"],
    "torch-suite": ["torch-suite", "test_ddp_broadcast_buffer", "--out", "{out}"],
    "trace-summary": ["trace-summary", "{trace}"],
}

USES = {"bench": {"matplotlib"}, "bench --quality": {"matplotlib"}, "bench --links": {"matplotlib"}}
USES |= {"simulate": {"matplotlib"}, "torch-suite": {"expecttest"}, "demo": set(), "trace-summary": set()}
"""The optional packages each subcommand imports (at these settings, in any of its processes)."""


def _run(tmp: Path, name: str, blocked: list[str]) -> tuple[subprocess.CompletedProcess[str], set[str], float, Path]:
    """One run of subcommand ``name`` with ``blocked`` unimportable; (process, imports attempted, seconds, out)."""
    tag = "-".join(blocked) or "none"
    site, out, log = tmp / f"site-{tag}", tmp / f"out-{tag}", tmp / f"imports-{tag}.log"
    site.mkdir()
    log.touch()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked, watched=OPTIONAL, log=str(log)))
    trace = tmp / "trace.json"
    event = {"ph": "X", "name": "forward", "cat": "forward", "ts": 0, "dur": 5, "tid": 0, "pid": 0, "args": {"step": 1}}
    trace.write_text(json.dumps({"traceEvents": [event], "otherData": {"rank": 0, "world_size": 1}}))
    argv = [a.format(out=out, trace=trace) for a in SMALLEST[name]]
    env = {**os.environ, "PYTHONPATH": f"{site}:{SRC}", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "gradientflow.cli", *argv], capture_output=True, text=True, timeout=400, env=env, cwd=tmp
    )
    return proc, set(log.read_text().split()), time.monotonic() - t0, out


def _check(name: str, blocked: list[str], proc: subprocess.CompletedProcess[str], seconds: float) -> None:
    """It ran (exit 0), or stopped within seconds with one line naming the extra of a blocked package."""
    said = f"gradientflow {' '.join(blocked) or 'nothing'} blocked, {name}: rc {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stdout + proc.stderr, said
    if proc.returncode == 0:
        return
    assert proc.returncode == EXIT_MISSING_EXTRA and seconds < STOP_S, said
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    extras = {f"pip install 'gradientflow[{EXTRAS[p][1]}]'" for p in blocked if p in EXTRAS}
    assert line.startswith("gradientflow ") and any(line.endswith(e) for e in extras), said


@pytest.mark.parametrize("name", list(SMALLEST))
def test_every_subcommand_runs_or_names_the_extra_without_each_optional_package(name: str, tmp_path: Path) -> None:
    if name == "bench --links" and not CAN:
        pytest.skip("bench --links needs an emulated cluster (root, tc) here")
    proc, attempted, seconds, _ = _run(tmp_path, name, [])
    _check(name, [], proc, seconds)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert attempted == USES[name], attempted  # the demo no longer imports scikit-learn: the digits ship
    for package in sorted(attempted):
        proc, _, seconds, out = _run(tmp_path, name, [package])
        _check(name, [package], proc, seconds)
        if package == "matplotlib":  # a plot it could not draw: said once, the rest written
            assert proc.returncode == 0 and not list(out.rglob("*.png")) and "plot:" not in proc.stdout
            assert [ln for ln in proc.stderr.splitlines() if "plot" in ln] == [NO_PLOT], proc.stderr
        if package == "matplotlib" and name == "bench --quality":
            _same_tables_with_matplotlib(out, tmp_path)


def _same_tables_with_matplotlib(out: Path, tmp_path: Path) -> None:
    """``bench --quality`` without matplotlib wrote ``table.md`` and ``results.json``; its report stage,
    given those results with matplotlib here, writes the same table, and the plot."""
    from gradientflow.bench import quality_report

    summary = json.loads((out / "results.json").read_text())
    with_plots = tmp_path / "with-matplotlib"
    with_plots.mkdir()
    quality_report.write_all(summary, with_plots)
    assert (with_plots / "table.md").read_text() == (out / "table.md").read_text()
    assert [p.name for p in with_plots.glob("*.png")] == ["quality_digits.png"]


@pytest.mark.parametrize(
    "module, blocked, extra",
    [
        ("gradientflow.integrations.lightning", ["pytorch_lightning", "lightning"], "lightning"),
        ("gradientflow.integrations.accelerate", ["accelerate"], "accelerate"),
    ],
)
def test_an_integration_without_its_client_names_the_extra(module: str, blocked: list[str], extra: str, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked, watched=[], log=str(tmp_path / "log")))
    env = {**os.environ, "PYTHONPATH": f"{site}:{SRC}"}
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gradientflow.diagnostics.extras.MissingExtra: ") or last.startswith("MissingExtra"), last
    assert last.endswith(f"needs {EXTRAS[blocked[0]][0]}: pip install 'gradientflow[{extra}]'"), last
