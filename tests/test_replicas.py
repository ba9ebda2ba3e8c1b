"""Replicas that come and go (``sync_every=H, replicas=torchft.Manager``, gradientflow/outer/membership.py).

Three replicas, each its own launch (a process with a one-rank Gloo group and its own torchft Manager, tests/
_replica_worker.py), torchft's Lighthouse started here; each replica logs the digest of its anchor after every outer
sync.  Specifications:

- a replica killed mid-interval: the other two go on, their anchors the same bits after every later sync, no hang;
- a replica killed inside the quantised exchange (after its first round, before its second): the sync is redone among
  the two survivors and their anchors are the same bits after it and every later sync;
- a replica killed and restarted: it joins at the next sync and ends with the others' anchor, bit for bit.

Without ``replicas=`` a survivor raises CommunicationError at the next sync (issue 73); each test here needs the
survivors to reach the end.  Every process has a timeout and is killed at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torchft = pytest.importorskip("torchft")
from torchft.coordination import LighthouseServer  # noqa: E402

WORKER = Path(__file__).with_name("_replica_worker.py")
SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT_S = 120  # one test's processes, all together (a loaded 2-core machine: about 20-40 s)


def start(lighthouse: str, replica: int, out: Path, *extra: str, ready: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(WORKER), "--lighthouse", lighthouse, "--replica", str(replica), "--out", str(out)]
    if ready is not None:
        cmd += ["--ready", str(ready)]
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen([*cmd, *extra], env=env, stdout=log, stderr=subprocess.STDOUT)


def records(out: Path) -> dict[int, str]:
    """The replica's anchors by the step of each sync."""
    if not out.exists():
        return {}
    return {r["steps"]: r["anchor"] for r in map(json.loads, out.read_text().splitlines())}


@pytest.fixture
def lighthouse():
    # heartbeats lost for 1 s: a replica is gone; every heartbeating replica is waited for (join_timeout 60 s)
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


def run(lighthouse: str, tmp: Path, per_replica: dict[int, list[str]], restart: int | None = None) -> dict[int, Path]:
    ready = tmp / "ready"
    ready.mkdir()
    outs = {r: tmp / f"replica{r}.jsonl" for r in range(3)}
    procs = {r: start(lighthouse, r, outs[r], *per_replica.get(r, []), ready=ready) for r in range(3)}
    deadline = time.monotonic() + LIMIT_S
    restarted = None
    try:
        while time.monotonic() < deadline:
            if restart is not None and restarted is None and procs[restart].poll() is not None:
                restarted = start(lighthouse, restart, outs[restart], *per_replica.get(-1, []))
                procs[restart] = restarted
            if all(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"replicas still running after {LIMIT_S} s (a hang): {tmp}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    return outs


STEPS, EVERY = 24, 4
COMMON = ["--steps", str(STEPS), "--every", str(EVERY), "--sleep", "0.1"]


def check_survivors(outs: dict[int, Path], survivors: list[int], after: int) -> None:
    """The survivors logged every sync from ``after`` to the end, the same anchor bits at each."""
    logs = [records(outs[r]) for r in survivors]
    for r, log in zip(survivors, logs):
        assert STEPS in log, (
            f"replica {r} did not reach step {STEPS}: {outs[r].with_suffix('.log').read_text()[-3000:]}"
        )
    for step in range(after, STEPS + 1, EVERY):
        assert len({log[step] for log in logs}) == 1, f"anchors differ after the sync at step {step}: {logs}"


def test_replica_killed_mid_interval_the_others_go_on(lighthouse: str, tmp_path: Path) -> None:
    outs = run(lighthouse, tmp_path, {0: COMMON, 1: COMMON, 2: [*COMMON, "--kill-at", "6"]})
    assert max(records(outs[2])) == 4  # it synchronised once, then died
    check_survivors(outs, [0, 1], after=4)


def test_replica_killed_during_the_quantised_exchange_the_sync_is_redone(lighthouse: str, tmp_path: Path) -> None:
    outs = run(lighthouse, tmp_path, {0: COMMON, 1: COMMON, 2: [*COMMON, "--kill-in-sync", "8"]})
    assert max(records(outs[2])) == 4
    check_survivors(outs, [0, 1], after=4)
    log = outs[0].with_suffix(".log").read_text()
    assert "not applied (try 1)" in log and "replica(s) [2] left" in log  # redone, the lost replica named


def test_replica_restarted_joins_with_the_others_anchor(lighthouse: str, tmp_path: Path) -> None:
    # the survivors go on for about 25 s: a restarted process (torch, torchft imported) takes up to 10 s to join
    slow = ["--steps", "60", "--every", str(EVERY), "--sleep", "0.4"]
    outs = run(lighthouse, tmp_path, {0: slow, 1: slow, 2: [*slow, "--kill-at", "6"], -1: slow}, restart=2)
    logs = {r: records(outs[r]) for r in range(3)}
    joined = sorted(s for s in logs[2] if s > 6)
    assert joined, f"the restarted replica never joined: {outs[2].with_suffix('.log').read_text()[-3000:]}"
    for step in joined:  # from the sync it joined at to the end, the same bits as the others
        assert logs[2][step] == logs[0][step] == logs[1][step]
    assert 60 in logs[2] and logs[2][60] == logs[0][60]
