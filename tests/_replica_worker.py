"""One replica of tests/test_replicas.py: its own launch (a one-rank Gloo group), its own torchft Manager, the
wrapper with ``sync_every`` and ``replicas=manager``.  After every outer sync it appends one JSON line to ``--out``:
the inner step count, digests of the anchor's and the outer momentum's bytes, the number of live replicas and the
size of the last quantised exchange's group (2: the two-rank form; 3 or more: the reduce-scatter form).

Failures it injects on itself (the harness's kills and stops): ``--kill-at K`` SIGKILLs this process after its inner
step K (mid-interval where K is not a multiple of H); ``--kill-in-sync K`` SIGKILLs it inside the outer sync after
step K: with the quantised exchange once its first round has arrived and before it posts the second, with the others
once the sync's quorum and count are done and before its exchange is posted (the others wait on it in either case).
``--stop-at K`` / ``--stop-in-sync K``: the same places, SIGSTOP (a hung host) instead; the harness sends SIGCONT.

``--dump PATH``: every outer exchange that completed here, saved at the end (``torch.save``): the step, the divisor,
the pseudo-gradient handed in, the fragment's residual before and after, and the mean (error mass, the test's check).
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
from typing import Any

import torch
import torch.distributed as dist
from _loopback_manager import loopback_manager
from torch import nn

import gradientflow
from gradientflow.comm import quantized_ring
from gradientflow.outer import exchange


def digest(tensors: list[torch.Tensor] | None) -> str:
    h = hashlib.sha256()
    for t in tensors or []:
        h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    ap.add_argument("--compression", default="3bit")
    ap.add_argument("--timeout", type=float, default=20.0)  # the wrapper's and the Manager's, seconds
    ap.add_argument("--sleep", type=float, default=0.05)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--kill-in-sync", type=int, default=0)
    ap.add_argument("--stop-at", type=int, default=0)
    ap.add_argument("--stop-in-sync", type=int, default=0)
    ap.add_argument("--dump", default="")
    ap.add_argument("--ready", default="")  # a folder: wait until --world replicas are ready before the first quorum
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # the survivors' WARNINGs, with their level and logger, are what the tests read
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    timeout = timedelta(seconds=args.timeout)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)  # this replica
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    manager = loopback_manager(args.lighthouse, args.replica, store.port, timeout)
    if args.ready:  # the first launch: every replica heartbeating before the first quorum, so all three are in it
        Path(args.ready, str(args.replica)).touch()
        while len(os.listdir(args.ready)) < args.world:
            time.sleep(0.05)

    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = gradientflow.DistributedDataParallel(
        model,
        sync_every=args.every,
        sync_fragments=args.fragments,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        outer_compression=args.compression,
        timeout=args.timeout,
        replicas=manager,
    )
    loop = ddp._gf_outer.loop
    out = open(args.out, "a")
    ring_world = [0]  # the group size of the last quantised exchange

    def record() -> None:
        assert loop.anchor is not None
        line = {
            "steps": loop.steps,
            "anchor": digest(loop.anchor),
            "momentum": digest(loop.buf),
            "live": len(ddp._gf_outer.membership.replicas),
            "ring": ring_world[0],
        }
        out.write(json.dumps(line) + "\n")
        out.flush()

    ring_init = quantized_ring.QuantizedRing.__init__

    def counted(self: quantized_ring.QuantizedRing, *a: Any, **k: Any) -> None:
        ring_world[0] = a[2].size() if len(a) > 2 else k["group"].size()
        ring_init(self, *a, **k)

    quantized_ring.QuantizedRing.__init__ = counted  # type: ignore[method-assign]

    if loop.syncs:  # joined a running job at construction: its first sync is already done
        record()
    fault_in_sync = args.kill_in_sync or args.stop_in_sync
    fault = signal.SIGKILL if args.kill_in_sync else signal.SIGSTOP
    once = [True]  # a stopped replica, continued and healed, may meet step K again: it is stopped once

    def inject() -> None:
        if loop.steps == fault_in_sync and once[0]:
            once[0] = False
            os.kill(os.getpid(), fault)

    if fault_in_sync and args.compression == "3bit":  # between the ring's rounds
        advance = quantized_ring.QuantizedRing._advance

        def dying(self: quantized_ring.QuantizedRing) -> None:
            inject()
            advance(self)

        quantized_ring.QuantizedRing._advance = dying  # type: ignore[method-assign]
    elif fault_in_sync:  # the dense allreduce and the top-k all-gather: one collective, before it is posted
        start = exchange.Average.start

        def dying_start(self: exchange.Average, x: torch.Tensor, f: int, what: str) -> exchange.Flight:
            inject()
            return start(self, x, f, what)

        exchange.Average.start = dying_start  # type: ignore[method-assign]
    completed: list[dict[str, Any]] = []
    if args.dump:
        # an exchange's input at its start, its result once gathered (the replicas' membership completes the exchange
        # between replicas, votes, then gathers: outer/membership.py); a try that failed never reaches the gather
        start, gathered = exchange.Average.start, exchange.Flight.gathered
        handed_in: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}

        def recorded_start(self: exchange.Average, x: torch.Tensor, f: int, what: str) -> Any:
            before = self.residuals[f]
            given = (x.clone(), None if before is None else before.clone(), self.parties)
            flight = start(self, x, f, what)
            handed_in[id(flight)] = given
            return flight

        def recorded_gathered(self: exchange.Flight) -> Any:
            sent, residual = gathered(self)
            given, before, parties = handed_in.pop(id(self))
            after = None if residual is None else residual.clone()
            completed.append(
                {"steps": loop.steps, "parties": parties, "x": given, "before": before, "after": after, "mean": self.x}
            )
            return sent, residual

        exchange.Average.start = recorded_start  # type: ignore[method-assign]
        exchange.Flight.gathered = recorded_gathered  # type: ignore[method-assign]

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
        if args.stop_at and loop.steps == args.stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(args.sleep)
    out.close()
    if args.dump:
        torch.save(completed, args.dump)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
