"""HSDP 2 nodes x 2 ranks on Gloo loopback: bytes between nodes per step and final validation loss, torch's HSDP
against ``gradientflow.fsdp.fully_shard`` (issue 58).  docs/fsdp.md quotes what this writes.

    python experiments/fsdp_hsdp.py --steps 200 --seeds 0 1 2 --out benchmarks/fsdp_2x2

The transformer of the quality bench (``bench.models.tiny_transformer`` on Python's help topics, d_model 128,
2 layers, batch 8 x 64 characters a rank; AdamW lr 3e-3, or ``--optimizer sgd``: lr 0.3, momentum 0.9), each block
and the root sharded, the same batches and initial weights in both runs.  Bytes are counted, not timed: torch's HSDP
all-reduces each module's shard in ``reduce_dtype`` (fp32, or bf16: half), gradientflow's recipe reports what it
handed over (``comm_stats``).  Loopback on a shared 2-core CPU: step times here measure the CPU, not a link, and are
not reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

BATCH, SEQ, EVAL_WINDOWS = 8, 64, 32


def _data():
    from gradientflow.bench.data import char_vocab, encode, pydoc_topics_corpus

    train, val = pydoc_topics_corpus()
    vocab = char_vocab(train + val)
    return encode(train, vocab), encode(val, vocab), len(vocab)


def _windows(ids: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, ids.numel() - SEQ - 1, (n,), generator=g)
    x = torch.stack([ids[s : s + SEQ] for s in starts.tolist()])
    y = torch.stack([ids[s + 1 : s + SEQ + 1] for s in starts.tolist()])
    return x, y


def _run(kind: str, seed: int, steps: int, rank: int, mesh, data, optimizer: str) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import gradientflow.fsdp as gf
    from gradientflow.bench.models import tiny_transformer

    train, val, vocab = data
    torch.manual_seed(seed)
    net = tiny_transformer(vocab)
    for block in [*net.layers, net]:
        if kind == "torch":
            torch_fully_shard(block, mesh=mesh)
        else:
            gf.fully_shard(block, mesh=mesh, compression=kind)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.9)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(10_000 * seed + rank)  # this rank's batches: the same in every run
    per_step = None
    for step in range(steps):
        x, y = _windows(train, BATCH, g)
        loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if kind != "torch" and step == steps - 1:
            per_step = gf.comm_stats(net)
    vx, vy = _windows(val, EVAL_WINDOWS, torch.Generator().manual_seed(7))
    with torch.no_grad():
        val_loss = torch.nn.functional.cross_entropy(net(vx).flatten(0, 1), vy.flatten()).item()
    params = sum(p.numel() for p in net.parameters())
    return {"kind": kind, "seed": seed, "val_loss": val_loss, "last_step": per_step, "params": params}


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    data = _data()
    out = []
    for seed in args.seeds:
        for kind in args.kinds:
            out.append(_run(kind, seed, args.steps, rank, mesh, data, args.optimizer))
            if rank == 0:  # each run as it ends: a long launch's finished runs survive it
                with open(args.out / "runs.jsonl", "a") as f:
                    f.write(json.dumps(out[-1]) + "\n")
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=["torch", "auto"],
        help="torch (its HSDP, fp32 reduce) and gradientflow recipes, e.g. auto topk-3bit (default: torch auto)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, 4, store, args, results)) for r in range(4)]
        for p in procs:
            p.start()
        runs = results.get()
        for p in procs:
            p.join()
    summary = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "runs": runs}
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    ours = [k for k in args.kinds if k != "torch"]
    last = {k: next(r["last_step"] for r in runs if r["kind"] == k) for k in ours}
    first = last[ours[0]]
    lines = [
        f"# HSDP 2x2 loopback, the transformer ({runs[0]['params']} parameters), {args.optimizer}, {args.steps} steps",
        "",
        f"command: `{summary['command']}`",
        "",
        "## Bytes between nodes per optimizer step, per rank (the last step)",
        "",
        "| reduction | handed to the exchange | sent on the link (ring count) | x torch fp32 (sent) |",
        "|---|---|---|---|",
        f"| torch HSDP, fp32 reduce | {first['dense_bytes']} | {first['dense_sent_bytes']} | 1 |",
        f"| torch HSDP, bf16 reduce | {first['dense_bytes'] // 2} | {first['dense_sent_bytes'] // 2} | 0.5 |",
    ]
    for k in ours:
        one = last[k]
        lines.append(
            f"| gradientflow `{k}` -> `{one['compression']}` | {one['payload_bytes']} | {one['sent_bytes']} | "
            f"{one['sent_bytes'] / one['dense_sent_bytes']:.4f} |"
        )
    lines += [
        "",
        "Recipe state kept per rank (residuals): "
        + ", ".join(f"`{k}` {last[k]['state_bytes']} bytes" for k in ours)
        + f"; one fp32 shard of the model: {first['dense_bytes']} bytes.",
        "",
        "## Final validation loss (32 windows of 64 characters)",
        "",
    ]
    lines.append("| seed | torch HSDP fp32 | " + " | ".join(f"`{k}` (ratio)" for k in ours) + " |")
    lines.append("|---|---|" + "---|" * len(ours))
    for seed in args.seeds:
        t = next(r["val_loss"] for r in runs if r["seed"] == seed and r["kind"] == "torch")
        cells = []
        for k in ours:
            a = next(r["val_loss"] for r in runs if r["seed"] == seed and r["kind"] == k)
            cells.append(f"{a:.4f} ({a / t:.4f})")
        lines.append(f"| {seed} | {t:.4f} | " + " | ".join(cells) + " |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
