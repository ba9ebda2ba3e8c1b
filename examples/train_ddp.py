"""A DDP training script as the tutorials write it; gradientflow is one import away.

    torchrun --nproc-per-node 2 examples/train_ddp.py --backend gradientflow
    torchrun --nproc-per-node 2 examples/train_ddp.py --backend torch          # the same script on torch DDP
    torchrun --nproc-per-node 2 examples/train_ddp.py --sync-every 10          # fewer syncs (docs/fewer-syncs.md)

It trains a small MLP on the 8x8 handwritten digits scikit-learn also ships (in gradientflow's package,
no download, no scikit-learn):
``DistributedSampler``, ``device_ids=[local_rank]`` on GPUs, a checkpoint of ``model.state_dict()``
and the optimizer written by rank 0 every ``--save-every`` steps (plus, with gradientflow, each rank's
``model.comm_state_dict()``: CSC residuals are per rank), and resume from it when it exists — so a
run restarted by ``torchrun --max-restarts 1`` continues where it stopped.  The only line that
differs between the two backends is the import; ``--compression`` / ``--density`` / ``--comm-dtype`` /
``--sync-every`` add gradientflow's own options, and without them the constructor call is torch DDP's.  Two lines
are there for torch, not for gradientflow, and serve both backends: the ``PrefixStore`` around torchrun's store (a
restarted attempt under Gloo on torch 2.13) and the early ``import torch.distributed.nn`` (a clean exit); their
comments say why.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 — before init_process_group: see the end of main()
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gradientflow.bench.data import load_digits  # the digits data, shipped with gradientflow


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["torch", "gradientflow"], default="gradientflow")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--density", type=float, default=None, help="gradientflow only: CSC density (default dense)")
    p.add_argument("--comm-dtype", default=None, help="gradientflow only: fp32 (default) | fp16 | bf16")
    p.add_argument(
        "--compression",
        default=None,
        help='gradientflow only: a recipe (docs/recipes.md), e.g. auto (the recommended one) (default "none")',
    )
    p.add_argument(
        "--sync-every",
        type=int,
        default=None,
        help="gradientflow only: H, the replicas averaged every H steps, nothing sent between (default 1: every step)",
    )
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="save and resume here")
    p.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument(
        "--die-at-step",
        type=int,
        default=None,
        help="testing restarts: rank 1 exits abruptly at this step in the first attempt",
    )
    p.add_argument("--out", type=Path, default=None, help="rank 0 writes final loss and parameters here (json)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.backend == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        from gradientflow import DistributedDataParallel as DDP

    use_cuda = torch.cuda.is_available()
    # torchrun's store outlives a restart (--max-restarts): the restarted workers would read the dead
    # ones' addresses from it and fail to connect (seen with Gloo on torch 2.13, with either backend: torch
    # 2.13's env:// rendezvous no longer prefixes its keys per attempt, and init_process_group runs before
    # any DDP).  A prefix per attempt keeps each attempt's keys apart; without restarts this is plain
    # init_process_group().
    store, _, _ = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    x, y = load_digits()  # [1797, 64] pixels in [0, 1], labels 0..9
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    # gradientflow's own options, only where a flag asks for one: its defaults synchronise as torch DDP does.
    flags = {"compression": args.compression, "density": args.density, "comm_dtype": args.comm_dtype}
    flags["sync_every"] = args.sync_every
    options = flags if args.backend == "gradientflow" else {}
    extra = {k: v for k, v in options.items() if v is not None}
    model = DDP(model, device_ids=[local_rank] if use_cuda else None, **extra)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step, start_epoch = 0, 0
    ckpt = args.checkpoint_dir / "checkpoint.pt" if args.checkpoint_dir else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        if args.backend == "gradientflow":
            comm_file = args.checkpoint_dir / f"comm_step{step}_rank{rank}.pt"
            comm = torch.load(comm_file, map_location=device, weights_only=True)
            model.load_comm_state_dict(comm)
        if rank == 0:
            print(f"resumed from step {step}", flush=True)

    steps_per_epoch = len(loader)
    start_epoch = step // steps_per_epoch
    loss = torch.zeros(())
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for i, (xb, yb) in enumerate(loader):
            if epoch * steps_per_epoch + i < step:
                continue  # already trained before the restart
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            if ckpt is not None and step % args.save_every == 0:
                save_checkpoint(args, model, optimizer, step, rank)
            if args.die_at_step == step and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os._exit(17)  # a worker dies without a word, as a lost node would

    # The mean loss of the last batch over all ranks, the figure both backends must agree on.
    final = loss.detach().clone()
    dist.all_reduce(final)
    stats = model.comm_stats(total=True) if args.backend == "gradientflow" else None  # the run's bytes
    if rank == 0:
        print(f"final loss {final.item() / world:.6f} after {step} steps", flush=True)
        if args.out is not None:
            params = {n: p.detach().cpu().flatten().tolist() for n, p in model.module.named_parameters()}
            result = {"loss": final.item() / world, "steps": step, "params": params, "comm_stats": stats}
            args.out.write_text(json.dumps(result))
    # Release what holds the process group (the wrapper) and destroy it while Python is whole: a
    # group left to interpreter shutdown aborted ~1 run in 10 here ("terminate called without an
    # active exception": a Gloo worker thread, dropping the last allreduce's tensor, needs the GIL of
    # an interpreter that is finalizing).  Two things used to keep the group alive past
    # destroy_process_group(): gradientflow's hooks (now weak) and torch.distributed.nn, which torch
    # DDP imports on first use and whose functions take the default group as a default argument
    # when imported after init_process_group; hence its import at the top (for --backend torch:
    # gradientflow never imports it, and destroys the groups left at exit itself).
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


def save_checkpoint(
    args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int
) -> None:
    """Rank 0 writes model + optimizer; with gradientflow every rank writes its communication state.

    Files are written to a temporary name and renamed, so a worker killed mid-write never
    leaves a truncated checkpoint behind.  Communication states carry their step in the file
    name and the model checkpoint (written after every rank's) names the step to resume from.
    """
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if args.backend == "gradientflow":
        tmp = args.checkpoint_dir / f".comm_rank{rank}.pt.tmp"
        torch.save(model.comm_state_dict(), tmp)
        os.replace(tmp, args.checkpoint_dir / f"comm_step{step}_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        tmp = args.checkpoint_dir / ".checkpoint.pt.tmp"
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "time": time.time()}, tmp
        )
        os.replace(tmp, args.checkpoint_dir / "checkpoint.pt")
    dist.barrier()
    old = args.checkpoint_dir / f"comm_step{step - args.save_every}_rank{rank}.pt"
    old.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
