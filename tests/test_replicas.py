"""Replicas that come and go (``sync_every=H, replicas=torchft.Manager``, gradientflow/outer/membership.py).

Three replicas, each its own launch (a process with a one-rank Gloo group and its own torchft Manager, tests/
_replica_worker.py), torchft's Lighthouse started here; each replica logs the digest of its anchor after every outer
sync.  Specifications:

- a replica killed mid-interval: the other two go on, their anchors the same bits after every later sync, no hang;
- a replica killed inside the outer exchange (the quantised one after its first round, before its second; the dense
  allreduce and the top-k all-gather before it posts its part): the sync is redone among the two survivors and their
  anchors are the same bits after it and every later sync; every survivor logs a WARNING naming the lost replica;
- the error mass of the survivors' quantised exchange is conserved across the failed try and its redo;
- a replica stopped (SIGSTOP, a hung host) past ``timeout``, mid-interval or inside the exchange: the same; once
  continued (SIGCONT) it rejoins, healed to the others' anchor, and never changes theirs;
- a replica killed and restarted: it joins at the next sync and ends with the others' anchor, bit for bit;
- a new replica (never seen) joins mid-run with the anchor, the outer momentum and the fragment phase of a live peer,
  and the quantised exchange takes its two-rank form and then its three-rank one.

Without ``replicas=`` a survivor raises CommunicationError at the next sync (issue 73); each test here needs the
survivors to reach the end.  Every process has a timeout and is killed (continued first, if stopped) at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

torchft = pytest.importorskip("torchft")
from torchft.coordination import LighthouseServer  # noqa: E402

WORKER = Path(__file__).with_name("_replica_worker.py")
SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT_S = 120  # one test's processes, all together (a loaded 2-core machine: about 20-50 s)
LEFT = "WARNING gradientflow.outer.membership: gradientflow: replica(s) [2] left"


def start(lighthouse: str, replica: int, out: Path, *extra: str, ready: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(WORKER), "--lighthouse", lighthouse, "--replica", str(replica), "--out", str(out)]
    if ready is not None:
        cmd += ["--ready", str(ready)]
    log = open(out.with_suffix(".log"), "a")
    return subprocess.Popen([*cmd, *extra], env=env, stdout=log, stderr=subprocess.STDOUT)


def records(out: Path) -> dict[int, dict]:
    """The replica's records (anchor and momentum digests, live replicas, ring size) by the step of each sync."""
    if not out.exists():
        return {}
    return {r["steps"]: r for r in map(json.loads, out.read_text().splitlines())}


def anchors(out: Path) -> dict[int, str]:
    return {s: r["anchor"] for s, r in records(out).items()}


def stopped(p: subprocess.Popen) -> bool:
    """The process is stopped (SIGSTOP: state T in /proc/<pid>/stat)."""
    try:
        return Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture
def lighthouse():
    # heartbeats lost for 1 s: a replica is gone; every heartbeating replica is waited for (join_timeout 60 s)
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


