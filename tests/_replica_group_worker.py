"""One rank of a replica of several ranks (tests/test_replica_groups.py): the replica is its own launch of
``--ranks`` processes (a Gloo group over a TCPStore its rank 0 hosts, the port handed over through a file, as
torchrun's rendezvous would), each rank with its own torchft Manager (rank = the rank inside the replica,
world_size = its ranks: torchft's replica group), the model behind ``--door``:

- ``fsdp``: ``gradientflow.fsdp.fully_shard`` per block and at the root on the replica's mesh ``(1, ranks)``,
  ``sync_every`` and ``replicas=manager``: the anchor is this rank's shards;
- ``ddp``: ``gradientflow.DistributedDataParallel`` over the replica's ranks, ``replicas=manager``: its ranks
  average densely every step, the anchor is the whole model on every rank.

After every outer sync it appends one JSON line to ``--out``: the inner step count, a digest of this rank's anchor
and the number of live replicas.  ``--kill-at K``: SIGKILLs itself after inner step K (every rank of the replica
passes it: the ranks step in lockstep, so the whole replica dies there, as torchrun takes a replica down).
``--kill-in-sync K``: SIGKILLs itself inside the outer sync after step K, between the quantised ring's rounds (the
test passes it to one rank of the replica: the others are taken down by the harness, as torchrun's agent does).
Warnings are logged to stderr (the launch's log), as a user's ``logging.basicConfig`` would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _loopback_manager import loopback_manager
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import gradientflow
import gradientflow.fsdp as gf
from gradientflow.comm import quantized_ring
from gradientflow.fsdp.counters import comms
from gradientflow.fsdp.outer import outer_of


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def replica_store(rdv: Path, rank: int, timeout: timedelta) -> dist.TCPStore:
    """The replica's store: hosted by its rank 0, its port written to ``rdv`` (a fresh path per launch)."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        tmp = rdv.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.rename(rdv)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not rdv.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 of the replica never wrote {rdv}")
        time.sleep(0.05)
    return dist.TCPStore("127.0.0.1", int(rdv.read_text()), is_master=False, timeout=timeout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--door", choices=("fsdp", "ddp"), required=True)
    ap.add_argument("--rdv", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--compression", default="3bit")
    ap.add_argument("--sleep", type=float, default=0.1)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--kill-in-sync", type=int, default=0)
    ap.add_argument("--ready", default="")  # a folder: wait until --world processes are ready before the first quorum
    ap.add_argument("--world", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    timeout = timedelta(seconds=20)

    store = replica_store(Path(args.rdv), args.rank, timeout)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("replica", store), rank=args.rank, world_size=args.ranks, timeout=timeout
    )
    manager = loopback_manager(
        args.lighthouse, args.replica, store.port, timeout, rank=args.rank, world_size=args.ranks
    )
    if args.ready:  # the first launch: every process up before the first quorum, so all replicas are in it
        Path(args.ready, f"{args.replica}.{args.rank}").touch()
        while len(os.listdir(args.ready)) < args.world:
            time.sleep(0.05)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8))
    options = {"sync_every": args.every, "outer_compression": args.compression, "timeout": 20, "replicas": manager}
    if args.door == "fsdp":
        mesh = init_device_mesh("cpu", (1, args.ranks), mesh_dim_names=("replicate", "shard"))
        for block in (model[0], model[2]):
            gf.fully_shard(block, mesh=mesh, **options)
        net: nn.Module = gf.fully_shard(model, mesh=mesh, **options)
    else:
        net = gradientflow.DistributedDataParallel(model, **options)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    out = open(args.out, "a")

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * args.replica + 100 * args.rank + step)  # this rank's own data
        return torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)

    x, y = batch(0)
    loss = nn.functional.mse_loss(net(x), y)  # fsdp: the first forward asks for the first quorum (a joiner healed)
    outer = net._gf_outer if args.door == "ddp" else outer_of([c for _, c in comms(net)])
    loop, membership = outer.loop, outer.loop.membership

    def record() -> None:
        assert loop.anchor is not None
        line = {"steps": loop.steps, "anchor": digest(loop.anchor), "live": len(membership.replicas)}
        out.write(json.dumps(line) + "\n")
        out.flush()

    if loop.syncs:  # joined a running job: its first sync is already done
        record()
    if args.kill_in_sync:
        advance = quantized_ring.QuantizedRing._advance

        def dying(self: quantized_ring.QuantizedRing) -> None:  # between the ring's rounds: its peers wait on it
            if loop.steps == args.kill_in_sync:
                os.kill(os.getpid(), signal.SIGKILL)
            advance(self)

        quantized_ring.QuantizedRing._advance = dying  # type: ignore[method-assign]
    while True:
        opt.zero_grad()
        loss.backward()
        syncs = loop.syncs
        opt.step()
        if loop.syncs != syncs:
            record()
        if args.kill_at and loop.steps == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if loop.steps >= args.steps:
            break
        time.sleep(args.sleep)
        x, y = batch(loop.steps)
        loss = nn.functional.mse_loss(net(x), y)
    out.close()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
