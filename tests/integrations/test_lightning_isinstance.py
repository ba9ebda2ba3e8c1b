"""Lightning's own ``test_ddp_configure_ddp`` check with gradientflow's strategy (issue 38, item 20): after
``strategy.setup`` the model is an instance of torch's ``DistributedDataParallel`` (it was the one test of
Lightning's DDP suite that failed with gradientflow substituted, of all that run on CPU), and Lightning's
isinstance-based paths (state dicts, ``no_backward_sync``) see it as torch DDP."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

pl = pytest.importorskip("pytorch_lightning")

from _dist import run_distributed  # noqa: E402


class Boring(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _worker(rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", WORLD_SIZE=str(world), NODE_RANK="0")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # Lightning joins the group _dist made
    from pytorch_lightning.trainer.states import TrainerFn  # noqa: PLC0415

    import gradientflow  # noqa: PLC0415

    model = Boring()
    trainer = pl.Trainer(
        max_epochs=1, strategy="gradientflow", accelerator="cpu", devices=world, logger=False, enable_progress_bar=False
    )
    # as Lightning's test_ddp_configure_ddp: wrap the model if fitting
    trainer.state.fn = TrainerFn.FITTING
    trainer.strategy.connect(model)
    trainer.lightning_module.trainer = trainer
    trainer.strategy.setup_environment()
    assert isinstance(trainer.model, pl.LightningModule)
    trainer.strategy.setup(trainer)
    assert isinstance(trainer.model, DistributedDataParallel)
    assert isinstance(trainer.model, gradientflow.DistributedDataParallel)
    # Lightning's unwrapping by isinstance: the LightningModule's own keys, no `module.` prefix
    assert list(trainer.strategy.lightning_module.state_dict()) == ["layer.weight", "layer.bias"]
    unwrapped = trainer.model.module if isinstance(trainer.model, DistributedDataParallel) else trainer.model
    assert not any(k.startswith("module.") for k in unwrapped.state_dict())
    trainer.strategy.teardown()
    assert isinstance(trainer.strategy.model, pl.LightningModule)  # unwrapped at teardown, as DDPStrategy does


def test_lightning_sees_a_ddp() -> None:
    run_distributed(_worker, 2, timeout=180)
