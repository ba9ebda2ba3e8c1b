"""Lightning: ``Trainer(strategy="gradientflow")`` against Lightning's own ``"ddp"`` (torch DDP), 2 Gloo ranks.

Every scenario trains the same seeded model on the same data twice, once per strategy, in one pair
of spawned processes (Lightning's import and its Trainer set-up dominate the cost, so they are paid
once); each test then reads its scenario's result.  Parity is exact: with its defaults gradientflow
sums the same two fp32 values per gradient element as torch DDP, divided by the same world size.
"""

from __future__ import annotations

import gc
import os
import tempfile
import warnings
import weakref

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

from _dist import run_distributed  # noqa: E402

WORLD = 2
SAMPLES, FEATURES, CLASSES, BATCH = 64, 12, 4, 8  # 4 steps per epoch per rank


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :CLASSES] * 3).argmax(1))


class Net(pl.LightningModule):
    """An MLP trained with SGD momentum; options select the Lightning features under test."""

    def __init__(self, batchnorm: bool = False, manual: bool = False, adam: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = [nn.BatchNorm1d(32)] if batchnorm else []
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), *norm, nn.ReLU(), nn.Linear(32, CLASSES))
        self.automatic_optimization = not manual
        self.adam = adam
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        return None

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        x, y = batch
        self.val_losses.append(nn.functional.cross_entropy(self(x), y).item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.adam:
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(_data(), batch_size=BATCH)


def _trainer(strategy: object, **kwargs: object) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=WORLD, logger=False, enable_checkpointing=False)
    options.update(enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, max_epochs=2)
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


def _fit(strategy: object, model: Net | None = None, ckpt_path: str | None = None, **kwargs: object):
    pl.seed_everything(0, verbose=False)
    model = model or Net()
    trainer = _trainer(strategy, **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _post_hooks(model: nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def _scenarios(rank: int, world: int, tmp: str) -> dict[str, object]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", WORLD_SIZE=str(world), NODE_RANK="0")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # Lightning joins the group _dist made
    import gradientflow  # noqa: F401 — registers "gradientflow" with Lightning, nothing else
    from gradientflow.integrations.lightning import GradientFlowStrategy

    out: dict[str, object] = {}
    features = {
        "defaults": ({}, {}),
        "accumulate_clip": ({}, dict(accumulate_grad_batches=2, gradient_clip_val=0.5)),
        "manual": (dict(manual=True), {}),
        "batchnorm": (dict(batchnorm=True), {}),
        "batchnorm_val": (dict(batchnorm=True), dict(limit_val_batches=None)),
    }
    for name, (net, trainer) in features.items():
        _, stock = _fit("ddp", Net(**net), **trainer)
        t, ours = _fit("gradientflow", Net(**net), **trainer)
        out[name] = _same(_params(stock), _params(ours)) and stock.val_losses == ours.val_losses
        out[name + "_steps"] = t.global_step
    # teardown: the wrapper gone, the LightningModule back in strategy.model, no hook left on it
    wrappers: list[weakref.ref] = []

    class KeepWrapper(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, module: Net) -> None:
            wrappers.append(weakref.ref(trainer.strategy.model))

    t_stock, stock = _fit("ddp", callbacks=[KeepWrapper()])
    t, ours = _fit("gradientflow", callbacks=[KeepWrapper()])
    gc.collect()
    out["teardown"] = (
        t.strategy.model is ours,
        t_stock.strategy.model is stock,
        _post_hooks(ours),
        _post_hooks(stock),
        type(t.strategy).__name__,
        [type(w()).__module__ if w() is not None else None for w in wrappers],
    )
    # fp16 + density 0.1: save after epoch 2 through trainer.save_checkpoint, resume with fit(ckpt_path)
    sparse = dict(comm_dtype="fp16", density=0.1, warmup_steps=2)
    _, whole = _fit(GradientFlowStrategy(**sparse), max_epochs=4)
    t_first, _ = _fit(GradientFlowStrategy(**sparse), max_epochs=2)
    path = os.path.join(tmp, "half.ckpt")
    t_first.save_checkpoint(path)
    _, resumed = _fit(GradientFlowStrategy(**sparse), ckpt_path=path, max_epochs=4)
    saved = torch.load(path, weights_only=True)
    if rank == 0:  # the same checkpoint without the sync state: the control showing it matters
        del saved["gradientflow"]
        torch.save(saved, os.path.join(tmp, "without.ckpt"))
    torch.distributed.barrier()
    _, without = _fit(GradientFlowStrategy(**sparse), ckpt_path=os.path.join(tmp, "without.ckpt"), max_epochs=4)
    out["resume"] = _same(_params(whole), _params(resumed))
    out["resume_without_state"] = _same(_params(whole), _params(without))
    out["ckpt_ranks"] = len(torch.load(path, weights_only=True)["gradientflow"]["comm_states"])
    # sync_every through the strategy: the outer loop inside Lightning's optimizer step, its state (an exchange in
    # flight too: H = 4, delay 2, the checkpoint right after step 8's sync started) in the checkpoint
    outer = dict(sync_every=4, sync_delay=2, outer_compression="none")
    stats: list[dict] = []

    class KeepStats(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, module: Net) -> None:
            stats.append(trainer.strategy.model.comm_stats(total=True))

    _, whole = _fit(GradientFlowStrategy(**outer), max_epochs=4, callbacks=[KeepStats()])
    t_first, _ = _fit(GradientFlowStrategy(**outer), max_epochs=2)
    path = os.path.join(tmp, "outer.ckpt")
    t_first.save_checkpoint(path)
    _, resumed = _fit(GradientFlowStrategy(**outer), ckpt_path=path, max_epochs=4)
    out["outer"] = (_same(_params(whole), _params(resumed)), stats[0]["sync_every"], stats[0]["outer_syncs"])
    # a warning raised inside Lightning's machinery names the user's line (here: this file's fit call)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(GradientFlowStrategy(density=0.1), Net(adam=True), max_epochs=1)
    out["warnings"] = [
        (os.path.basename(w.filename), str(w.message)[:60]) for w in caught if "gradientflow" in str(w.message)
    ]
    # a comm hook through DDPStrategy's ddp_comm_hook, against torch DDP running it (Lightning registers
    # hooks only on CUDA; the stock side forces it so that the oracle runs the hook too)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    class HookedDDP(pl.strategies.DDPStrategy):
        def _register_ddp_hooks(self) -> None:
            self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)

    _, ours = _fit(GradientFlowStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook))
    _, stock = _fit(HookedDDP())
    out["comm_hook"] = _same(_params(stock), _params(ours))
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(_scenarios, WORLD, tmp, timeout=240)


