"""Run torch's DDP tests on torch DDP and on gradientflow side by side; the table of outcomes.

One process per rank runs a list of tests (torch's ``MultiProcessTestCase`` spawns two fresh
processes per test, ~40 s each on a loaded 2-core machine; here a test costs about what its body
costs).  A rank that dies or a test that outlives its deadline ends that pair of processes; the
test is run again on a pair of its own and a fresh pair goes on with the next test.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import tempfile
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

WORLD_SIZE = 2


@dataclass
class Outcome:
    test: str
    outcome: str  # "pass" | "fail" | "skip"
    seconds: float
    detail: str  # the first failing rank's traceback (tail), or the skip reason


def _combine(name: str, per_rank: dict[int, tuple[str, str, float]]) -> Outcome:
    outcomes = [per_rank[r][0] for r in sorted(per_rank)]
    seconds = max(v[2] for v in per_rank.values())
    for r in sorted(per_rank):
        if per_rank[r][0] == "fail":
            return Outcome(name, "fail", seconds, f"rank {r}: {per_rank[r][1]}")
    if "skip" in outcomes:
        return Outcome(name, "skip", seconds, next(v[1] for v in per_rank.values() if v[0] == "skip"))
    return Outcome(name, "pass", seconds, "")


# Tests that run longer than 3 process-group timeouts on torch DDP itself (seconds allowed).
SLOW = {"test_ddp_uneven_inputs": 900.0}


def _run_pair(
    impl: str, todo: list[str], workdir: str, pg_timeout: float, progress: bool
) -> tuple[list[Outcome], bool]:
    """Run ``todo`` on one pair of rank processes until the end or a crash.

    Returns the outcomes and whether the last one is a crash (a rank died or outlived its deadline).
    A crash may be the previous test's doing (seen: SIGSEGV in the test after one of torch DDP's
    expected-error tests), so the caller runs a crashed test again on a pair of its own.
    """
    from .harness import worker  # noqa: PLC0415 - the runner's own import stays light

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(impl, r, todo, workdir, pg_timeout, q), daemon=True) for r in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    out: list[Outcome] = []
    pending: dict[str, dict[int, tuple[str, str, float]]] = {}
    crashed = False
    allowed = SLOW.get(todo[0], 3 * pg_timeout) + 120  # the first test also pays the imports
    deadline = time.monotonic() + allowed
    try:
        while len(out) < len(todo):
            name = todo[len(out)]
            try:
                rank, got, outcome, detail, secs = q.get(timeout=1.0)
                pending.setdefault(got, {})[rank] = (outcome, detail, secs)
            except queue.Empty:
                pass
            if len(pending.get(name, {})) == WORLD_SIZE:
                out.append(_combine(name, pending.pop(name)))
                if progress:
                    print(f"  {impl:12s} {out[-1].outcome:4s} {out[-1].seconds:6.1f}s {name}", flush=True)
                if len(out) < len(todo):
                    deadline = time.monotonic() + SLOW.get(todo[len(out)], 3 * pg_timeout)
                continue
            dead = [p for p in procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                why = f"rank process exited with code {dead[0].exitcode}" if dead else "no result before deadline"
                out.append(Outcome(name, "fail", 0.0, why))
                crashed = True
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
    return out, crashed


def run_tests(impl: str, names: list[str], pg_timeout: float = 60.0, progress: bool = True) -> list[Outcome]:
    """Run ``names`` on ``impl`` ("torch" or "gradientflow") with 2 Gloo ranks; one Outcome per test.

    A test whose ranks crash (or hang past the deadline) in a shared pair is run once more on a
    fresh pair of its own; its outcome there is the one recorded.
    """
    results: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="gf-torch-suite-") as tmp:
        k = 0
        while len(results) < len(names):
            todo = names[len(results) :]
            k += 1
            out, crashed = _run_pair(impl, todo, os.path.join(tmp, f"run{k:03d}"), pg_timeout, progress)
            if crashed and len(out) > 1:  # not alone on its pair: once more, alone
                k += 1
                alone, _ = _run_pair(impl, [out[-1].test], os.path.join(tmp, f"run{k:03d}"), pg_timeout, progress)
                out[-1] = alone[0]
            if crashed and progress:
                print(f"  {impl:12s} {out[-1].outcome:4s} (crash) {out[-1].test}: {out[-1].detail[:80]}", flush=True)
            results.extend(out)
    return results


def table(names: list[str], by_impl: dict[str, list[Outcome]], oracle: str = "torch DDP") -> str:
    """Markdown: totals, then one row per test (``oracle``: what the torch column ran)."""
    got = {impl: {o.test: o for o in outs} for impl, outs in by_impl.items()}
    torch_pass = [n for n in names if got["torch"][n].outcome == "pass"]
    gf_on_torch_pass = [n for n in torch_pass if got["gradientflow"][n].outcome == "pass"]
    lines = [
        f"- tests: {len(names)}",
        f"- {oracle} passes: {len(torch_pass)}/{len(names)}",
        f"- gradientflow passes: {sum(got['gradientflow'][n].outcome == 'pass' for n in names)}/{len(names)}",
        f"- gradientflow passes {len(gf_on_torch_pass)} of the {len(torch_pass)} tests {oracle} passes",
        "",
        f"| test | {oracle} | gradientflow | gradientflow's failure (last line) |",
        "|---|---|---|---|",
    ]
    for n in names:
        t, g = got["torch"][n], got["gradientflow"][n]
        last = g.detail.strip().splitlines()[-1][:140].replace("|", "/") if g.outcome == "fail" and g.detail else ""
        lines.append(f"| {n} | {t.outcome} | {g.outcome} | {last} |")
    return "\n".join(lines) + "\n"


def read_other(out_dir: str, ran: str, names: list[str]) -> tuple[dict[str, list[Outcome]], str]:
    """``--only``: the other implementation's outcomes of ``names`` from ``out_dir``'s earlier results.json,
    and the first line of the earlier table.md (its date and command)."""
    other = "gradientflow" if ran == "torch" else "torch"
    path = os.path.join(out_dir, "results.json")
    try:
        with open(path) as f:
            earlier = {o["test"]: Outcome(**o) for o in json.load(f)[other]}
    except (OSError, KeyError, ValueError) as exc:
        raise RuntimeError(f"--only {ran}: no {other} outcomes to re-use in {path} ({exc}); run both first") from exc
    missing = [n for n in names if n not in earlier]
    if missing:
        raise RuntimeError(f"--only {ran}: {path} has no {other} outcome for {', '.join(missing[:3])}; run both")
    try:
        with open(os.path.join(out_dir, "table.md")) as f:
            source = f.readline().strip()
    except OSError:
        source = path
    return {other: [earlier[n] for n in names]}, source


def write(
    out_dir: str,
    names: list[str],
    by_impl: dict[str, list[Outcome]],
    command: str,
    note: str = "",
    oracle: str = "torch DDP",
) -> str:
    os.makedirs(out_dir, exist_ok=True)
    suite = "torch DDP" if oracle == "torch DDP" else "torch FSDP2"
    text = f"{suite} test suite, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `{command}`{note}\n\n"
    text += table(names, by_impl, oracle)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({impl: [asdict(o) for o in outs] for impl, outs in by_impl.items()}, f, indent=1)
    return text
