"""Peak memory per rank of torch's HSDP against ``gradientflow.fsdp.fully_shard``'s recipes, 2 nodes x 2 ranks on
Gloo loopback (issue 58: "peak above torch HSDP's at most one fp32 shard per rank for the 3-bit recipe"; issue 72:
fewer syncs, "memory per rank above torch's HSDP: at most the anchor's and the momentum's shards").

    python experiments/fsdp_memory.py --size 512x4 --steps 6 --repeats 3 --out benchmarks/fsdp_memory
    python experiments/fsdp_memory.py --size 256x4 --steps 4 --repeats 3 --kinds outer outer-nesterov \
        --out benchmarks/fsdp_memory_outer

Each (kind, repeat) runs in 4 fresh processes: the transformer of the quality bench (``--size`` d_model x layers)
sharded per block and at the root, AdamW, ``--steps`` steps on random tokens.  A rank's figure is its peak resident
set during the training steps (sampled every 2 ms: ``bench.bench_memory.PeakRss``) minus its resident set just
before the model was built: what the shards, gradients, AdamW's state, the all-gathers, the activations and the
recipe's state and buffers hold at the step's peak.  The processes start with ``MALLOC_MMAP_THRESHOLD_=131072``
(as the step-time bench's workers build their modes): every tensor over 128 KiB is mapped and unmapped with its
life, so the resident set follows the live tensors and the unsharded model built before sharding leaves nothing
behind.  The
medians over repeats of the largest rank's figure are compared; the recipe's state is also counted exactly
(``comm_stats()['state_bytes']``, plus ``outer_state_bytes`` for fewer syncs) beside one fp32 shard of the model
(its parameters over the ranks of a node).

The fewer-syncs kinds: ``fully_shard(..., sync_every=2)`` with the defaults (``"outer"``: averaging through the 3-bit
exchange: the anchor and the residual) and DiLoCo's Nesterov (``"outer-nesterov"``: ``outer_lr=0.7``,
``outer_momentum=0.9``, 3-bit: the anchor, the momentum and the residual); the steps include ``steps // 2`` syncs.
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

import torch
import torch.multiprocessing as mp

KINDS = ("torch", "none", "3bit", "3bit-precond", "topk-3bit", "outer", "outer-nesterov")
"""torch's HSDP (fp32 reduce), then gradientflow's recipes, then fewer syncs (sync_every=2)."""
OUTER = {"outer": {"sync_every": 2}, "outer-nesterov": {"sync_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}}
"""The fewer-syncs kinds' options."""
BATCH, SEQ, VOCAB = 8, 64, 96


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, world: int, store: str, kind: str, size: tuple[int, int], steps: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import gradientflow.fsdp as gf
    from gradientflow.bench.bench_memory import PeakRss
    from gradientflow.bench.models import tiny_transformer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]
    before = _rss_mb()
    torch.manual_seed(0)
    net = tiny_transformer(VOCAB, d_model=size[0], n_layers=size[1], seq_len=SEQ)
    params = sum(p.numel() for p in net.parameters())
    for block in [*net.layers, net]:
        if kind == "torch":
            torch_fully_shard(block, mesh=mesh)
        elif kind in OUTER:
            gf.fully_shard(block, mesh=mesh, **OUTER[kind])
        else:
            gf.fully_shard(block, mesh=mesh, compression=kind, **({"warmup_steps": 0} if "topk" in kind else {}))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with PeakRss() as sampled:
        for seq in batches:
            x, y = seq[:, :-1], seq[:, 1:]
            torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
    peak = sampled.peak
    stats = {} if kind == "torch" else gf.comm_stats(net)
    state = stats.get("state_bytes", 0) + stats.get("outer_state_bytes", 0)
    shard = stats.get("dense_bytes", 0)
    mine = {"added_mb": peak - before, "state_bytes": state, "shard_bytes": shard, "params": params}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        results.put(every)
    dist.barrier()
    dist.destroy_process_group()


def _launch(kind: str, size: tuple[int, int], steps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, 4, store, kind, size, steps, results)) for r in range(4)]
        for p in procs:
            p.start()
        out = results.get(timeout=900)
        for p in procs:
            p.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512x4", help="d_model x layers (default 512x4: 12.7M parameters)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="default: all of them")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    kinds = ["torch", *(k for k in args.kinds if k != "torch")]  # torch's HSDP: the reference
    d, layers = (int(v) for v in args.size.split("x"))
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # read by each spawned rank's malloc at its start (see above)
    runs: dict[str, list[list[dict]]] = {k: [] for k in kinds}
    for _ in range(args.repeats):  # kinds interleaved: a slow phase of the machine hits them alike
        for kind in kinds:
            runs[kind].append(_launch(kind, (d, layers), args.steps))
    command = " ".join([Path(sys.executable).name, *sys.argv])
    (args.out / "results.json").write_text(json.dumps({"command": command, "runs": runs}, indent=1))
    peak = {k: statistics.median(max(r["added_mb"] for r in launch) for launch in runs[k]) for k in kinds}
    shard_mb = 4 * -(-runs["torch"][0][0]["params"] // 2) / 2**20  # padding per parameter aside
    lines = [
        f"# Peak memory per rank, HSDP 2 x 2 on Gloo loopback, transformer {args.size} "
        f"({runs['torch'][0][0]['params']:,} parameters), AdamW, {args.steps} steps",
        "",
        f"command: `{command}`",
        "",
        f"One fp32 shard of the model per rank: {shard_mb:.1f} MiB (the parameters over the 2 ranks of a node).",
        "",
        "| kind | peak added MiB (median of the largest rank, "
        f"{args.repeats} launches) | above torch HSDP MiB | in fp32 shards | recipe and outer state MiB (exact) | "
        "each launch |",
        "|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        above = peak[kind] - peak["torch"]
        state = max(r["state_bytes"] for r in runs[kind][0]) / 2**20
        label = "torch HSDP (fp32 reduce)" if kind == "torch" else f"gradientflow `{kind}`"
        if kind in OUTER:
            label = "gradientflow " + ", ".join(f"`{k}={v}`" for k, v in OUTER[kind].items())
        each = ", ".join(f"{max(r['added_mb'] for r in launch):.0f}" for launch in runs[kind])
        lines.append(f"| {label} | {peak[kind]:.1f} | {above:+.1f} | {above / shard_mb:+.2f} | {state:.1f} | {each} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
