"""Faults and bad inputs: a stalled or dead rank, mismatched options, a rank alone in no_sync(),
a non-finite gradient.  Every case must end in a clear error on every surviving rank, never a hang.

Cases where a rank stalls or dies use their own harness (:func:`run_faulty`): a Gloo process group
whose peer is stopped cannot be torn down cleanly (its worker threads sit in the collective until
Gloo's own timeout), so each rank reports through a file and leaves with ``os._exit``; the parent
resumes (SIGCONT) and kills whatever is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradientflow as gf

from _dist import rank_context, run_distributed

PG_TIMEOUT_S = 60  # the process group's own timeout: ours must fire long before it


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _step(model: nn.Module, gen: torch.Generator) -> None:
    model.zero_grad()
    model(torch.randn(4, 32, generator=gen)).square().mean().backward()


# ---- harness for ranks that stall or die -----------------------------------------------------
def _faulty_worker(fn, rank: int, world_size: int, store_path: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_path, world_size),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        result = {"status": "ok", "value": fn(rank, world_size, *args)}
    except BaseException:  # noqa: BLE001 — reported to the parent
        result = {"status": "error", "value": traceback.format_exc()}
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    os._exit(0)  # no teardown: a broken group's destructor would wait for Gloo's own timeout


def run_faulty(fn, world_size: int, *args: Any, wait_for: list[int], timeout: float = 50) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` on Gloo ranks; return the results of ranks ``wait_for``."""
    ctx = rank_context()  # ranks fork from a server that imported torch once (tests/_dist.py)
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_faulty_worker, args=(fn, r, world_size, os.path.join(tmp, "store"), tmp, args), daemon=True
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + timeout
            paths = {r: os.path.join(tmp, f"rank{r}.json") for r in wait_for}
            while not all(os.path.exists(p) for p in paths.values()):
                if time.monotonic() > deadline:
                    done = [r for r, p in paths.items() if os.path.exists(p)]
                    raise TimeoutError(f"ranks {wait_for} did not all finish within {timeout}s (done: {done}): a hang")
                time.sleep(0.1)
            results = {}
            for r, path in paths.items():
                with open(path) as f:
                    res = json.load(f)
                if res["status"] != "ok":
                    raise AssertionError(f"rank {r}:\n{res['value']}")
                results[r] = res["value"]
            return results
        finally:
            for p in procs:
                if p.is_alive():
                    # a stopped process cannot die until resumed; one that exited since is_alive() is already gone
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                p.join(timeout=10)


def _error_report(exc: BaseException, elapsed: float) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "elapsed": elapsed,
        "missing": getattr(exc, "missing_ranks", None),
        "step": getattr(exc, "step", None),
        "collective": getattr(exc, "collective", None),
        "nbytes": getattr(exc, "nbytes", None),
    }


# ---- 1. a stalled (SIGSTOP) or dead peer --------------------------------------------------------
FAULT_STEP = 2


def _peer_fault_worker(rank: int, world_size: int, fault: str, timeout: float, options: dict) -> dict | None:
    torch.manual_seed(0)
    model = gf.DistributedDataParallel(Net(), fusion_threshold_mb=0.01, timeout=timeout, **options)
    victim = world_size - 1
    state = {"step": 0}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        # Mid-backward: fc3's gradient is done (its bucket may be on the wire), fc1's is not.
        if rank == victim and state["step"] == FAULT_STEP:
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os._exit(1)
        return grad

    model.module.fc2.weight.register_hook(hook)
    gen = torch.Generator().manual_seed(rank)
    for step in range(FAULT_STEP + 1):
        state["step"] = step
        t0 = time.monotonic()
        try:
            _step(model, gen)
        except gf.CommunicationError as exc:
            return _error_report(exc, time.monotonic() - t0)
    return None


@pytest.mark.parametrize(
    "timeout,options",
    [
        (10, {}),  # the case: dense buckets, Gloo's allreduce, timeout 10 s
        (3, {"algorithm": "ring"}),  # the ring's point-to-point waits
        (3, {"density": 0.5, "chunk_size": 64, "warmup_steps": 0}),
    ],  # CSC: the score allreduce
    ids=["dense-native", "dense-ring", "csc"],
)
def test_stopped_rank_makes_the_others_raise_within_timeout(timeout: float, options: dict) -> None:
    """One rank of 3 stopped (SIGSTOP) mid-backward: the other two raise CommunicationError in time."""
    results = run_faulty(_peer_fault_worker, 3, "stop", timeout, options, wait_for=[0, 1], timeout=timeout + 40)
    for rank, rep in results.items():
        assert rep is not None, f"rank {rank} finished without an error"
        assert rep["type"] == "CommunicationError", rep
        assert rep["elapsed"] < timeout + 10, rep
        assert rep["missing"] == [2], rep
        assert rep["step"] == FAULT_STEP and f"step {FAULT_STEP}" in rep["message"], rep
        assert rep["collective"] in rep["message"] and rep["nbytes"] and rep["nbytes"] > 0, rep
        if options.get("density"):
            assert rep["collective"].startswith("scores of pool 0"), rep
        elif options.get("algorithm") != "ring":
            assert rep["collective"].startswith("bucket "), rep
        assert "[2]" in rep["message"] and "restart" in rep["message"], rep["message"]


