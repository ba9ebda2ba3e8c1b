"""Spawn N Gloo ranks on this machine and run a test function in each, with timeouts everywhere.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (spawn), each joins a
Gloo process group over a FileStore with a timeout, runs ``fn(rank, world_size, *args)`` and
sends back its return value (or its traceback).  A rank that hangs fails the test after
``timeout`` seconds instead of hanging CI.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

PG_TIMEOUT_S = 60
_GRACE_S = 3  # after a rank's error, how long the others' outcomes are awaited for the report


def _worker(
    fn, rank: int, world_size: int, store_path: str, results, args: tuple, per_node: int | None, env: dict, cwd: str
) -> None:
    import torch
    import torch.distributed as dist

    # A forked rank inherits the server's environment and directory; a test's are the caller's.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)

    if per_node is not None:  # torchrun's launch variables, as on a node of per_node ranks
        os.environ.update(
            LOCAL_WORLD_SIZE=str(per_node),
            LOCAL_RANK=str(rank % per_node),
            GROUP_RANK=str(rank // per_node),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S)
        )
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 — the parent re-raises it with the rank attached
        results.put((rank, "error", traceback.format_exc()))


_CTX = None


def rank_context():
    """A forkserver that imported torch and gradientflow once: each rank forks from it.

    Spawning imports torch afresh in every rank of every test (~1.5 s of CPU each); forking
    from a server that already holds the imports starts a rank in milliseconds.  ``gradientflow``
    alone loads its names on first use, so the wrapper is preloaded by name: its class body imports
    torch._dynamo (``torch.compiler.disable``), ~2 s a rank here, which every rank of every test
    otherwise paid again (the suite: 1171 -> 876 s serial, 2026-11-27).  The server
    itself starts no threads and touches no device, so its children start as clean as spawned
    ones (CUDA is initialised in the child, never in the server).
    """
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "gradientflow", "gradientflow.wrapper.ddp"])
    return _CTX


def run_distributed(
    fn, world_size: int, *args: Any, timeout: float = 120, ranks_per_node: int | None = None
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; return results by rank.

    ``ranks_per_node``: each rank gets torchrun's variables (``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``,
    ``GROUP_RANK``, ``RANK``, ``WORLD_SIZE``) as if nodes of that many ranks were launched, so
    ``topology="auto"`` sees nodes; ``None``: none set (not launched by torchrun).
    """
    ctx = rank_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, store_path, results, args, ranks_per_node, dict(os.environ), os.getcwd()),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                try:
                    rank, status, value = results.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(
                        f"distributed test timed out after {timeout}s; ranks done: {sorted(out)}"
                    ) from None
                if status == "ok":
                    out[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    break  # other ranks are likely stuck in a collective with the failed one
            if errors:  # what the other ranks did tells the cause: their own errors, or returned already
                for _ in range(world_size - len(out) - 1):
                    try:
                        rank, status, value = results.get(timeout=_GRACE_S)
                    except queue.Empty:
                        break
                    errors.append(f"rank {rank}:\n{value}" if status != "ok" else f"rank {rank}: returned")
                errors += [f"rank {r}: returned" for r in sorted(out)]
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise AssertionError("\n".join(errors))
        return [out[r] for r in range(world_size)]