# batchnorm_val: torch DDP also broadcasts buffers at the first no-grad forward after a synchronised one
# (Lightning's validation goes through the wrapper), and so does gradientflow: rank 1 validates with rank
# 0's BatchNorm statistics, as under the stock strategy.
@pytest.mark.parametrize(
    "feature",
    [
        "defaults",
        "accumulate_clip",
        "manual",
        "batchnorm",
        "batchnorm_val",
    ],
)
def test_bit_identical_to_lightning_ddp(results, feature):
    """Same seed, same data: every parameter and buffer (and validation loss) equal to the "ddp" run's."""
    for r in results:
        assert r[feature] is True, feature
        assert r[feature + "_steps"] == (4 if feature == "accumulate_clip" else 8)  # 2 epochs x 4 (or 2) steps


def test_sparse_resume_from_lightning_checkpoint_is_the_uninterrupted_run(results):
    for r in results:
        assert r["ckpt_ranks"] == WORLD  # every rank's residuals are in rank 0's file
        assert r["resume"] is True
        assert r["resume_without_state"] is False  # dropping the sync state changes the run: the test has teeth


def test_sync_every_passes_through_and_resumes_from_lightning_checkpoint(results):
    """16 steps at H = 4, delay 2: syncs start after steps 4, 8, 12, 16 and are merged after 6, 10, 14 (3 counted);
    the run cut after step 8, its exchange in flight, resumes on the uninterrupted run's bits."""
    for r in results:
        assert r["outer"] == (True, 4, 3)


def test_teardown_leaves_the_module_as_ddp_strategy_does(results):
    for r in results:
        ours_unwrapped, stock_unwrapped, our_hooks, stock_hooks, name, alive = r["teardown"]
        assert alive == [None, None]  # both wrappers freed once fit returned
        assert ours_unwrapped and stock_unwrapped
        assert our_hooks == stock_hooks == 0
        assert name == "GradientFlowStrategy"  # Trainer(strategy="gradientflow") resolved to it


def test_warnings_name_the_users_line(results):
    for r in results:
        assert r["warnings"], "Adam at density 0.1 warns"
        assert {f for f, _ in r["warnings"]} == {"test_lightning.py"}


def test_comm_hook_matches_torch_ddp_running_it(results):
    assert all(r["comm_hook"] is True for r in results)
