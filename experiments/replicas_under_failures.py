"""Issue 73's failure run: fewer syncs between replicas that die, hang and come back, on an emulated cluster, beside
torchft's own DiLoCo under the same failure schedule in the same launch.

Three nodes (network namespaces, 1 Gbit/s each way through a switch: ``bench.cluster.EmulatedCluster``), each one
replica of one rank, each its own launch: ``torchrun --standalone --nproc-per-node 1 --max-restarts N`` in its
namespace, so a killed replica is restarted by its launcher, as torchft's own examples launch a replica group.
torchft's Lighthouse runs in a process of its own in node 0's namespace (the job's coordinator; it is never a
victim).  Every replica trains the quality bench's transformer (``bench.models.tiny_transformer``, d_model 128,
2 layers) on the standard library's sources (``bench.quality_data.corpus_ids("stdlib")``: a corpus the run does not
exhaust), AdamW, its own batches, and syncs every ``--every`` steps:

- ``gradientflow``: ``gradientflow.DistributedDataParallel(model, sync_every=H, timeout=T, replicas=manager)`` with
  the defaults (averaged through the 3-bit exchange); the Manager copies the inner AdamW state to a joiner
  (docs/results/fault-tolerance.md: copied is better than fresh);
- ``torchft``: ``torchft.local_sgd.DiLoCo`` (torchft 0.2.0) with its paper's outer step (SGD lr 0.7, Nesterov 0.9)
  in fp32, the Manager healing model and inner optimizer the same way.

Each system runs twice: without failures, then under the failure schedule: ``--failures`` faults at random steps
(seeded), one per stretch of the run, on a random node, each one of: killed (SIGKILL) mid-interval, killed inside
an outer sync, stopped (SIGSTOP: a hung host) mid-interval, stopped inside a sync; a stopped replica is continued
(SIGCONT) ``--stop-seconds`` later, past the timeout.  A replica injects its faults on itself at the scheduled
step (inside a sync: gradientflow's between the quantised ring's rounds, torchft's before its allreduce is posted),
writing a marker first so that no later life repeats it; this script continues the stopped ones.

Every replica trains to the first sync at or after ``--steps`` (4,020 for 4,000 at H = 30), so that it ends on the
anchor.  Recorded per run: wall seconds from the first step to the last replica's end, the progress (the step of the
replicas' anchor) at every sync, the final validation loss of each replica that ended (the anchor after the last
sync: the same bits on every replica that ended with the others; digests compared), the launchers' restarts per
node (a node never failed is never restarted), and whether the run ended by itself (no hang) within ``--limit``.
Goodput: the run's progress per second over the unfailed run's.  Seconds lost per failure, two ways: how long the
failed replica was out (from the fault to its next sync with the others: the replica-seconds of work missing from
the averages; median over the faults that fired), and what the syncs paid (the seconds every node, survivors and
rejoiners alike, spent in sync steps beyond the unfailed run's, over the faults that fired: the survivors' waits on
a lost peer up to ``--timeout``, redone exchanges, healing a rejoiner).  The difference in wall time says little on
a machine with fewer cores than replicas: a missing replica frees a core for the others.

``--from-logs DIR`` writes the table again from DIR's saved node logs and ``results.json``, without running.

    PYTHONPATH=src python experiments/replicas_under_failures.py --steps 4000 --failures 12 \\
        --out benchmarks/replicas_under_failures

Root only (namespaces); everything created is deleted on exit, also when a replica or this script fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from _study import evaluate, save_stdlib_windows

SYSTEMS = ("gradientflow", "torchft")
KINDS = (("kill", "mid"), ("kill", "sync"), ("stop", "mid"), ("stop", "sync"))
LIGHTHOUSE_PORT = 29510


# ---- the schedule ------------------------------------------------------------------------------------------------
def schedule(n: int, steps: int, every: int, nodes: int, seed: int) -> list[dict[str, Any]]:
    """``n`` faults, one in each of ``n`` equal stretches of steps ``[steps/10, steps - steps/10)`` at a random step;
    the four kinds in turn, shuffled; a random node.  A fault inside a sync sits on a sync's step (a multiple of
    ``every``), one mid-interval off it."""
    rng = random.Random(seed)
    lo, hi = steps // 10, steps - steps // 10
    width = (hi - lo) // n
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    rng.shuffle(kinds)
    faults = []
    for i, (kind, where) in enumerate(kinds):
        step = lo + i * width + rng.randrange(width // 4, width - width // 4)
        step = step - step % every + (every if where == "sync" else every // 2)
        faults.append({"id": i, "node": rng.randrange(nodes), "step": step, "kind": kind, "where": where})
    return faults


# ---- one replica (runs under torchrun in its node's namespace) ---------------------------------------------------
def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from gradientflow.bench.data import lm_batch
    from gradientflow.bench.models import tiny_transformer

    torch.set_num_threads(1)
    # torchft's checkpoint transport (how a joiner is healed) announces itself at socket.gethostname(); the emulated
    # nodes share this machine's hostname, which resolves to 127.0.0.1 inside every namespace: the node's address
    # instead, as a real machine's hostname resolves to its own
    socket.gethostname = lambda: args.ip  # type: ignore[assignment]
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run = Path(args.run)
    faults = [f for f in json.loads(Path(args.schedule).read_text()) if f["node"] == args.node]
    timeout = timedelta(seconds=args.timeout)
    data = torch.load(args.data)
    train, val = data["train"], (data["val_x"], data["val_y"])
    dist.init_process_group("gloo", timeout=timeout)  # this replica's own group (torchrun's store), one rank
    torch.manual_seed(args.seed)  # every replica and life builds the same initial model
    d_model, n_layers = (int(v) for v in args.size.split("x"))
    model = tiny_transformer(256, d_model=d_model, n_layers=n_layers, n_heads=4, seq_len=64)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ip = args.ip
    store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False, timeout=timeout)

    def state_dict() -> dict[str, Any]:  # what a replica that is behind is sent: the inner state copied
        return (
            {"model": model.state_dict(), "optim": opt.state_dict()} if args.system == "torchft" else opt.state_dict()
        )

    def load_state_dict(state: dict[str, Any]) -> None:
        if args.system == "torchft":
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
        else:
            opt.load_state_dict(state)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=ip,
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.node}",
        hostname=ip,
        init_sync=False,  # every replica starts from the same seed; a restarted one is behind and healed
        max_retries=1000,
    )
    if life == 0:  # the first launch: all three in the first quorum
        Path(run, f"ready-{args.node}").touch()
        while len(list(run.glob("ready-*"))) < args.nodes:
            time.sleep(0.05)

    every = args.every
    if args.system == "gradientflow":
        import gradientflow
        from gradientflow.comm import quantized_ring

        ddp = gradientflow.DistributedDataParallel(model, sync_every=every, timeout=args.timeout, replicas=manager)
        loop = ddp._gf_outer.loop
        forward: torch.nn.Module = ddp

        def progress() -> int:
            return int(loop.steps)

        def syncs() -> int:
            return int(loop.syncs)

        def attempted() -> bool:  # a sync that fails is redone among the replicas alive within the same step
            return False

        advance = quantized_ring.QuantizedRing._advance

        def advance_or_fail(self: Any) -> None:  # between the ring's rounds: the peers wait on this replica
            inject("sync", progress())
            advance(self)

        quantized_ring.QuantizedRing._advance = advance_or_fail  # type: ignore[method-assign]
        poll = quantized_ring.PairExchange.poll

        def poll_or_fail(self: Any) -> bool:  # two replicas present: the exchange's two-rank form, once posted
            inject("sync", progress())
            return bool(poll(self))

        quantized_ring.PairExchange.poll = poll_or_fail  # type: ignore[method-assign]
    else:
        from torchft.local_sgd import DiLoCo

        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        diloco = DiLoCo(manager, [model], opt, outer, sync_every=every, backup_device=torch.device("cpu"))
        diloco.__enter__()
        forward = model

        def progress() -> int:
            return int(manager.current_step()) * every + int(diloco._local_step)

        def syncs() -> int:
            return int(manager.current_step())

        def attempted() -> bool:
            return int(diloco._local_step) == 0

        allreduce = Manager.allreduce

        def allreduce_or_fail(self: Manager, *a: Any, **k: Any) -> Any:  # before the sync's allreduce is posted
            inject("sync", (int(self.current_step()) + 1) * every)
            return allreduce(self, *a, **k)

        Manager.allreduce = allreduce_or_fail  # type: ignore[method-assign]

    log = open(Path(run, f"node{args.node}.jsonl"), "a")

    def emit(**line: object) -> None:
        log.write(json.dumps({"node": args.node, "life": life, "t": time.time(), **line}) + "\n")
        log.flush()

    def inject(where: str, step: int) -> None:
        for f in faults:
            marker = Path(run, f"fault-{f['id']}")
            if f["where"] == where and f["step"] == step and not marker.exists():
                marker.write_text(json.dumps({"pid": os.getpid(), "t": time.time(), **f}))
                emit(event="fault", **f)
                os.kill(os.getpid(), signal.SIGKILL if f["kind"] == "kill" else signal.SIGSTOP)

    emit(event="start", progress=progress())
    gen = torch.Generator().manual_seed(1000 * args.seed + 100 * args.node + life)
    # to the first sync at or after --steps: every replica ends on the anchor, the same bits everywhere
    while progress() < args.steps or progress() % every:
        x, y = lm_batch(train, 16, 64, gen)
        logits = forward(x.long())
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.long().reshape(-1))
        opt.zero_grad()
        loss.backward()
        before, t = syncs(), time.perf_counter()
        opt.step()
        if syncs() != before:  # the step that synced: its seconds include every try of the sync
            emit(event="sync", progress=progress(), dt=time.perf_counter() - t)
        elif attempted():  # torchft's sync not committed: the interval's steps are trained again
            emit(event="sync_failed", progress=progress(), dt=time.perf_counter() - t)
        inject("mid", progress())
    emit(event="final", progress=progress(), val=evaluate(model, val), digest=digest(model))
    log.close()
    manager.shutdown(wait=False)


def lighthouse(args: argparse.Namespace) -> None:
    """torchft's Lighthouse, in node 0's namespace until this script stops it."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=2, join_timeout_ms=10_000, heartbeat_timeout_ms=2_000
    )
    print(server.address(), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.shutdown()


# ---- one run -----------------------------------------------------------------------------------------------------
def one_run(args: argparse.Namespace, system: str, faults: list[dict[str, Any]], data: Path, tmp: Path) -> dict:
    from gradientflow.bench.cluster import EmulatedCluster
    from gradientflow.bench.cluster_net import stop

    name = f"{system}-{'failed' if faults else 'unfailed'}"
    run = tmp / name
    run.mkdir()
    plan = run / "schedule.json"
    plan.write_text(json.dumps(faults))
    me = [sys.executable, os.path.abspath(__file__)]
    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]
        )
    }
    continued: set[int] = set()
    t0 = time.time()
    with EmulatedCluster(nodes=args.nodes, rate=args.rate, prefix="gfrf") as cluster:
        server = cluster.popen(0, [*me, "--lighthouse-serve"], env=env, stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        server.stdout.readline()  # the lighthouse is up
        address = f"http://{cluster.addresses[0]}:{LIGHTHOUSE_PORT}"
        launchers = []
        for node in range(args.nodes):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "1",
                "--max-restarts",
                str(args.failures + 2),
            ]
            cmd += ["--monitor-interval", "0.5", os.path.abspath(__file__), "--worker", "--system", system]
            cmd += ["--at-node", str(node), "--nodes", str(args.nodes), "--ip", cluster.addresses[node]]
            cmd += ["--lighthouse", address, "--data", str(data), "--workdir", str(run), "--schedule", str(plan)]
            cmd += ["--steps", str(args.steps), "--every", str(args.every), "--lr", str(args.lr), "--size", args.size]
            cmd += ["--seed", str(args.seed), "--timeout", str(args.timeout)]
            with open(run / f"launcher{node}.log", "w") as out:
                launchers.append(cluster.popen(node, cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        hang, first_final = False, None
        deadline = time.monotonic() + args.limit
        while True:
            for marker in run.glob("fault-*"):  # a stopped replica: continued once the stop has lasted
                f = json.loads(marker.read_text())
                if f["kind"] == "stop" and f["id"] not in continued and time.time() - f["t"] > args.stop_seconds:
                    os.kill(f["pid"], signal.SIGCONT)
                    continued.add(f["id"])
            finals = [n for n in range(args.nodes) if '"final"' in _read(run / f"node{n}.jsonl")]
            if finals and first_final is None:
                first_final = time.monotonic()
            if len(finals) == args.nodes or all(p.poll() is not None for p in launchers):
                break
            if first_final is not None and time.monotonic() - first_final > args.grace:
                break  # a replica still behind when the others ended: stopped below, counted as not ended
            if time.monotonic() > deadline:
                hang = True
                break
            time.sleep(0.5)
        for p in launchers:
            if p.poll() is None:
                stop(p)
        server.send_signal(signal.SIGTERM)
        stop(server)
    lines = [json.loads(x) for n in range(args.nodes) for x in _read(run / f"node{n}.jsonl").splitlines()]
    for n in range(args.nodes):  # each node's events (every sync, fault, start and end) and its launcher's tail
        (Path(args.out) / f"{name}-node{n}.jsonl").write_text(_read(run / f"node{n}.jsonl"))
        (Path(args.out) / f"{name}-launcher{n}.log").write_text(_read(run / f"launcher{n}.log")[-20000:])
    return summarize(name, lines, faults, hang, t0)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def summarize(name: str, lines: list[dict], faults: list[dict], hang: bool, t0: float) -> dict:
    starts = [r["t"] for r in lines if r["event"] == "start" and r["life"] == 0]
    finals = [r for r in lines if r["event"] == "final"]
    begin = max(starts) if starts else t0
    end = max((r["t"] for r in finals), default=time.time())
    steps = max((r["progress"] for r in finals), default=0)
    lives = {r["node"]: max(x["life"] for x in lines if x["node"] == r["node"]) for r in lines}
    return {
        "run": name,
        "seconds": end - begin,
        "progress": steps,
        "steps_per_second": steps / (end - begin),
        "hang": hang,
        "ended": sorted(r["node"] for r in finals),
        "final_val": {str(r["node"]): r["val"] for r in finals},
        "digests": {str(r["node"]): r["digest"] for r in finals},
        "restarts": {str(n): lives.get(n, 0) for n in sorted(lives)},
        "faults_fired": sum(1 for r in lines if r["event"] == "fault"),
        "faults": faults,
        "sync_seconds": {  # per node, over its lives: the seconds its sync steps took (waits on lost peers included)
            str(n): sum(r["dt"] for r in lines if r["node"] == n and r["event"] in ("sync", "sync_failed"))
            for n in sorted(lives)
        },
        "syncs_not_committed": sum(1 for r in lines if r["event"] == "sync_failed"),
        "fault_times": [r["t"] - begin for r in lines if r["event"] == "fault"],
        "out_seconds": [_out(r, lines, end) for r in lines if r["event"] == "fault"],
        "syncs": [(r["node"], r["life"], r["progress"], r["t"] - begin) for r in lines if r["event"] == "sync"],
    }


def _out(fault: dict, lines: list[dict], end: float) -> float:
    """Seconds the replica that ``fault`` struck was out of the averages: until its next sync (in any life), or the
    run's end where it never synced again."""
    back = [r["t"] for r in lines if r["event"] == "sync" and r["node"] == fault["node"] and r["t"] > fault["t"]]
    return min(back, default=end) - fault["t"]


def table(results: dict[str, dict]) -> str:
    rows = [
        "| system | run | wall s | final val loss (per replica that ended) | / unfailed | goodput | s a failed "
        "replica was out (median) | extra s in sync steps per failure (every node) | s in sync steps per node | "
        "syncs not committed | restarts per node | identical | ended by itself |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system in SYSTEMS:
        base, failed = results.get(f"{system}-unfailed"), results.get(f"{system}-failed")
        for res in (base, failed):
            if res is None:
                continue
            vals = list(res["final_val"].values())
            loss = sum(vals) / len(vals) if vals else float("nan")
            ratio = goodput = out = paid = "—"
            if res is failed and base is not None and base["final_val"]:
                ref = sum(base["final_val"].values()) / len(base["final_val"])
                ratio = f"{loss / ref:.4f}"
                goodput = f"{res['steps_per_second'] / base['steps_per_second']:.2f}"
                fired = max(res["faults_fired"], 1)
                out = f"{statistics.median(res['out_seconds']):.1f}" if res["out_seconds"] else "—"
                extra = sum(res["sync_seconds"].values()) - sum(base["sync_seconds"].values())
                paid = f"{extra / fired:.1f}"
            same = "yes" if len(set(res["digests"].values())) == 1 else "no"
            ended = "no: hang" if res["hang"] else "yes"
            rows.append(
                f"| {system} | {res['run'].split('-')[1]} | {res['seconds']:.0f} | "
                f"{' '.join(f'{v:.4f}' for v in vals)} | {ratio} | {goodput} | {out} | {paid} | "
                f"{' '.join(f'{v:.0f}' for v in res['sync_seconds'].values())} | {res['syncs_not_committed']} | "
                f"{' '.join(str(v) for v in res['restarts'].values())} | {same} | {ended} |"
            )
    return "\n".join(rows) + "\n"


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, res in results.items():
        pts = sorted((t, p) for _, _, p, t in res["syncs"])
        best: list[tuple[float, int]] = []
        for t, p in pts:  # the anchor's progress: the furthest any replica has synced to
            if not best or p > best[-1][1]:
                best.append((t, p))
        ax.plot([t for t, _ in best], [p for _, p in best], label=key, ls="-" if "unfailed" in key else "--")
        for t in res["fault_times"]:  # the faults as they fired
            ax.axvline(t, color="grey", lw=0.5, alpha=0.5)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("step of the replicas' anchor")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def retable(out: Path) -> None:
    """The table of a finished launch (``out``: its ``results.json`` and node logs), summarised again."""
    saved = json.loads((out / "results.json").read_text())
    results = {}
    for name, res in saved["results"].items():
        if not (out / f"{name}-node0.jsonl").exists():
            raise SystemExit(f"{out}: no node logs for {name} (--from-logs needs the logs a launch saves beside it)")
        lines = [
            json.loads(line)
            for n in range(saved["config"]["nodes"])
            for line in _read(out / f"{name}-node{n}.jsonl").splitlines()
            if line.strip()
        ]
        results[name] = summarize(name, lines, res["faults"], res["hang"], 0.0)
    (out / "results.json").write_text(json.dumps({"config": saved["config"], "results": results}, indent=1))
    (out / "table.md").write_text(table(results))
    print(table(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse-serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", choices=SYSTEMS, default="gradientflow")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--at-node", dest="node", type=int, default=0)
    ap.add_argument("--ip", default="127.0.0.1")
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--data", default="")
    ap.add_argument("--workdir", dest="run", default="")
    ap.add_argument("--schedule", default="")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rate", default="1gbit", help="each node's link to the switch, each way")
    ap.add_argument(
        "--size",
        default="128x2",
        help="the transformer's d_model x layers: 128x2 steps about 12 times a second on 3 replicas of this 2-core "
        "machine, 256x4 about 3 times (a step's seconds set how many steps a fault's seconds cost)",
    )
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--every", type=int, default=30, help="sync_every (H) of both systems")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0, help="the model's, the batches' and the schedule's")
    ap.add_argument("--failures", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds: gradientflow's timeout= and torchft's")
    ap.add_argument("--quorum-timeout", type=float, default=120.0)
    ap.add_argument("--stop-seconds", type=float, default=30.0, help="how long a stopped replica stays stopped")
    ap.add_argument("--grace", type=float, default=90.0, help="seconds the last replica has after the first ended")
    ap.add_argument("--limit", type=float, default=3600.0, help="seconds one run may take: past it, a hang")
    ap.add_argument("--out", default="benchmarks/replicas_under_failures")
    ap.add_argument("--from-logs", default="", help="write DIR's table again from its saved logs, without running")
    args = ap.parse_args()
    if args.from_logs:
        retable(Path(args.from_logs))
        return
    if args.worker:
        worker(args)
        return
    if args.lighthouse_serve:
        lighthouse(args)
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    faults = schedule(args.failures, args.steps, args.every, args.nodes, args.seed)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data.pt"  # loaded once here: a restarted replica reads it in a second
        save_stdlib_windows(data, 256)
        for system in args.systems:
            for plan in ([], faults):
                res = one_run(args, system, plan, data, tmp)
                results[res["run"]] = res
                print(json.dumps({k: v for k, v in res.items() if k not in ("syncs", "faults")}), flush=True)
                (out / "results.json").write_text(json.dumps({"config": vars(args), "results": results}, indent=1))
    (out / "table.md").write_text(table(results))
    plot(results, out / "progress.png")
    print(table(results))


if __name__ == "__main__":
    main()
