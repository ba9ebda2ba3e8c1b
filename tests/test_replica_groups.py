"""Replicas of several ranks that come and go, behind both doors (``replicas=torchft.Manager``, one Manager per rank:
torchft's replica group; gradientflow/outer/membership.py).

Three replicas, each its own launch of 2 ranks (tests/_replica_group_worker.py: a Gloo group over the replica's
own store), torchft's Lighthouse started here; every rank logs the digest of its anchor after every outer sync.
``fsdp``: ``gradientflow.fsdp.fully_shard`` on the replica's mesh (1, 2), the anchor being the rank's shards, so
rank r of every replica must hold the same bits; ``ddp``: the DDP wrapper over the replica's 2 ranks (dense inside
every step), the anchor the whole model on both ranks.  Specifications, for each door:

- a replica killed mid-interval (both its ranks, as torchrun takes a replica down): the other two go on to the end,
  rank r's anchor the same bits in every live replica (and, for ``ddp``, on both ranks) after every sync, the syncs
  after the kill among the two; restarted (a new launch of both ranks), it joins at a later sync healed rank by rank
  from a live peer, and from there to the end holds the survivors' anchor, bit for bit (one test: the kill and the
  rejoin in one run).
- a replica killed inside an outer sync, one of its ranks dying between the quantised ring's rounds while its other
  rank goes on in that sync until the harness takes the replica down (torchrun's agent does the same): the sync is
  redone among the two survivors by both their ranks (a rank whose own ring had completed too: a replica's ranks
  commit a sync together or not at all), so rank r's anchor stays the same bits in both survivors
  and, for ``ddp``, on both ranks, after every sync; the dying replica never committed that sync on any rank.

Before this, ``fully_shard`` took no ``replicas=`` and the DDP door refused a process group of several ranks: each
replica failed at construction.  Every process has a timeout and is killed at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

torchft = pytest.importorskip("torchft")
from torchft.coordination import LighthouseServer  # noqa: E402

WORKER = Path(__file__).with_name("_replica_group_worker.py")
SRC = Path(__file__).resolve().parents[1] / "src"
REPLICAS, RANKS = 3, 2
LIMIT_S = 300  # one test's 6 processes (8 with a restart), all together, on a loaded 2-core machine
STEPS, EVERY = 24, 4


class Launches:
    """The replicas' processes: a replica is its ``RANKS`` processes; one that lost a rank loses all (torchrun's
    behaviour: the agent stops the others), and every process still alive is killed at the end."""

    def __init__(self, lighthouse: str, door: str, tmp: Path) -> None:
        self.lighthouse, self.door, self.tmp = lighthouse, door, tmp
        self.procs: dict[int, list[subprocess.Popen]] = {}
        self.launches = 0

    def out(self, replica: int, rank: int) -> Path:
        return self.tmp / f"replica{replica}.rank{rank}.jsonl"

    def start(self, replica: int, extra: list[str], ready: Path | None = None, rank0: Sequence[str] = ()) -> None:
        self.launches += 1
        rdv = self.tmp / f"launch{self.launches}.port"  # a fresh rendezvous per launch (a restart's own)
        env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        procs = []
        for rank in range(RANKS):
            out = self.out(replica, rank)
            cmd = [sys.executable, str(WORKER), "--lighthouse", self.lighthouse, "--door", self.door]
            cmd += ["--replica", str(replica), "--rank", str(rank), "--ranks", str(RANKS), "--rdv", str(rdv)]
            cmd += ["--out", str(out), "--world", str(REPLICAS * RANKS), *extra, *(rank0 if rank == 0 else [])]
            if ready is not None:
                cmd += ["--ready", str(ready)]
            log = open(out.with_suffix(f".{self.launches}.log"), "w")
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.procs[replica] = procs

    def down(self, replica: int) -> bool:
        """Whether ``replica`` is gone (all its processes ended), killing the rest once one of them failed."""
        procs = self.procs[replica]
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        return all(p.poll() is not None for p in procs)

    def kill_all(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()

    def logs(self, replica: int) -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted(self.tmp.glob(f"replica{replica}.rank*.log")))


@pytest.fixture
def lighthouse():
    # heartbeats lost for 1 s: a replica is gone; every heartbeating replica is waited for (join_timeout 60 s)
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


def run(
    lighthouse: str,
    door: str,
    tmp: Path,
    per_replica: dict[int, list[str]],
    restart: int | None = None,
    rank0: dict[int, list[str]] | None = None,
):
    ready = tmp / "ready"
    ready.mkdir()
    launches = Launches(lighthouse, door, tmp)
    for r in range(REPLICAS):
        launches.start(r, per_replica[r], ready=ready, rank0=(rank0 or {}).get(r, []))
    deadline = time.monotonic() + LIMIT_S
    restarted = False
    try:
        while time.monotonic() < deadline:
            gone = [r for r in range(REPLICAS) if launches.down(r)]
            if restart is not None and not restarted and restart in gone:
                launches.start(restart, per_replica[-1])
                restarted = True
                continue
            if len(gone) == REPLICAS:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"replicas still running after {LIMIT_S} s (a hang): {tmp}")
    finally:
        launches.kill_all()
    return launches


def records(out: Path) -> dict[int, dict]:
    """The rank's records (anchor digest, live replicas) by the step of each sync."""
    if not out.exists():
        return {}
    return {r["steps"]: r for r in map(json.loads, out.read_text().splitlines())}


def anchors(launches: Launches, replicas: list[int], door: str, steps: int) -> dict[tuple[int, int], dict[int, str]]:
    """Every rank of ``replicas`` reached ``steps``; its anchor digests by sync step."""
    found = {}
    for r in replicas:
        for rank in range(RANKS):
            log = records(launches.out(r, rank))
            assert steps in log, f"replica {r} rank {rank} did not reach step {steps}: {launches.logs(r)}"
            found[r, rank] = {s: rec["anchor"] for s, rec in log.items()}
    return found


