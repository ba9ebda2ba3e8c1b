"""A Lightning training script as the tutorials write it; gradientflow is the strategy name.

    python examples/train_lightning.py --strategy gradientflow     # Lightning launches 2 processes
    python examples/train_lightning.py --strategy ddp              # the same script on torch DDP

The one line that differs from the stock script is ``strategy=``: ``"ddp"`` there, ``"gradientflow"``
here (``import gradientflow`` registers the name; ``GradientFlowStrategy(density=0.1)`` takes
gradientflow's options).  A small MLP on scikit-learn's handwritten digits (shipped with it, no
download), 2 CPU processes; ``trainer.save_checkpoint`` / ``--resume`` carry every rank's
communication state inside Lightning's own checkpoint.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradientflow  # noqa: F401 — registers Trainer(strategy="gradientflow")
from gradientflow.integrations.lightning import GradientFlowStrategy


class DigitsMLP(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def digits_loader(batch_size: int) -> DataLoader:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.int64))
    return DataLoader(data, batch_size=batch_size, shuffle=True)  # Lightning adds the DistributedSampler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="gradientflow", help="gradientflow | ddp | gradientflow-sparse")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--checkpoint", default=None, help="save here at the end (trainer.save_checkpoint)")
    p.add_argument("--resume", default=None, help="resume from this checkpoint (fit(ckpt_path=...))")
    args = p.parse_args()
    strategy = args.strategy
    if strategy == "gradientflow-sparse":  # gradientflow's options: the strategy object instead of its name
        strategy = GradientFlowStrategy(comm_dtype="fp16", density=0.1)
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(DigitsMLP(), digits_loader(args.batch_size), ckpt_path=args.resume)
    if args.checkpoint:
        trainer.save_checkpoint(args.checkpoint)
    if trainer.is_global_zero:
        print(f"final train loss {trainer.callback_metrics['train_loss'].item():.6f} after {trainer.global_step} steps")


if __name__ == "__main__":
    main()
