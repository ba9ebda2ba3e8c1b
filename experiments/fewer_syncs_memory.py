"""Memory per rank of ``sync_every`` against torch DDP, measured (issue 59: "the memory it costs ... measured and
documented"), on Gloo loopback: 2 ranks flat, or ``--layout 2x2`` (4 ranks as 2 nodes of 2, dense inside a node).

    python experiments/fewer_syncs_memory.py --size 512x4 --repeats 3 --out benchmarks/diloco_memory

Each (kind, repeat) runs in fresh processes: the transformer of the quality bench (``--size`` d_model x layers),
AdamW, ``--steps`` steps on random tokens, ``sync_every=--every`` (the memory does not depend on H; the steps
cover two syncs of every fragment).  A rank's figures are its resident set minus its resident set just before the
model was built: ``peak`` sampled every 2 ms during the steps (``bench.bench_memory.PeakRss``: the forward's
activations, the gradients, AdamW's state, a sync's transient tensors) and ``after`` the last step (what stays
between steps).  The processes start with ``MALLOC_MMAP_THRESHOLD_=131072`` (as the step-time bench's workers
build their modes): every tensor over 128 KiB is mapped and unmapped with its life, so the resident set follows
the live tensors.  Medians over repeats of the largest rank's figure are compared with torch DDP's, beside the
outer loop's own count of what it holds (``comm_stats()['outer_state_bytes']``: exact, from the tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

KINDS: dict[str, dict[str, Any]] = {
    "torch": {},  # torch DDP: the reference
    "defaults": {},  # averaged through 3 bits
    "fp32": {"outer_compression": "none"},
    "diloco": {"outer_lr": 0.7, "outer_momentum": 0.9},  # the outer momentum: 4 bytes a parameter more
    "indexed-topk-2bit": {"outer_compression": "indexed-topk-2bit"},
    "streaming": {"sync_fragments": 4, "sync_delay": 2},  # a quarter of the model in flight at a time
}
"""torch DDP, then ``gradientflow.DistributedDataParallel(sync_every=--every, **options)``."""
BATCH, SEQ, VOCAB = 8, 64, 96


def _worker(
    rank: int, world: int, store: str, kind: str, layout: str, size: tuple[int, int], every: int, steps: int, results
) -> None:
    import torch.distributed as dist

    import gradientflow as gf
    from gradientflow.bench.bench_memory import PeakRss, rss_mb
    from gradientflow.bench.models import tiny_transformer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]
    before = rss_mb()
    torch.manual_seed(0)
    net = tiny_transformer(VOCAB, d_model=size[0], n_layers=size[1], seq_len=SEQ)
    params = sum(p.numel() for p in net.parameters())
    if kind == "torch":
        model: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(net)
    else:
        model = gf.DistributedDataParallel(net, sync_every=every, topology=layout, **KINDS[kind])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with PeakRss() as sampled:
        for seq in batches:
            x, y = seq[:, :-1], seq[:, 1:]
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
    after = rss_mb()
    held = 0 if kind == "torch" else model.comm_stats()["outer_state_bytes"]  # type: ignore[operator]
    mine = {"peak_mb": sampled.peak - before, "after_mb": after - before, "state_bytes": held, "params": params}
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, mine)
    if rank == 0:
        results.put(every_rank)
    dist.barrier()
    dist.destroy_process_group()


def _launch(kind: str, layout: str, size: tuple[int, int], every: int, steps: int) -> list[dict]:
    world = 2 if layout == "flat" else 4
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        args = (world, store, kind, layout, size, every, steps, results)
        procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        out = results.get(timeout=900)
        for p in procs:
            p.join()
    return out


def table(runs: dict[str, list[list[dict]]], command: str, layout: str, size: str, every: int, steps: int) -> str:
    """The markdown table of ``runs`` (per kind, per launch, per rank)."""

    def med(kind: str, key: str) -> float:
        return statistics.median(max(r[key] for r in launch) for launch in runs[kind])

    params = runs["torch"][0][0]["params"]
    model_mb = 4 * params / 2**20
    lines = [
        f"# Memory per rank, `sync_every={every}` against torch DDP, {layout} on Gloo loopback, transformer {size} "
        f"({params:,} parameters), AdamW, {steps} steps",
        "",
        f"command: `{command}`",
        "",
        f"One fp32 copy of the model: {model_mb:.1f} MiB. Resident set added since before the model was built, "
        f"median over {len(runs['torch'])} launches of the largest rank's.",
        "",
        "| kind | after the steps MiB | above torch DDP | in fp32 copies | peak MiB | above torch DDP | "
        "outer state MiB (exact) | in fp32 copies |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in runs:
        after, peak = med(kind, "after_mb"), med(kind, "peak_mb")
        d_after, d_peak = after - med("torch", "after_mb"), peak - med("torch", "peak_mb")
        held = max(r["state_bytes"] for r in runs[kind][0]) / 2**20
        label = "torch DDP" if kind == "torch" else f"`{kind}` {KINDS[kind] or ''}".rstrip()
        lines.append(
            f"| {label} | {after:.1f} | {d_after:+.1f} | {d_after / model_mb:+.2f} | {peak:.1f} | {d_peak:+.1f} | "
            f"{held:.1f} | {held / model_mb:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="512x4", help="d_model x layers (default 512x4: 12.7M parameters)")
    parser.add_argument("--layout", default="flat", choices=["flat", "2x2"])
    parser.add_argument("--every", type=int, default=8, help="sync_every (default 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS), help="default: all of them")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    kinds = ["torch", *(k for k in args.kinds if k != "torch")]  # torch DDP: the reference
    d, layers = (int(v) for v in args.size.split("x"))
    steps = 2 * args.every + 2  # two syncs of every fragment, streaming's last merge included
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # read by each spawned rank's malloc at its start (see above)
    runs: dict[str, list[list[dict]]] = {k: [] for k in kinds}
    for _ in range(args.repeats):  # kinds interleaved: a slow phase of the machine hits them alike
        for kind in kinds:
            runs[kind].append(_launch(kind, args.layout, (d, layers), args.every, steps))
    command = " ".join([Path(sys.executable).name, *(sys.argv if argv is None else ["fewer_syncs_memory.py", *argv])])
    (args.out / "results.json").write_text(json.dumps({"command": command, "runs": runs}, indent=1))
    text = table(runs, command, args.layout, args.size, args.every, steps)
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
