"""Whether a replica that (re)joins a run with ``replicas=torchft.Manager`` should take its inner optimizer state
fresh or copied from a live peer (issue 73): measured on the quality bench's transformer.

Three one-rank replicas on loopback, each its own process with its own torchft Manager, torchft's Lighthouse in this
process; ``gradientflow.DistributedDataParallel(model, sync_every=H, replicas=manager)`` with the defaults (the
replicas averaged through the 3-bit exchange).  The bench's TinyTransformer on the standard library's sources
(``gradientflow.bench.quality_data.corpus_ids("stdlib")``: a corpus the run does not exhaust), AdamW.  Replica 2 is
killed (SIGKILL, mid-interval) after ``--lives`` own steps and restarted by this script, twice; every restarted
process joins at the survivors' next sync, healed to their anchor.  ``fresh``: its AdamW starts empty (the Manager
without ``state_dict=``); ``copied``: the Manager's ``state_dict=`` / ``load_state_dict=`` are the optimizer's, so
the join also copies a live peer's AdamW moments and step count.

Recorded per run: the final validation loss (the anchor after the last sync, the same bits on every replica), and per
join the rejoiner's validation loss at the end of its first interval (its parameters after H - 1 inner steps from
the anchor, the last look before they are averaged in) beside the survivors' at the same step, and its mean training
loss over those H steps beside theirs.

    PYTHONPATH=src python experiments/rejoin_optimizer_state.py --seeds 0 1 --out benchmarks/rejoin_optimizer_state
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from _study import evaluate, save_stdlib_windows

MODES = ("fresh", "copied")


def worker(args: argparse.Namespace) -> None:
    """One replica: trains to ``--steps``, one JSON line per event to ``--log``; SIGKILLs itself after ``--life``
    own inner steps (0: never)."""
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    import gradientflow
    from gradientflow.bench.data import lm_batch
    from gradientflow.bench.models import tiny_transformer

    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    data = torch.load(args.data)
    train, val = data["train"], (data["val_x"], data["val_y"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    torch.manual_seed(args.seed)  # every replica and incarnation builds the same initial model
    model = tiny_transformer(256, d_model=args.width, n_layers=2, n_heads=4, seq_len=64)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    copied = args.mode == "copied"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=opt.load_state_dict if copied else None,
        state_dict=opt.state_dict if copied else None,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}",
        hostname="127.0.0.1",
        init_sync=False,
        max_retries=20,
    )
    if args.ready:  # the first launch: all three in the first quorum
        Path(args.ready, str(args.replica)).touch()
        while len(os.listdir(args.ready)) < 3:
            time.sleep(0.05)
    ddp = gradientflow.DistributedDataParallel(model, sync_every=args.every, timeout=60, replicas=manager)
    loop = ddp._gf_outer.loop
    log = open(args.log, "a")

    def emit(**line: object) -> None:
        log.write(json.dumps({"replica": args.replica, "life": args.incarnation, **line}) + "\n")
        log.flush()

    emit(event="start", steps=loop.steps, joined=loop.syncs > 0, adam_steps=len(opt.state))
    gen = torch.Generator().manual_seed(1000 * args.seed + 100 * args.replica + args.incarnation)
    own = 0
    while loop.steps < args.steps:
        x, y = lm_batch(train, 16, 64, gen)
        logits = ddp(x.long())
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.long().reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        own += 1
        emit(event="step", steps=loop.steps, loss=loss.item())
        if loop.steps % args.every == args.every - 1:  # the end of an interval: this replica's own parameters
            emit(event="presync", steps=loop.steps + 1, val=evaluate(model, val))
        if args.life and own == args.life:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.sleep)  # the survivors' pace: a restart (about 10 s on a loaded machine) costs some steps
    emit(event="final", steps=loop.steps, val=evaluate(model, val))
    log.close()
    manager.shutdown(wait=False)


def one_run(args: argparse.Namespace, mode: str, seed: int, data: Path, tmp: Path) -> list[dict]:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=120_000, heartbeat_timeout_ms=2000)
    log = tmp / f"{mode}-{seed}.jsonl"
    ready = tmp / f"ready-{mode}-{seed}"
    ready.mkdir()
    base = [sys.executable, __file__, "--worker", "--lighthouse", server.address(), "--data", str(data)]
    base += ["--mode", mode, "--seed", str(seed), "--log", str(log), "--steps", str(args.steps)]
    base += ["--every", str(args.every), "--lr", str(args.lr), "--width", str(args.width), "--sleep", str(args.sleep)]

    def launch(replica: int, incarnation: int, first: bool) -> subprocess.Popen:
        life = args.lives[incarnation] if replica == 2 and incarnation < len(args.lives) else 0
        cmd = [*base, "--replica", str(replica), "--incarnation", str(incarnation), "--life", str(life)]
        return subprocess.Popen([*cmd, *(["--ready", str(ready)] if first else [])])

    procs = {r: launch(r, 0, True) for r in range(3)}
    incarnation = 0
    deadline = time.monotonic() + args.limit
    try:
        while time.monotonic() < deadline:
            if procs[2].poll() is not None and procs[2].returncode == -signal.SIGKILL and incarnation < len(args.lives):
                incarnation += 1  # killed: restarted by its launcher (here)
                procs[2] = launch(2, incarnation, False)
            if procs[0].poll() is not None and procs[1].poll() is not None:  # the survivors are done: a rejoiner
                procs[2].kill()  # still waiting for a quorum would wait for its timeout
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{mode} seed {seed}: still running after {args.limit} s")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        server.shutdown()
    return [json.loads(line) for line in log.read_text().splitlines()]


def summarize(lines: list[dict], every: int) -> dict:
    """The final loss and, per join of replica 2, its first interval beside the survivors'."""
    final = [r["val"] for r in lines if r["event"] == "final" and r["replica"] == 0][0]
    joins = []
    for start in (r for r in lines if r["event"] == "start" and r["replica"] == 2 and r["joined"]):
        s0, life = start["steps"], start["life"]
        mine = [r for r in lines if r["replica"] == 2 and r["life"] == life and s0 < r["steps"] <= s0 + every]
        theirs = [r for r in lines if r["replica"] in (0, 1) and s0 < r["steps"] <= s0 + every]

        def mean(rows: list[dict], event: str, key: str) -> float:
            vals = [r[key] for r in rows if r["event"] == event]
            return sum(vals) / len(vals) if vals else float("nan")

        joins.append(
            {
                "joined_at": s0,
                "adam_steps_at_join": start["adam_steps"],
                "presync_val": mean(mine, "presync", "val"),
                "survivors_presync_val": mean(theirs, "presync", "val"),
                "train_loss": mean(mine, "step", "loss"),
                "survivors_train_loss": mean(theirs, "step", "loss"),
            }
        )
    return {"final_val": final, "joins": joins}