def test_exited_rank_makes_the_others_raise() -> None:
    """One rank of 3 exits mid-backward: the others raise CommunicationError naming it."""
    results = run_faulty(_peer_fault_worker, 3, "exit", 30, {}, wait_for=[0, 1], timeout=60)
    for rank, rep in results.items():
        assert rep is not None and rep["type"] == "CommunicationError", (rank, rep)
        assert rep["elapsed"] < 20, rep  # a closed connection is seen at once, not after the timeout
        assert rep["missing"] == [2] and "[2]" in rep["message"], rep


def _uneven_worker(rank: int, world_size: int) -> dict | None:
    """A user's loop over a shard one batch shorter on the last rank, without ``model.join()``."""
    model = gf.DistributedDataParallel(Net(), timeout=30)
    gen = torch.Generator().manual_seed(rank)
    t0 = time.monotonic()
    try:
        for _ in range(3 if rank < world_size - 1 else 2):
            _step(model, gen)
    except gf.CommunicationError as exc:
        return _error_report(exc, time.monotonic() - t0)
    return None  # the short rank leaves its loop (and the process, closing its connections)


def test_uneven_inputs_without_join_say_to_use_join() -> None:
    """Issue 38 item 17: the rank left waiting gets Gloo's "connection closed" at once, and the error says
    that uneven inputs are handled by ``with model.join():``."""
    results = run_faulty(_uneven_worker, 2, wait_for=[0], timeout=60)
    rep = results[0]
    assert rep is not None and rep["type"] == "CommunicationError", rep
    assert rep["elapsed"] < 20 and rep["missing"] == [1], rep
    assert "with model.join():" in rep["message"] and "uneven inputs" in rep["message"], rep["message"]


# ---- 2. consistency ---------------------------------------------------------------------------
MISMATCHES = [
    ("density", 0.1, 0.2),
    ("fusion_threshold_mb", 25.0, 1.0),
    ("comm_dtype", "fp32", "fp16"),
    ("chunk_size", 32768, 1024),
    ("algorithm", "native", "ring"),
    ("warmup_steps", 0, 10),
    ("momentum", 0.0, 0.9),
    ("csc_scope", "global", "slice"),
    ("check_consistency", False, True),
]


def _mismatch_worker(rank: int, world_size: int) -> list[str]:
    messages = []
    for name, base, other in MISMATCHES:
        kwargs = {"density": 0.1} if name in ("chunk_size", "warmup_steps", "momentum", "csc_scope") else {}
        kwargs[name] = other if rank == world_size - 1 else base
        try:
            gf.DistributedDataParallel(Net(), **kwargs)
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    # Local options may differ (a different timeout is fine), and equal values may be spelled differently.
    gf.DistributedDataParallel(Net(), timeout=5 + rank, fusion_threshold_mb=25 if rank else 25.0)
    return messages


def test_mismatched_options_raise_on_every_rank() -> None:
    results = run_distributed(_mismatch_worker, 3, timeout=120)
    for rank, messages in enumerate(results):
        for (name, base, other), msg in zip(MISMATCHES, messages):
            assert f"{name}={base!r} on rank 0" in msg and f"{name}={other!r} on rank 2" in msg, (rank, msg)


