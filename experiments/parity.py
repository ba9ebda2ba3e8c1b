"""Bit-for-bit parity of the exchanges: small Gloo trainings whose final loss and parameters must not move.

    PYTHONPATH=src python experiments/parity.py --out /work/parity/before.json
    PYTHONPATH=src python experiments/parity.py --out /work/parity/after.json --compare /work/parity/before.json

A refactor of the exchange code (the wrapper's engine, the quantised ring, CSC, two-level, the FSDP hook, the
outer loop of ``sync_every``) must change no bit of what a training computes.  Each case below trains a small
MLP (2-D weights and 1-D biases and LayerNorm scales) on 2 or 4 Gloo ranks on loopback, fp32, no AMP and no
GradScaler, with the same initial weights and the same batches per rank in every run, and records the final
training loss as ``repr(float)`` (every digit), a sha256 of rank 0's flattened fp32 parameters, every rank's
loss per step (where a difference starts) and the integer byte counters of ``comm_stats(total=True)`` (the wire
format; per step, what it handed to the exchange).  Under FSDP the sha is of rank 0's gathered full parameters.
``--out`` gets the JSON, the same path with ``.md`` the table (also printed); ``--compare`` exits 1 naming every
case whose loss, parameters or bytes differ from an earlier JSON; ``--torch-ops`` turns the C kernels off (the
callers' torch ops, which the kernels promise to match bit for bit).  A rank that fails, dies or hangs fails the
run (exit 1, each rank's traceback), and no JSON is written.

Each case runs long enough to reach every phase of its recipe: ``"2bit-precond"`` past its 20 steps at 3 bits,
the top-k recipes past their density ramp (``warmup_steps=5``, and once at the default 100), ``sync_every=4``
through 10 outer syncs.  Recipes are named explicitly (never ``"auto"``, which measures the link, nor
``schedule="auto"``), so nothing depends on timing.  Each case's ranks are forked fresh (from a forkserver that
imported torch and gradientflow once), so no state leaks between cases and ``--cases`` reproduces one alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

PG_TIMEOUT_S = 60  # every collective of a case: a rank that hangs fails the case, not the script
GRACE_S = 15  # after a rank's failure, how long its peers' own reports are awaited
IN, HIDDEN, OUT, BATCH = 24, 48, 10, 16  # 4,234 parameters: not a whole number of 128-blocks or chunks
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
SGD = {"lr": 0.05, "momentum": 0.9}
SMALL_BUCKETS_MB = 0.008  # ~2,100 floats a bucket: the pool in 3 slices, so per-slice exchanges overlap backward
TORCHRUN_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "ROLE_RANK")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    door: str  # "ddp": gradientflow.DistributedDataParallel; "fsdp": gradientflow.fsdp.fully_shard on a 2-D mesh
    nodes: int
    per_node: int  # 1: flat ranks (no torchrun variables); >1: torchrun's variables, as on nodes of that many
    optimizer: str  # "adamw" or "sgd"
    steps: int
    options: dict[str, Any]

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def call(self) -> str:
        """What a user writes for this case (the table's command-equivalent)."""
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        if self.door == "fsdp":
            mesh = f"init_device_mesh('cpu', ({self.nodes}, {self.per_node}), ('replicate', 'shard'))"
            return f"gf.fsdp.fully_shard(block, mesh={mesh}, {opts}); {self.optimizer}, {self.steps} steps"
        return f"gf.DistributedDataParallel(net, {opts}); {self.world} ranks, {self.optimizer}, {self.steps} steps"


def _cases() -> list[Case]:
    flat, flat4 = ("ddp", 2, 1), ("ddp", 4, 1)
    two, hsdp = ("ddp", 2, 2), ("fsdp", 2, 2)
    t2 = {"topology": "2x2"}  # the DDP wrapper's two-level exchange, named (its "auto" reads the same variables)
    small = {"bucket_cap_mb": SMALL_BUCKETS_MB}
    w5 = {"warmup_steps": 5}  # the density ramp over 5 steps: the sparse path from step 5 on
    h4 = {"compression": "none", "sync_every": 4}  # 40 steps: 10 outer syncs, error feedback carried across them
    rows = [
        # name, (door, nodes, ranks per node), optimizer, steps, options
        # The dense reference: torch DDP's numerics through the same engine (and FSDP's through torch's HSDP).
        ("ddp-flat-none", flat, "adamw", 40, {"compression": "none"}),
        ("ddp-flat-3bit", flat, "adamw", 40, {"compression": "3bit"}),
        ("ddp-flat-3bit-buckets", flat, "adamw", 40, {"compression": "3bit", **small}),
        # 20 steps at 3 bits, then 40 at 2: both widths and the switch.
        ("ddp-flat-2bit-precond", flat, "adamw", 60, {"compression": "2bit-precond"}),
        ("ddp-flat-topk-3bit-w5", flat, "sgd", 40, {"compression": "topk-3bit", **w5}),
        ("ddp-flat-topk-3bit-w5-buckets", flat, "sgd", 40, {"compression": "topk-3bit", **w5, **small}),
        ("ddp-flat-topk-3bit-w5-adamw", flat, "adamw", 40, {"compression": "topk-3bit", **w5}),
        # The default 100-step ramp and 30 steps past it.
        ("ddp-flat-topk-3bit", flat, "sgd", 130, {"compression": "topk-3bit"}),
        ("ddp-flat-topk-fp16-w5", flat, "sgd", 40, {"compression": "topk-fp16", **w5}),
        # More than two parties: the quantised direct reduce-scatter and all-gather, not the 2-party swap.
        ("ddp-flat4-3bit", flat4, "adamw", 40, {"compression": "3bit"}),
        ("ddp-flat4-3bit-precond", flat4, "adamw", 40, {"compression": "3bit-precond"}),
        ("ddp-2x2-none", two, "adamw", 40, {"compression": "none", **t2}),
        ("ddp-2x2-3bit", two, "adamw", 40, {"compression": "3bit", **t2}),
        ("ddp-2x2-3bit-buckets", two, "adamw", 40, {"compression": "3bit", **t2, **small}),
        ("ddp-2x2-2bit-precond", two, "adamw", 60, {"compression": "2bit-precond", **t2}),
        ("ddp-2x2-topk-3bit-w5", two, "sgd", 40, {"compression": "topk-3bit", **w5, **t2}),
        ("ddp-2x2-topk-3bit", two, "sgd", 130, {"compression": "topk-3bit", **t2}),
        ("fsdp-2x2-none", hsdp, "adamw", 40, {"compression": "none"}),
        ("fsdp-2x2-3bit", hsdp, "adamw", 40, {"compression": "3bit"}),
        ("fsdp-2x2-2bit-precond", hsdp, "adamw", 60, {"compression": "2bit-precond"}),
        ("fsdp-2x2-topk-3bit-w5", hsdp, "sgd", 40, {"compression": "topk-3bit", **w5}),
        ("fsdp-2x2-topk-3bit", hsdp, "sgd", 130, {"compression": "topk-3bit"}),
        ("ddp-flat-h4-3bit", flat, "adamw", 40, {**h4, "outer_compression": "3bit"}),
        # The case ids keep the names of the first run (2026-12-06, before the outer top-k rows were named
        # "indexed-topk-*"): that run passed the earlier name "topk-2bit", which still means this row.
        ("ddp-flat-h4-topk-2bit", flat, "adamw", 40, {**h4, "outer_compression": "indexed-topk-2bit"}),
        # Streaming: 2 fragments in turn, each merged one inner step late.
        ("ddp-flat-h4-3bit-f2d1", flat, "adamw", 40, {**h4, "sync_fragments": 2, "sync_delay": 1}),
        ("ddp-2x2-h4-3bit", two, "adamw", 40, {**h4, "outer_compression": "3bit", **t2}),
        ("ddp-2x2-h4-topk-2bit", two, "adamw", 40, {**h4, "outer_compression": "indexed-topk-2bit", **t2}),
    ]
    return [
        Case(name, door, nodes, per_node, optimizer, steps, options)
        for name, (door, nodes, per_node), optimizer, steps, options in rows
    ]


CASES = {c.name: c for c in _cases()}


# ---- one rank ---------------------------------------------------------------------------------------------------


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.LayerNorm(HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.LayerNorm(HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: a function of (rank, step) alone, labelled by a fixed random teacher so the
    loss falls (the gradients then shrink and change sign as in a real run, which the codecs' scales see)."""
    teacher = torch.Generator().manual_seed(12345)
    w = torch.randn(IN, OUT, generator=teacher)
    g = torch.Generator().manual_seed(100_003 * (rank + 1) + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, (x @ w).argmax(dim=1)


def _sha(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def _byte_counters(stats: dict[str, Any]) -> dict[str, int]:
    # Seconds vary run to run; the bytes are the wire format, which a refactor must keep too.
    return {k: v for k, v in sorted(stats.items()) if "bytes" in k and isinstance(v, int)}


def _train(case: Case, rank: int) -> dict[str, Any]:
    import gradientflow as gf
    import gradientflow.fsdp as gff
    from gradientflow.comm import codec_native
    from gradientflow.strategies import csc_native

    # topk-3bit beside AdamW warns at its first step (a quality note): the case runs it on purpose.
    warnings.filterwarnings("ignore", message=r".*with an Adam-type optimizer")
    net = _net()
    if case.door == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (case.nodes, case.per_node), mesh_dim_names=("replicate", "shard"))
        for block in (net[0], net[3], net):  # per block and at the root, as FSDP2 users shard
            gff.fully_shard(block, mesh=mesh, timeout=PG_TIMEOUT_S, **case.options)
        model: torch.nn.Module = net
    else:
        model = gf.DistributedDataParallel(net, timeout=PG_TIMEOUT_S, **case.options)
    params = list(model.parameters())
    if case.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, **ADAMW)
    else:
        opt = torch.optim.SGD(params, **SGD)
    losses, sent = [], []
    for step in range(case.steps):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        # What this step handed to the exchange (the outer loop's: summed since construction): shows each phase
        # was reached (the 2-bit codes after step 20, the sparse chunks after the ramp, the syncs every H steps).
        last = gff.comm_stats(model) if case.door == "fsdp" else model.comm_stats()
        sent.append(last["payload_bytes"] + last.get("outer_payload_bytes", 0))
    if case.door == "fsdp":
        full = [p.full_tensor() for p in model.parameters()]  # a collective: every rank gathers the whole model
        stats = gff.comm_stats(model, total=True)
        config = {"compression": stats["compression"]}
    else:
        full = list(model.parameters())
        stats = model.comm_stats(total=True)
        config = {k: v for k, v in dataclasses.asdict(model.config).items() if isinstance(v, (str, int, float))}
    flat = torch.cat([p.detach().reshape(-1) for p in full])
    return {
        "losses": [repr(v) for v in losses],
        "step_payload_bytes": sent,
        "params_sha256": _sha(flat),
        "numel": flat.numel(),
        "finite": bool(torch.isfinite(flat).all()),
        "bytes": _byte_counters(stats),
        "config": config,
        # Which path ran, as this rank saw it (the parent's view would miss --torch-ops).
        "c_kernels": {"codec": codec_native.library() is not None, "csc": csc_native.available()},
    }


def _rank(case: Case, rank: int, store_path: str, results, env: dict[str, str], torch_ops: bool) -> None:
    import torch.distributed as dist

    if torch_ops:  # every C kernel "unavailable": the callers' torch ops, which the kernels promise to match
        from gradientflow.comm import native

        native.load = lambda *args, **kwargs: None

    os.environ.clear()
    os.environ.update(env)
    for k in TORCHRUN_VARS:  # the case alone decides the layout the library reads
        os.environ.pop(k, None)
    if case.per_node > 1:  # torchrun's variables, as on a node of per_node ranks (as tests/_dist.py emulates)
        os.environ.update(
            LOCAL_WORLD_SIZE=str(case.per_node),
            LOCAL_RANK=str(rank % case.per_node),
            GROUP_RANK=str(rank // case.per_node),
            RANK=str(rank),
            WORLD_SIZE=str(case.world),
        )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    torch.set_num_threads(1)  # one thread: no intra-op split whose summation order could vary
    torch.use_deterministic_algorithms(True)
    try:
        store = dist.FileStore(store_path, case.world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=case.world, timeout=timedelta(seconds=PG_TIMEOUT_S)
        )
        try:
            results.put((rank, "ok", _train(case, rank)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 — the parent raises it with the rank and case named
        results.put((rank, "error", traceback.format_exc()))


# ---- the launcher -----------------------------------------------------------------------------------------------


class CaseFailed(RuntimeError):
    pass


def _context():
    # Forking from a server that imported torch and gradientflow once starts a rank in milliseconds, each case
    # still in fresh processes (no state of the library carried from one case to the next).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "gradientflow", "gradientflow.wrapper.ddp"])
    return ctx


def _collect(results, procs: list, timeout: float) -> dict[int, tuple[str, Any]]:
    """Each rank's ``(status, value)`` as it reports.  After a failure, its peers are awaited until each has
    reported or died, at most ``GRACE_S`` (a peer in a collective with a dead rank fails in seconds: Gloo sees the
    closed connection); else until ``timeout``: what is missing then hung."""
    got: dict[int, tuple[str, Any]] = {}
    deadline, failed_at = time.monotonic() + timeout, None
    while len(got) < len(procs):
        try:
            rank, status, value = results.get(timeout=1.0)
            got[rank] = (status, value)
            if status != "ok" and failed_at is None:
                failed_at = time.monotonic()
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        silent = [r for r in range(len(procs)) if r not in got]
        if failed_at is None and any(procs[r].exitcode not in (None, 0) for r in silent):
            failed_at = now  # a rank died without a word (killed, os._exit)
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
            break
        if failed_at is not None and all(procs[r].exitcode is not None for r in silent):
            break
    while True:  # what a rank put just before it exited
        try:
            rank, status, value = results.get(timeout=0.5)
            got[rank] = (status, value)
        except queue.Empty:
            return got


def run_case(ctx, case: Case, timeout: float, torch_ops: bool = False) -> list[dict[str, Any]]:
    """Every rank's result, by rank; :class:`CaseFailed` naming what each rank did if any fails, dies or hangs."""
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        env = dict(os.environ)
        procs = [
            ctx.Process(target=_rank, args=(case, r, store, results, env, torch_ops), daemon=True)
            for r in range(case.world)
        ]
        for p in procs:
            p.start()
        hung: list[int] = []
        try:
            got = _collect(results, procs, timeout)
            hung = [r for r, p in enumerate(procs) if r not in got and p.is_alive()]
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if len(got) == case.world and all(status == "ok" for status, _ in got.values()):
        return [got[r][1] for r in range(case.world)]
    lines = []
    for r, p in enumerate(procs):
        if r in hung:
            lines.append(f"rank {r}: no result, still running (hung): killed")
        elif r not in got:
            lines.append(f"rank {r}: died without a result, exit code {p.exitcode}")
        elif got[r][0] != "ok":
            lines.append(f"rank {r}:\n{got[r][1]}")
        else:
            lines.append(f"rank {r}: returned")
    raise CaseFailed(f"case {case.name} failed:\n" + "\n".join(lines))


def _summary(case: Case, ranks: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    zero = ranks[0]
    return {
        "call": case.call(),
        "door": case.door,
        "layout": f"{case.nodes}x{case.per_node}",
        "optimizer": case.optimizer,
        "steps": case.steps,
        "options": case.options,
        "final_loss": zero["losses"][-1],  # rank 0's last training loss, repr: every digit
        "params_sha256": zero["params_sha256"],
        "numel": zero["numel"],
        "finite": all(r["finite"] for r in ranks),
        "replicas_identical": len({r["params_sha256"] for r in ranks}) == 1,
        "rank_params_sha256": [r["params_sha256"] for r in ranks],
        "rank_losses": [r["losses"] for r in ranks],
        "bytes": zero["bytes"],
        "step_payload_bytes": zero["step_payload_bytes"],
        "config": zero["config"],
        "c_kernels": zero["c_kernels"],
        "seconds": round(seconds, 2),
    }


def _code_version() -> dict[str, Any]:
    import gradientflow

    root = Path(gradientflow.__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "gradientflow": str(Path(gradientflow.__file__).parent),
        "commit": git("rev-parse", "HEAD"),
        # The library's code itself: equal src trees are the same code whatever else the commits changed.
        "src_tree": git("rev-parse", "HEAD:src"),
        "src_dirty": bool(git("status", "--porcelain", "--", "src")),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def _table(runs: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| case | command-equivalent | final loss (rank 0) | params sha256 | replicas equal | s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | `{r['call']}` | {r['final_loss']} | `{r['params_sha256'][:16]}` | "
            f"{'yes' if r['replicas_identical'] else 'no'} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def _canonical(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with each recipe by its row's name: an earlier name (an alias) means exactly its row, so a run
    that passed it is the same case as one passing the row's name (the same config, the same bits promised)."""
    from gradientflow.option_values import lookup
    from gradientflow.outer_options import outer_exchange_of

    out = dict(options)
    if "compression" in out:
        out["compression"] = lookup(out["compression"]).name
    if "outer_compression" in out:
        out["outer_compression"] = outer_exchange_of(out["outer_compression"]).name
    return out


def _compare(runs: dict[str, dict[str, Any]], earlier: dict[str, Any]) -> list[str]:
    """Every difference from an earlier run's JSON, in words (empty: bit for bit the same)."""
    diffs = []
    for name, r in runs.items():
        e = earlier["runs"].get(name)
        if e is None:
            diffs.append(f"{name}: not in the earlier run")
            continue
        if _canonical(e["options"]) != _canonical(r["options"]) or e["steps"] != r["steps"]:
            diffs.append(f"{name}: another case than the earlier run's ({e['call']})")
            continue
        for key in ("final_loss", "params_sha256", "rank_params_sha256", "bytes"):
            if e[key] != r[key]:
                diffs.append(f"{name}: {key} {e[key]} -> {r[key]}")
        step = next(
            (i for i, (u, v) in enumerate(zip(e["step_payload_bytes"], r["step_payload_bytes"])) if u != v), None
        )
        if step is not None:
            diffs.append(f"{name}: bytes handed to the exchange first differ at step {step}")
        first = next(
            (
                (rank, step)
                for rank, (a, b) in enumerate(zip(e["rank_losses"], r["rank_losses"]))
                for step, (u, v) in enumerate(zip(a, b))
                if u != v
            ),
            None,
        )
        if first is not None:
            diffs.append(f"{name}: losses first differ at rank {first[0]} step {first[1]}")
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON; the table goes beside it as .md")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), help="a subset (default: every case)")
    parser.add_argument("--compare", type=Path, help="an earlier --out: exit 1 naming every difference")
    parser.add_argument(
        "--torch-ops", action="store_true", help="the C kernels off: torch's ops (which they promise to match)"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds a case may take before it fails")
    args = parser.parse_args()
    names = args.cases or list(CASES)
    ctx = _context()
    started = time.monotonic()
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        t0 = time.monotonic()
        # A failed or hung rank raises here: no JSON is written from a partial run.
        ranks = run_case(ctx, CASES[name], args.timeout, args.torch_ops)
        runs[name] = _summary(CASES[name], ranks, time.monotonic() - t0)
        print(
            f"{name}: loss {runs[name]['final_loss']} params {runs[name]['params_sha256'][:16]} "
            f"({runs[name]['seconds']:.1f} s)",
            flush=True,
        )
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "code": _code_version(),
        # The C kernels promise torch's bits; which path ran is recorded so a difference can be placed.
        "c_kernels": sorted({json.dumps(r["c_kernels"], sort_keys=True) for r in runs.values()}),
        "seconds": round(time.monotonic() - started, 1),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    code = result["code"]
    table = "\n".join(
        [
            f"# Parity: {len(runs)} cases, {result['seconds']:.0f} s",
            "",
            f"command: `{result['command']}`; code: {code['commit'][:12]} (src tree {code['src_tree'][:12]}"
            f"{', src modified' if code['src_dirty'] else ''}), "
            f"torch {code['torch']}, C kernels (as the ranks saw them): {', '.join(result['c_kernels'])}",
            "",
            _table(runs),
            "",
        ]
    )
    args.out.with_suffix(".md").write_text(table)
    print(table)
    if args.compare is not None:
        diffs = _compare(runs, json.loads(args.compare.read_text()))
        if diffs:
            print(f"DIFFERENT from {args.compare}:\n" + "\n".join(diffs), file=sys.stderr)
            sys.exit(1)
        print(f"bit for bit the same as {args.compare} ({len(runs)} cases)")


if __name__ == "__main__":
    main()
