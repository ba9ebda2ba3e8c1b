"""An FSDP2 (HSDP) training script as torch's tutorials write it; gradientflow is one import away.

    torchrun --nnodes 2 --nproc-per-node 4 ... examples/train_fsdp.py                     # 2 machines of 4 ranks
    # one machine as 2 nodes of 2 ranks: one torchrun per node, as on two machines
    for n in 0 1; do torchrun --nnodes 2 --node-rank $n --nproc-per-node 2 --master-addr 127.0.0.1 \
        --master-port 29500 examples/train_fsdp.py & done; wait                           # (--backend torch: torch's)

HSDP: the model is sharded inside each node (torch's reduce-scatter and all-gather, the fast link) and replicated
between nodes, where each gradient shard is averaged over the nodes: torch all-reduces it in fp32, gradientflow's
``fully_shard`` sends it by a recipe (``compression="auto"``, its default: dense at step 0, then ``"4bit"`` for SGD,
``"3bit"`` for AdamW on two nodes; docs/fsdp.md).  The only line that differs between the two backends is the
import of ``fully_shard``; ``--compression`` adds gradientflow's own option.  A small MLP on the 8x8 handwritten
digits shipped in gradientflow's package (no download), ``DistributedSampler`` over every rank (each rank its own
batch, as FSDP trains), the mesh ``(nodes, ranks per node)`` named ``("replicate", "shard")``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gradientflow.bench.data import load_digits  # the digits data, shipped with gradientflow


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["torch", "gradientflow"], default="gradientflow")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=None, help="default 0.05 (sgd, momentum 0.9) or 0.003 (adamw)")
    p.add_argument(
        "--compression",
        default=None,
        help='gradientflow only: the recipe between nodes (docs/recipes.md), e.g. "none" (torch\'s HSDP reduction) '
        '(default "auto")',
    )
    p.add_argument("--out", type=Path, default=None, help="rank 0 writes the final loss and comm_stats here (json)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.backend == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from gradientflow.fsdp import fully_shard

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # The 2-D mesh of torchrun's layout: between nodes first (replicate), inside a node second (shard); ranks
    # node-contiguous. (gradientflow refuses a mesh that contradicts the launch: its "nodes" would not be the
    # machines, and what it compresses would not be what crosses the link.)
    nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mesh = init_device_mesh(device.type, (nodes, world // nodes), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # every rank builds the same model; fully_shard keeps each rank's shard of it

    x, y = load_digits()  # [1797, 64] pixels in [0, 1], labels 0..9
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    model = model.to(device)
    # gradientflow's own option, only where a flag asks for it: otherwise the call is torch's.
    extra = {"compression": args.compression} if args.backend == "gradientflow" and args.compression else {}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **extra)  # each layer its own unit, as a transformer's blocks
    fully_shard(model, mesh=mesh, **extra)
    if args.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=args.lr or 0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or 0.003)

    step, loss = 0, torch.zeros((), device=device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"step {step}: loss {loss.item():.4f}", flush=True)

    final = loss.detach().clone()  # the mean loss of the last batch over every rank
    dist.all_reduce(final)
    stats = None
    if args.backend == "gradientflow":
        import gradientflow.fsdp

        # Between nodes, summed over every sharded module: the last step's, and the run's (total=True).
        stats = {"last": gradientflow.fsdp.comm_stats(model), "total": gradientflow.fsdp.comm_stats(model, total=True)}
    if rank == 0:
        print(
            f"final loss {final.item() / world:.6f} after {step} steps on a {nodes}x{world // nodes} mesh", flush=True
        )
        if stats is not None:
            last = stats["last"]
            print(
                f"between nodes, the last step: {last['compression']!r}, {last['payload_bytes']} bytes handed to the "
                f"exchange per rank ({last['payload_bytes'] / max(last['dense_bytes'], 1):.4f} of fp32's "
                f"{last['dense_bytes']})",
                flush=True,
            )
        if args.out is not None:
            args.out.write_text(json.dumps({"loss": final.item() / world, "steps": step, "comm_stats": stats}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
