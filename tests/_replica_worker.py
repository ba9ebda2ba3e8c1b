"""One replica of tests/test_replicas.py: its own launch (a one-rank Gloo group), its own torchft Manager, the
wrapper with ``sync_every`` and ``replicas=manager``.  After every outer sync it appends one JSON line to ``--out``:
the inner step count and a digest of the anchor's bytes (and the number of live replicas).

Failures it injects on itself (the harness's kills): ``--kill-at K`` SIGKILLs this process after its inner step K
(mid-interval where K is not a multiple of H); ``--kill-in-sync K`` SIGKILLs it inside the quantised exchange of
the sync after step K, once its first round has arrived and before it posts the second (the others wait on it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

import gradientflow
from gradientflow.comm import quantized_ring


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--compression", default="3bit")
    ap.add_argument("--sleep", type=float, default=0.05)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--kill-in-sync", type=int, default=0)
    ap.add_argument("--ready", default="")  # a folder: wait until --world replicas are ready before the first quorum
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    timeout = timedelta(seconds=20)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)  # this replica
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}",
        hostname="127.0.0.1",
        init_sync=False,  # the same seed on every replica: the same initial model
        max_retries=20,
    )
    if args.ready:  # the first launch: every replica heartbeating before the first quorum, so all three are in it
        Path(args.ready, str(args.replica)).touch()
        while len(os.listdir(args.ready)) < args.world:
            time.sleep(0.05)

    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = gradientflow.DistributedDataParallel(
        model, sync_every=args.every, outer_compression=args.compression, timeout=20, replicas=manager
    )
    loop = ddp._gf_outer.loop
    out = open(args.out, "a")

    def record() -> None:
        assert loop.anchor is not None
        line = {"steps": loop.steps, "anchor": digest(loop.anchor), "live": len(ddp._gf_outer.membership.replicas)}
        out.write(json.dumps(line) + "\n")
        out.flush()

    if loop.syncs:  # joined a running job at construction: its first sync is already done
        record()
    if args.kill_in_sync:
        advance = quantized_ring.QuantizedRing._advance

        def dying(self: quantized_ring.QuantizedRing) -> None:
            if loop.steps == args.kill_in_sync:
                os.kill(os.getpid(), signal.SIGKILL)
            advance(self)

        quantized_ring.QuantizedRing._advance = dying  # type: ignore[method-assign]

    while loop.steps < args.steps:
        g = torch.Generator().manual_seed(1000 * args.replica + loop.steps)  # this replica's own data
        x = torch.randn(16, 64, generator=g)
        y = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        syncs = loop.syncs
        opt.step()
        if loop.syncs != syncs:
            record()
        if args.kill_at and loop.steps == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.sleep)
    out.close()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