def run(
    lighthouse: str,
    tmp: Path,
    per_replica: dict[int, list[str]],
    late: dict[int, tuple[int, list[str]]] | None = None,
    cont_after: dict[int, float] | None = None,
) -> dict[int, Path]:
    """Replicas 0-2 launched together with ``per_replica``'s arguments (all three in the first quorum); ``late``:
    replica -> (the replica whose exit starts it, its arguments): the same number is a restart, another a new
    replica; ``cont_after``: replica -> seconds it stays stopped before the harness continues it (SIGCONT)."""
    ready = tmp / "ready"
    ready.mkdir()
    late, cont_after = late or {}, cont_after or {}
    outs = {r: tmp / f"replica{r}.jsonl" for r in [0, 1, 2, *late]}
    procs = {r: start(lighthouse, r, outs[r], *per_replica[r], ready=ready) for r in range(3)}
    pending, stopped_at = dict(late), {}
    deadline = time.monotonic() + LIMIT_S
    try:
        while time.monotonic() < deadline:
            for r, (after, args) in list(pending.items()):
                if procs[after].poll() is not None:
                    del pending[r]
                    procs[r] = start(lighthouse, r, outs[r], *args)
            for r, seconds in cont_after.items():
                if r not in stopped_at and stopped(procs[r]):
                    stopped_at[r] = time.monotonic()
                if r in stopped_at and stopped_at[r] >= 0 and time.monotonic() - stopped_at[r] > seconds:
                    procs[r].send_signal(signal.SIGCONT)
                    stopped_at[r] = -1.0
            if not pending and all(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"replicas still running after {LIMIT_S} s (a hang): {tmp}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a stopped process does not die of SIGKILL until continued on some
                p.kill()
            p.wait()
    for r in cont_after:
        assert stopped_at.get(r) == -1.0, f"replica {r} was never stopped and continued"
    return outs


def log_of(outs: dict[int, Path], r: int) -> str:
    return outs[r].with_suffix(".log").read_text()


STEPS, EVERY = 24, 4
COMMON = ["--steps", str(STEPS), "--every", str(EVERY), "--sleep", "0.1"]


def check_survivors(outs: dict[int, Path], survivors: list[int], after: int, steps: int = STEPS) -> None:
    """The survivors logged every sync from ``after`` to the end, the same anchor bits at each."""
    logs = [anchors(outs[r]) for r in survivors]
    for r, log in zip(survivors, logs):
        assert steps in log, f"replica {r} did not reach step {steps}: {log_of(outs, r)[-3000:]}"
    for step in range(after, steps + 1, EVERY):
        assert len({log[step] for log in logs}) == 1, f"anchors differ after the sync at step {step}: {logs}"


def check_named(outs: dict[int, Path], survivors: list[int], redone: bool) -> None:
    """Every survivor logged a WARNING naming replica 2 as lost (and, where the sync was interrupted, its redo)."""
    for r in survivors:
        log = log_of(outs, r)
        assert LEFT in log, f"replica {r} did not name the lost replica: {log[-3000:]}"
        if redone:
            assert (
                "WARNING gradientflow.outer.membership: gradientflow: outer exchange of fragment 0 after step 8" in log
            )
            assert "not applied (try 1)" in log
        # a long wait's WARNING says why it cannot name the replica waited on (no store among replicas), not a
        # store that "did not answer"
        assert "rendezvous store did not answer" not in log, log[-3000:]
        if redone:  # its advice is what happens next among replicas, not torch DDP's "restart the job"
            assert "the sync is redone among the replicas alive" in log and "restart the job" not in log, log[-3000:]


def test_replica_killed_mid_interval_the_others_go_on(lighthouse: str, tmp_path: Path) -> None:
    outs = run(lighthouse, tmp_path, {0: COMMON, 1: COMMON, 2: [*COMMON, "--kill-at", "6"]})
    assert max(anchors(outs[2])) == 4  # it synchronised once, then died
    check_survivors(outs, [0, 1], after=4)
    check_named(outs, [0, 1], redone=False)


@pytest.mark.parametrize("compression", ["3bit", "none", "indexed-topk-2bit"])
def test_replica_killed_during_the_outer_exchange_the_sync_is_redone(
    lighthouse: str, tmp_path: Path, compression: str
) -> None:
    args = [*COMMON, "--compression", compression, "--timeout", "10"]
    dumps = {r: tmp_path / f"exchanges{r}.pt" for r in (0, 1)}
    outs = run(
        lighthouse,
        tmp_path,
        {0: [*args, "--dump", str(dumps[0])], 1: [*args, "--dump", str(dumps[1])], 2: [*args, "--kill-in-sync", "8"]},
    )
    assert max(anchors(outs[2])) == 4
    check_survivors(outs, [0, 1], after=4)
    check_named(outs, [0, 1], redone=True)
    if compression == "3bit":
        check_error_mass(dumps)


def check_error_mass(dumps: dict[int, Path]) -> None:
    """The sync after step 8 failed once (replica 2 lost inside it) and was redone between the survivors.  Its
    residuals before are the ones the sync after step 4 committed (the failed try committed nothing: no mass
    delivered twice), and summed over the survivors, what each handed in (its pseudo-gradient over the 2 parties,
    plus its residual) equals the delivered mean plus the new residuals (nothing lost): the quantised exchange's
    errors telescope over the ranks (gradientflow/comm/quantized_ring.py), not per rank."""
    calls = {r: {c["steps"]: c for c in torch.load(p)} for r, p in dumps.items()}
    redo = [calls[r][8] for r in (0, 1)]
    assert [c["parties"] for c in redo] == [2, 2]
    for r in (0, 1):
        assert torch.equal(calls[r][8]["before"], calls[r][4]["after"]), f"replica {r}: the failed try committed"
    assert torch.equal(redo[0]["mean"], redo[1]["mean"])  # the same bits delivered to both
    n = redo[0]["x"].numel()
    handed = sum(c["x"] / c["parties"] + c["before"][:n] for c in redo)
    delivered = redo[0]["mean"] + sum(c["after"][:n] for c in redo)
    # each side is a few fp32 roundings (a contribution's add, an error's subtraction, the two decoded shares' add,
    # this sum's adds) of values below ``scale``: 8 ulps of it bound them with room; a lost or doubled share would
    # be off by a quantisation error or a whole contribution, orders of magnitude above
    scale = max(t.abs().max().item() for t in (handed, delivered))
    assert torch.allclose(handed, delivered, rtol=0, atol=8 * torch.finfo(torch.float32).eps * scale), (
        (handed - delivered).abs().max()
    )
    assert (redo[0]["after"].abs().sum() > 0) and (redo[1]["after"].abs().sum() > 0)  # mass really was carried


SLOW = ["--steps", "60", "--every", str(EVERY), "--sleep", "0.25", "--timeout", "3"]


@pytest.mark.parametrize("where", ["--stop-at", "--stop-in-sync"])
def test_replica_stopped_past_the_timeout_the_others_go_on_and_it_rejoins(
    lighthouse: str, tmp_path: Path, where: str
) -> None:
    # stopped for 6 s: past the 3 s timeout of an exchange and the Lighthouse's 1 s heartbeat timeout
    outs = run(
        lighthouse,
        tmp_path,
        {0: SLOW, 1: SLOW, 2: [*SLOW, where, "6" if where == "--stop-at" else "8"]},
        cont_after={2: 6.0},
    )
    check_survivors(outs, [0, 1], after=4, steps=60)
    check_named(outs, [0, 1], redone=where == "--stop-in-sync")
    logs = {r: anchors(outs[r]) for r in range(3)}
    rejoined = sorted(s for s in logs[2] if s > 8)
    assert rejoined, f"the continued replica never rejoined: {log_of(outs, 2)[-3000:]}"
    assert rejoined[0] > 12, "it rejoined at the survivors' sync after it was continued, not where it stopped"
    for step in rejoined:  # healed to the survivors' anchor: the same bits at every sync it took part in
        assert logs[2][step] == logs[0][step] == logs[1][step]
    assert logs[2][60] == logs[0][60]


def test_replica_restarted_joins_with_the_others_anchor(lighthouse: str, tmp_path: Path) -> None:
    # the survivors go on for about 25 s: a restarted process (torch, torchft imported) takes up to 10 s to join
    slow = ["--steps", "60", "--every", str(EVERY), "--sleep", "0.4"]
    outs = run(lighthouse, tmp_path, {0: slow, 1: slow, 2: [*slow, "--kill-at", "6"]}, late={2: (2, slow)})
    logs = {r: anchors(outs[r]) for r in range(3)}
    joined = sorted(s for s in logs[2] if s > 6)
    assert joined, f"the restarted replica never joined: {log_of(outs, 2)[-3000:]}"
    for step in joined:  # from the sync it joined at to the end, the same bits as the others
        assert logs[2][step] == logs[0][step] == logs[1][step]
    assert 60 in logs[2] and logs[2][60] == logs[0][60]


def test_new_replica_joins_mid_run_with_a_peers_outer_state(lighthouse: str, tmp_path: Path) -> None:
    # Nesterov (outer momentum) over 2 fragments: the newcomer needs the momentum and the phase, not only the anchor
    slow = ["--steps", "60", "--every", str(EVERY), "--sleep", "0.4", "--fragments", "2"]
    slow += ["--outer-lr", "0.7", "--outer-momentum", "0.9"]
    outs = run(lighthouse, tmp_path, {0: slow, 1: slow, 2: [*slow, "--kill-at", "6"]}, late={3: (2, slow)})
    logs = {r: records(outs[r]) for r in (0, 1, 3)}
    assert logs[3], f"the new replica never joined: {log_of(outs, 3)[-3000:]}"
    for step, rec in logs[3].items():  # from the sync it entered at to the end: the peers' anchor and momentum
        for r in (0, 1):
            assert (rec["anchor"], rec["momentum"]) == (logs[r][step]["anchor"], logs[r][step]["momentum"]), step
    assert 60 in logs[3]
    entered = min(logs[3])
    assert entered % (EVERY // 2) == 0  # a fragment's sync step (two fragments: one every H/2 steps)
    # the quantised exchange's two forms: three replicas, two once replica 2 was lost, three once the new one came
    rings = [logs[0][s]["ring"] for s in sorted(logs[0])]
    assert rings[0] == 3 and 2 in rings and logs[0][60]["ring"] == 3, rings
    assert logs[0][entered]["live"] == 3 and logs[0][entered]["ring"] == 3
