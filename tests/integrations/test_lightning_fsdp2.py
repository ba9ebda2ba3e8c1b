"""Lightning's FSDP2 path (``ModelParallelStrategy``, ``configure_model``) as HSDP on 2 nodes x 2 ranks (4 Gloo ranks),
gradientflow's ``fully_shard`` through :class:`GradientFlowHSDPStrategy` against Lightning's own strategy with torch's
``fully_shard`` on the same HSDP mesh.

Lightning runs its FSDP2 strategy on CPU as it is (``accelerator="cpu"``: its mesh on ``"cpu"``, Gloo): nothing is set
here that Lightning does not set itself.  The ranks carry torchrun's variables (tests/_dist.py) and ``NODE_RANK``,
so Lightning's environment sees the launch it would see on 2 nodes and joins the process group already made.
Every scenario runs in one spawn of the 4 ranks; each test reads its part.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

from _dist import run_distributed  # noqa: E402

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
SAMPLES, IN, HIDDEN, OUT, BATCH = 64, 6, 10, 3, 4  # 16 samples a rank: 4 steps an epoch
EPOCHS = 2
# each unit's shard on a rank: every parameter's rows split over the node's 2 ranks, rounded up (torch pads dim 0)
SHARD_NUMELS = [5 * IN + 5, 5 * HIDDEN + 5, 2 * HIDDEN + 2]


class Net(pl.LightningModule):
    """An MLP sharded per Linear layer and at the root in ``configure_model``, by ``shard(module, mesh=...)``; AdamW.

    ``mesh=None``: the strategy's ``self.device_mesh``; else that callable's mesh (Lightning's own strategy, whose
    mesh is not HSDP's)."""

    def __init__(self, shard, mesh=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.model.append(nn.Linear(HIDDEN, OUT))
        self.shard, self.mesh = shard, mesh
        self.losses: list[float] = []
        self.seen: list[int] = []  # the samples this rank trained on

    def configure_model(self) -> None:
        mesh = self.device_mesh if self.mesh is None else self.mesh(self.trainer)
        for block in (self.model[0], self.model[2], self.model[4]):
            self.shard(block, mesh=mesh)
        self.shard(self.model, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
        x, y, index = batch
        self.seen += index.tolist()
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        x = torch.randn(SAMPLES, IN, generator=torch.Generator().manual_seed(1))
        data = torch.utils.data.TensorDataset(x, x[:, :OUT].argmax(1), torch.arange(SAMPLES))
        return torch.utils.data.DataLoader(data, batch_size=BATCH)  # Lightning adds its DistributedSampler


def _fit(strategy, model: Net, epochs: int = EPOCHS, ckpt_path: str | None = None, **kwargs) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    options = dict(accelerator="cpu", devices=PER_NODE, num_nodes=NODES, max_epochs=epochs, logger=False)
    options.update(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)
    trainer = pl.Trainer(strategy=strategy, **options)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def _params(model: nn.Module) -> list[list[float]]:
    return [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]  # floats: compared exactly


def _scenarios(rank: int, world: int, tmp: str) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", NODE_RANK=str(rank // PER_NODE))
    from pytorch_lightning.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import gradientflow.fsdp as gf
    from gradientflow.integrations.lightning_fsdp import GradientFlowHSDPStrategy

    def ours(compression: str):
        return lambda module, **kw: gf.fully_shard(module, compression=compression, **kw)

    def hsdp(trainer: pl.Trainer):  # the mesh a user builds under Lightning's own strategy
        return gf.hsdp_mesh(trainer.num_nodes, trainer.num_devices)

    def lightnings() -> ModelParallelStrategy:  # every rank its own data: the data-parallel dimension is the world
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)

    out: dict = {}
    # Lightning's strategy with its default sizes (num_nodes, devices), one step: which samples each rank reads
    default = Net(torch_fully_shard, hsdp)
    _fit(ModelParallelStrategy(), default, max_steps=1)
    out["default_seen"] = default.seen
    # torch's HSDP through Lightning's strategy, the user's mesh; gradientflow's through GradientFlowHSDPStrategy
    runs = {"torch": (lightnings(), Net(torch_fully_shard, hsdp))}
    runs.update({c: (GradientFlowHSDPStrategy(), Net(ours(c))) for c in ("none", "3bit")})
    for name, (strategy, model) in runs.items():
        trainer = _fit(strategy, model)
        out[name] = {"losses": model.losses, "seen": model.seen, "params": _params(model)}
        out[name]["mesh"] = (tuple(model.device_mesh.shape), model.device_mesh.mesh_dim_names)
        if name != "torch":
            out[name]["stats"] = gf.comm_stats(model, total=True)
    # the exact resume: 1 epoch, Lightning's checkpoint, a new Trainer resumes to EPOCHS
    path = os.path.join(tmp, "ckpt")
    first = Net(ours("3bit"))
    trainer = _fit(GradientFlowHSDPStrategy(), first, epochs=1)
    trainer.save_checkpoint(path)
    out["files"] = sorted(os.listdir(path))
    resumed = Net(ours("3bit"))
    _fit(GradientFlowHSDPStrategy(), resumed, ckpt_path=path)
    out["resumed"] = {"losses": first.losses + resumed.losses, "params": _params(resumed)}
    # Lightning's own checkpoint (its strategy): the recipe state does not travel, and gradientflow says so
    plain = os.path.join(tmp, "plain")
    trainer.save_checkpoint(plain)  # the same state as `path`...
    trainer.strategy.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(plain, "gradientflow"))  # ...less the recipe state: what Lightning's own saves
    trainer.strategy.barrier()
    again = Net(ours("3bit"), hsdp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(lightnings(), again, ckpt_path=plain)
    out["lightnings"] = {
        "params": _params(again),
        "warned": [str(w.message) for w in caught if "gradientflow" in str(w.message)],
    }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("lightning_fsdp2"))
    return run_distributed(_scenarios, WORLD, tmp, timeout=300, ranks_per_node=PER_NODE)


def test_the_ranks_of_a_node_read_the_same_batches_under_lightnings_default_sizes(results: list[dict]) -> None:
    # ModelParallelStrategy()'s mesh is (num_nodes, devices) = ("data_parallel", "tensor_parallel"), its sampler split
    # over "data_parallel" (the nodes): right for tensor parallelism, half the data read twice under HSDP
    for node in range(NODES):
        a, b = (results[node * PER_NODE + local]["default_seen"] for local in range(PER_NODE))
        assert a == b and len(a) == BATCH
    assert results[0]["default_seen"] != results[PER_NODE]["default_seen"]


def test_every_rank_reads_its_own_data_on_the_hsdp_mesh(results: list[dict]) -> None:
    for name in ("torch", "none", "3bit"):
        seen = [r[name]["seen"] for r in results]
        for epoch in range(EPOCHS):  # each epoch the 4 ranks read the 64 samples once between them
            per_epoch = [s[epoch * SAMPLES // WORLD : (epoch + 1) * SAMPLES // WORLD] for s in seen]
            assert sorted(i for s in per_epoch for i in s) == list(range(SAMPLES))
        assert seen == [r["torch"]["seen"] for r in results]  # and the same samples as under torch's HSDP
    for r in results:
        assert r["none"]["mesh"] == r["3bit"]["mesh"] == ((NODES, PER_NODE), ("replicate", "shard"))


def test_none_is_torchs_hsdp_through_lightning_bit_for_bit(results: list[dict]) -> None:
    steps = EPOCHS * SAMPLES // WORLD // BATCH
    for r in results:
        # the same reduce-scatter with ReduceOp.AVG inside the node, then the same all-reduce with ReduceOp.AVG between
        # nodes on the same shards in the same order: the same floats (tolerance 0), through Lightning's loop and AdamW
        assert len(r["torch"]["losses"]) == steps
        assert r["none"]["losses"] == r["torch"]["losses"]
        assert r["none"]["params"] == r["torch"]["params"]
        stats = r["none"]["stats"]
        assert stats["compression"] == "none" and stats["exchanges"] == 3 * steps
        # between 2 nodes a ring all-reduce sends 2 (M - 1) / M = 1 copy of the fp32 shard per exchange
        assert stats["sent_bytes"] == stats["dense_sent_bytes"] == steps * 4 * sum(SHARD_NUMELS)


def test_3bit_through_lightning_sends_its_wire_format_and_keeps_replicas_identical(results: list[dict]) -> None:
    from gradientflow.comm.quantize import wire_bytes

    steps = EPOCHS * SAMPLES // WORLD // BATCH
    for r in results:
        stats = r["3bit"]["stats"]
        assert stats["nodes"] == NODES and stats["ranks_per_node"] == PER_NODE
        # each shard once in 3-bit codes with a bf16 scale per block of 128: 150 bytes a step against the ring's 448
        assert stats["sent_bytes"] == steps * sum(wire_bytes(n, 3, 128) for n in SHARD_NUMELS)
        assert stats["dense_sent_bytes"] == steps * 4 * sum(SHARD_NUMELS)
        assert r["3bit"]["losses"][0] == r["torch"]["losses"][0]  # the first forward precedes any exchange
        assert r["3bit"]["losses"] != r["torch"]["losses"]
    assert all(r["3bit"]["params"] == results[0]["3bit"]["params"] for r in results[1:])  # every replica alike


def test_a_resume_from_lightnings_checkpoint_is_the_uninterrupted_run(results: list[dict]) -> None:
    for r in results:
        assert "gradientflow" in r["files"] and "meta.pt" in r["files"]  # the recipe state inside Lightning's folder
        # the residuals, the optimizer, the data order and the step: the same floats as the run never stopped
        assert r["resumed"]["losses"] == r["3bit"]["losses"]
        assert r["resumed"]["params"] == r["3bit"]["params"]


def test_lightnings_own_checkpoint_drops_the_recipe_state_and_gradientflow_says_so(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["lightnings"]["params"] != r["3bit"]["params"]  # the residuals restarted at zero: another run
        warned = r["lightnings"]["warned"]
        assert (len(warned) == 1 and "restart at zero" in warned[0]) if rank == 0 else warned == []


def test_the_strategys_options_are_checked_when_it_is_built() -> None:
    from datetime import timedelta

    from gradientflow.integrations.lightning_fsdp import GradientFlowHSDPStrategy

    for other in ({"data_parallel_size": 4}, {"tensor_parallel_size": 1}, {"save_distributed_checkpoint": False}):
        with pytest.raises(ValueError, match=f"\\['{next(iter(other))}'\\] are not its options"):
            GradientFlowHSDPStrategy(**other)
    # the advice works: without them, with ModelParallelStrategy's own options
    strategy = GradientFlowHSDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
    assert strategy.process_group_backend == "gloo" and strategy._timeout == timedelta(seconds=60)
    assert strategy._save_distributed_checkpoint
