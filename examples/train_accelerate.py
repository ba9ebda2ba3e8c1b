"""An accelerate training script as its examples write it; gradientflow is one constructor away.

    accelerate launch --cpu --num_processes 2 examples/train_accelerate.py
    torchrun --nproc-per-node 2 examples/train_accelerate.py --backend torch     # stock Accelerator

The one change from the stock script: ``Accelerator(...)`` becomes ``GradientFlowAccelerator(...)``
(gradientflow's options, e.g. ``density=0.1``, as extra keyword arguments).  A small MLP on
scikit-learn's handwritten digits, gradient accumulation through ``accelerator.accumulate``, and
``save_state`` / ``load_state`` (``--save-dir``, ``--resume``), which then carry every rank's
communication state.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradientflow.integrations.accelerate import GradientFlowAccelerator


def digits_loader(batch_size: int) -> DataLoader:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.int64))
    return DataLoader(data, batch_size=batch_size, shuffle=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["gradientflow", "torch"], default="gradientflow")
    p.add_argument("--density", type=float, default=None, help="gradientflow only: CSC density (default dense)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per process and micro-batch")
    p.add_argument("--save-dir", default=None, help="accelerator.save_state here at the end")
    p.add_argument("--resume", default=None, help="accelerator.load_state from here first")
    args = p.parse_args()

    if args.backend == "torch":
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    else:
        accelerator = GradientFlowAccelerator(cpu=True, gradient_accumulation_steps=2, density=args.density)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, digits_loader(args.batch_size))
    if args.resume:
        accelerator.load_state(args.resume)

    loss = torch.zeros(())
    for _ in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()

    if args.save_dir:
        accelerator.save_state(args.save_dir)
    final = accelerator.reduce(loss.detach(), reduction="mean")
    accelerator.print(f"final loss {final.item():.6f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