def check_identical(found: dict[tuple[int, int], dict[int, str]], door: str, sync_steps: list[int]) -> None:
    """At each sync of ``sync_steps``: rank r's anchor the same bits in every replica of ``found``; for ``ddp`` the
    same on both ranks too (the whole model on each); for ``fsdp`` the two ranks' shards differ (their halves)."""
    for step in sync_steps:
        for rank in range(RANKS):
            same = {found[key][step] for key in found if key[1] == rank}
            assert len(same) == 1, f"rank {rank}'s anchors differ after the sync at step {step}: {found}"
        by_rank = {found[key][step] for key in found}
        assert len(by_rank) == (1 if door == "ddp" else RANKS), (step, by_rank)


COMMON = ["--steps", str(STEPS), "--every", str(EVERY), "--sleep", "0.1"]


@pytest.mark.parametrize("door", ["fsdp", "ddp"])
def test_replica_of_two_ranks_restarted_joins_with_the_others_anchor(
    lighthouse: str, tmp_path: Path, door: str
) -> None:
    # a replica killed mid-interval (both ranks): the survivors go on among themselves, the same bits rank by rank
    # after every sync (this test's last check), then it rejoins. They go on for about 30 s: a restarted replica
    # (2 processes importing torch, torchft) takes a while
    slow = ["--steps", "60", "--every", str(EVERY), "--sleep", "0.5"]
    launches = run(lighthouse, door, tmp_path, {0: slow, 1: slow, 2: [*slow, "--kill-at", "6"], -1: slow}, restart=2)
    found = anchors(launches, [0, 1, 2], door, 60)
    joined = sorted(s for s in found[2, 0] if s > 6)
    assert joined and sorted(found[2, 1]) == sorted(found[2, 0]), launches.logs(2)
    check_identical(found, door, joined)  # from the sync it joined at to the end: the survivors' bits, rank by rank
    live = {s: rec["live"] for s, rec in records(launches.out(0, 0)).items()}
    assert any(live[s] == 2 for s in live if 6 < s < joined[0]), live  # the survivors synced without it first
    check_identical({k: v for k, v in found.items() if k[0] != 2}, door, list(range(EVERY, 61, EVERY)))


@pytest.mark.parametrize("door", ["fsdp", "ddp"])
def test_replica_of_two_ranks_killed_inside_a_sync_both_survivors_ranks_redo_it(
    lighthouse: str, tmp_path: Path, door: str
) -> None:
    launches = run(lighthouse, door, tmp_path, {r: COMMON for r in range(REPLICAS)}, rank0={2: ["--kill-in-sync", "8"]})
    found = anchors(launches, [0, 1], door, STEPS)
    check_identical(found, door, list(range(EVERY, STEPS + 1, EVERY)))
    for rank in range(RANKS):  # it synchronised once; the sync it died in was committed by none of its ranks
        assert max(records(launches.out(2, rank)), default=0) == EVERY, launches.logs(2)
        live = {s: rec["live"] for s, rec in records(launches.out(0, rank)).items()}
        assert live[EVERY] == REPLICAS and all(live[s] == 2 for s in live if s > EVERY), live
    for r in (0, 1):  # every rank of both survivors redid the sync after step 8, naming the replica that left
        for rank in range(RANKS):
            log = launches.out(r, rank).with_suffix(f".{r + 1}.log").read_text()  # its launch, the (r+1)-th
            assert "replica(s) [2] left" in log, log[-3000:]
            assert "after step 8" in log and "not applied (try 1)" in log, log[-3000:]


# ---- what replicas= still refuses, with what to pass: checked before anything is built, on every rank ------------
def _refusals(rank: int, world: int, lighthouse: str) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from test_fsdp import _mesh
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    import gradientflow.fsdp as gf

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port] if store is not None else [0]
    dist.broadcast_object_list(port, src=0)

    def manager(as_rank: int) -> Manager:  # this launch is one replica of 2 ranks
        return Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            use_async_quorum=False,
            rank=as_rank,
            world_size=world,
            store_addr="127.0.0.1",
            store_port=port[0],
            lighthouse_addr=lighthouse,
            replica_id="replica_0",
            hostname="127.0.0.1",
            init_sync=False,
        )

    ours = manager(rank)
    out = {}

    def refused(name: str, build) -> None:
        try:
            build()
            out[name] = "built"
        except ValueError as exc:
            out[name] = str(exc)

    refused(
        "replicas in the mesh",
        lambda: gf.fully_shard(torch.nn.Linear(4, 4), mesh=_mesh(2, 1), sync_every=4, replicas=ours),
    )
    refused("every step", lambda: gf.fully_shard(torch.nn.Linear(4, 4), mesh=_mesh(1, 2), replicas=ours))
    refused(
        "overlap",
        lambda: gf.fully_shard(torch.nn.Linear(4, 4), mesh=_mesh(1, 2), sync_every=4, sync_delay=1, replicas=ours),
    )
    ours.shutdown(wait=False)
    dist.barrier()
    return out


def test_what_replicas_still_refuses_says_what_to_pass(lighthouse: str) -> None:
    from _dist import run_distributed

    for r in run_distributed(_refusals, 2, lighthouse, timeout=120):
        assert "replicas= takes the launch as one replica" in r["replicas in the mesh"]
        assert "gradientflow.fsdp.hsdp_mesh()" in r["replicas in the mesh"]
        assert "pass sync_every > 1" in r["every step"]
        assert "Pass sync_delay=0." in r["overlap"]