def _no_sync_worker(rank: int, world_size: int, forever: bool) -> dict | None:
    torch.manual_seed(0)
    model = gf.DistributedDataParallel(Net(), fusion_threshold_mb=0.01, check_consistency=True, timeout=3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        alone = rank == 1 and (step >= 1 if forever else step == 1)
        t0 = time.monotonic()
        try:
            if alone:  # the bug: only this rank accumulates locally
                with model.no_sync():
                    _step(model, gen)
            else:
                _step(model, gen)
        except (gf.ConsistencyError, gf.CommunicationError) as exc:
            return _error_report(exc, time.monotonic() - t0)
    if forever:
        time.sleep(8)  # alive but never synchronising again: the others must time out, naming us
    return None


def test_no_sync_on_one_rank_raises_on_every_rank() -> None:
    results = run_faulty(_no_sync_worker, 3, False, wait_for=[0, 1, 2], timeout=60)
    for rank, rep in results.items():
        assert rep is not None and rep["type"] == "ConsistencyError", (rank, rep)
        msg = rep["message"]
        assert "no_sync()" in msg and "rank 1: 3" in msg and "rank 0: 2" in msg, msg


def test_rank_that_never_synchronises_again_is_named() -> None:
    results = run_faulty(_no_sync_worker, 3, True, wait_for=[0, 2], timeout=60)
    for rank, rep in results.items():
        assert rep is not None and rep["type"] == "CommunicationError", (rank, rep)
        assert rep["missing"] == [1] and "step check" in rep["message"], rep
        assert rep["elapsed"] < 3 + 10, rep


# ---- 3. non-finite gradients --------------------------------------------------------------------
def _nan_worker(rank: int, world_size: int, density: float | None) -> list[str]:
    torch.manual_seed(0)
    model = gf.DistributedDataParallel(
        Net(), fusion_threshold_mb=0.01, check_finite=True, density=density, chunk_size=64
    )
    poison = {"on": False}
    model.module.fc2.weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for step in range(3):
        poison["on"] = rank == 1 and step == 1
        try:
            _step(model, gen)
            out.append("ok")
        except gf.ConsistencyError as exc:
            out.append(str(exc))
    # With a GradScaler registered, overflow is the scaler's to skip: no error.
    model.register_grad_scaler(torch.amp.GradScaler("cpu", enabled=False))
    poison["on"] = rank == 1
    _step(model, gen)
    out.append("ok")
    return out


@pytest.mark.parametrize("density", [None, 0.5], ids=["dense", "csc"])
def test_nan_gradient_raises_on_every_rank_naming_the_parameter(density: float | None) -> None:
    results = run_distributed(_nan_worker, 2, density, timeout=90)
    for rank, out in enumerate(results):
        assert out[0] == "ok" and out[2] == "ok" and out[3] == "ok", out  # the group stays usable
        assert "rank 1: parameter 'fc2.weight'" in out[1] and "step 1" in out[1], out[1]
        assert ("(this rank)" in out[1]) == (rank == 1), out[1]


# ---- bad values of the new options ------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": 0},
        {"timeout": -1},
        {"timeout": "10"},
        {"timeout": timedelta(0)},
        {"check_consistency": 1},
        {"check_finite": "yes"},
        {"trace_steps": (0, 2)},
        {"trace_path": "t.json", "trace_steps": (3, 1)},
        {"trace_path": "t.json", "trace_steps": (-1, 2)},
        {"trace_path": 5},
    ],
)
def test_bad_fault_options_raise_value_error(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        gf.GradientFlowConfig(**kwargs)


def _timeout_worker(rank: int, world_size: int) -> list[float]:
    from gradientflow.diagnostics.watchdog import resolve_timeout

    group = dist.group.WORLD
    return [resolve_timeout(t, group).total_seconds() for t in (None, 5, timedelta(seconds=7))]


def test_default_timeout_is_the_process_groups() -> None:
    assert run_distributed(_timeout_worker, 1) == [[60.0, 5.0, 7.0]]  # _dist's groups time out after 60 s


@pytest.mark.parametrize("options", [{}, {"compression": "quantized"}], ids=["dense", "quantized"])
def test_stopped_rank_two_level_makes_the_others_raise(options: dict) -> None:
    """Nodes of 2 ranks (``topology="2x2"``): rank 3 stopped mid-backward; its node peer waits on the reduce-scatter,
    the other node on the exchange between nodes and the all-gather: every other rank raises CommunicationError in
    time, naming rank 3 (no hang in any stage's waiter)."""
    timeout = 5
    opts = {"topology": "2x2", **options}
    results = run_faulty(_peer_fault_worker, 4, "stop", timeout, opts, wait_for=[0, 1, 2], timeout=timeout + 50)
    for rank, rep in results.items():
        assert rep is not None and rep["type"] == "CommunicationError", (rank, rep)
        assert rep["elapsed"] < timeout + 15, rep
        assert rep["missing"] == [3] and rep["step"] == FAULT_STEP, rep


def _leave_right_after_building(rank: int, world: int, options: dict) -> tuple[list, float]:
    """Rank 0 is slow to come back from creating each of the wrapper's groups (as a loaded machine is while Gloo
    finishes a handshake); every rank returns the moment its construction does."""
    joined: list[tuple[list[int], float]] = []  # rank 0's: each group's ranks, when rank 0 was back from creating it
    if rank == 0:
        create = dist.new_group

        def slow_new_group(ranks: list[int], *args: Any, **kwargs: Any) -> Any:
            group = create(ranks, *args, **kwargs)
            time.sleep(1.0)
            joined.append((list(ranks), time.monotonic()))
            return group

        dist.new_group = slow_new_group
    gf.DistributedDataParallel(Net(), **options)
    return joined, time.monotonic()


@pytest.mark.parametrize(
    "options,per_node",
    [({"sync_every": 4}, None), ({"compression": "3bit"}, 2)],
    ids=["flat-exchange-group", "2x2-node-groups"],
)
def test_construction_returns_once_every_rank_has_joined_the_wrappers_groups(
    options: dict, per_node: int | None
) -> None:
    """A rank that builds the model and leaves at once (a dry run; or H local steps before the first collective)
    must not close a group under a peer still joining it: Gloo's "connectFullMesh failed: Connection closed by
    peer" on that peer.  So construction returns on no rank before rank 0 is back from creating the last group
    the two share (CLOCK_MONOTONIC is one clock for every process on the machine; the slow return is 1 s, far
    above jitter)."""
    world = 4 if per_node else 2
    results = run_distributed(_leave_right_after_building, world, options, ranks_per_node=per_node, timeout=60)
    joined = results[0][0]
    for rank, (_, returned) in enumerate(results[1:], start=1):
        shared = [t for ranks, t in joined if rank in ranks]
        assert shared, f"rank 0 created no group with rank {rank}: {joined}"
        assert returned >= shared[-1], f"rank {rank} returned {shared[-1] - returned:.2f} s before rank 0 had joined"


def _join_alone(rank: int, world: int) -> list[str]:
    from gradientflow.wrapper.groups import _joined

    out = []
    t0 = time.monotonic()
    try:
        _joined(dist.group.WORLD, 2, 0.5)  # a second member that never comes
    except RuntimeError as exc:
        out.append(str(exc))
    out.append(f"{time.monotonic() - t0:.1f}")
    return out


def test_a_member_that_never_joins_a_new_group_is_an_error_within_the_timeout() -> None:
    said, waited = run_distributed(_join_alone, 1, timeout=30)[0]
    assert "1 of the 2 members of a new process group did not join it within the timeout of 0.5 s" in said, said
    assert float(waited) < 2.0, waited


def _default_timeouts(rank: int, world_size: int) -> dict[str, float]:
    """The timeout each door's waits get without ``timeout=``, on a group made with Gloo's default (30 minutes)."""
    import gradientflow.fsdp as gff
    from gradientflow.fsdp.bounded import mesh_watchdog
    from gradientflow.fsdp.mesh import split_mesh

    group = dist.new_group(list(range(world_size)), timeout=timedelta(minutes=30))

    def waits(model: Any) -> float:
        return model._gf_watchdog.timeout.total_seconds()

    return {
        "per-step flat": waits(gf.DistributedDataParallel(Net(), process_group=group)),
        "sync_every=2": waits(gf.DistributedDataParallel(Net(), process_group=group, sync_every=2)),
        "sync_every=2, timeout=7": waits(
            gf.DistributedDataParallel(Net(), process_group=group, sync_every=2, timeout=7)
        ),
        "fsdp 2 nodes": mesh_watchdog(split_mesh(gff.hsdp_mesh(2, 1)), None).timeout.total_seconds(),
        "pg of 60 s, sync_every=2": waits(gf.DistributedDataParallel(Net(), sync_every=2)),
    }


def test_default_timeout_between_nodes_is_five_minutes() -> None:
    """Issue 70 item 3 / 73 item 4: without ``timeout=``, a run whose waits include exchanges between nodes (an outer
    sync, an FSDP mesh of several nodes) waits at most 5 minutes for a hung host, not the process group's 30
    minutes (Gloo's default); a per-step flat run keeps the process group's, as torch DDP; an explicit ``timeout``
    and a process group's own shorter timeout (60 s: tests/_dist.py's world, which the FSDP mesh spans) stand."""
    out = run_distributed(_default_timeouts, 2, timeout=120)
    for said in out:
        assert said == {
            "per-step flat": 1800.0,
            "sync_every=2": 300.0,
            "sync_every=2, timeout=7": 7.0,
            "fsdp 2 nodes": 60.0,  # the mesh spans the world, whose process group times out after 60 s here
            "pg of 60 s, sync_every=2": 60.0,
        }, said