def table(results: dict) -> str:
    rows = [
        "| mode | seed | final val loss | joined at step | its val loss after H - 1 steps (survivors') | "
        "its train loss over H steps (survivors') |",
        "|---|---|---|---|---|---|",
    ]
    for key, res in sorted(results.items()):
        mode, seed = key.split("/")
        for j in res["joins"]:
            rows.append(
                f"| {mode} | {seed} | {res['final_val']:.4f} | {j['joined_at']} | {j['presync_val']:.4f} "
                f"({j['survivors_presync_val']:.4f}) | {j['train_loss']:.4f} ({j['survivors_train_loss']:.4f}) |"
            )
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--data", default="")
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--life", type=int, default=0)
    ap.add_argument("--ready", default="")
    ap.add_argument("--log", default="")
    ap.add_argument("--mode", choices=MODES, default="fresh")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--sleep", type=float, default=0.05)
    ap.add_argument("--lives", type=int, nargs="+", default=[95, 45], help="replica 2's own steps before each kill")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds one run may take (then it is killed)")
    ap.add_argument("--out", default="benchmarks/rejoin_optimizer_state")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data.pt"  # loaded once here: each restart reads it in a second, not the sources again
        save_stdlib_windows(data, 64)
        results = {}
        for seed in args.seeds:
            for mode in args.modes:
                t0 = time.monotonic()
                lines = one_run(args, mode, seed, data, tmp)
                results[f"{mode}/{seed}"] = {**summarize(lines, args.every), "seconds": time.monotonic() - t0}
                (out / f"{mode}-{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
                print(mode, seed, json.dumps(results[f"{mode}/{seed}"]), flush=True)
    config = {k: v for k, v in vars(args).items() if k in ("steps", "every", "lr", "width", "sleep", "lives", "seeds")}
    (out / "results.json").write_text(json.dumps({"config": config, "results": results}, indent=1))
    (out / "table.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
