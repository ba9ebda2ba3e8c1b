"""accelerate's FSDP2 path (``FullyShardedDataParallelPlugin(fsdp_version=2)``, ``ParallelismConfig`` 2 x 2) with
gradientflow's ``fully_shard`` against the same path with torch's HSDP, on 4 Gloo ranks (2 "nodes" of 2).

accelerate turns FSDP on only for accelerator devices: ``AcceleratorState.__init__`` sets ``DistributedType.FSDP``
inside its ``elif self.distributed_type in [DistributedType.MULTI_GPU, ...]`` branch (accelerate 1.15.0,
accelerate/state.py:986-1016), never for ``MULTI_CPU``, and ``ParallelismConfig._validate_accelerator`` then refuses
the config on CPU (parallelism_config.py:389-396).  :func:`_fsdp2_on_cpu` sets on the accelerator's state what that
branch sets on GPUs and builds the mesh as ``Accelerator.__init__`` does (accelerator.py:475-477); from there on
everything is accelerate's own FSDP2 code (``_prepare_fsdp2``, ``fsdp2_prepare_model``: its auto-wrap policy, the
root, the optimizer's parameters swapped), running on CPU tensors and Gloo.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from _dist import run_distributed  # noqa: E402

NODES, PER_NODE = 2, 2
STEPS, IN, HIDDEN, OUT, BATCH = 4, 6, 10, 3, 8


# each unit's shard on a rank: every parameter's rows split over the node's 2 ranks, rounded up (torch pads dim 0)
SHARD_NUMELS = [5 * IN + 5, 5 * HIDDEN + 5, 2 * HIDDEN + 2]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def _fsdp2_on_cpu(accelerator, plugin, parallelism) -> None:
    """What accelerate sets on a multi-GPU launch (state.py:1010-1016, accelerator.py:475-477), on CPU."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    state.parallelism_config = parallelism
    state.device_mesh = parallelism.get_device_mesh("cpu")
    parallelism._validate_accelerator(accelerator)


def _run(make, rank: int, **options) -> dict:
    """accelerate's loop (prepare, backward, step) on the HSDP mesh; the losses, the gathered parameters."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig
    from torch.distributed.fsdp import FSDPModule

    AcceleratorState._reset_state(True)  # accelerate's state is a per-process singleton
    GradientState._reset_state()
    # size-based wrapping: the two hidden Linear layers (60 and 110 parameters) their own units, the root the rest
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=50)
    accelerator = make(cpu=True, fsdp_plugin=plugin, **options)
    _fsdp2_on_cpu(accelerator, plugin, ParallelismConfig(dp_replicate_size=NODES, dp_shard_size=PER_NODE))
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    ours = [name for name, m in model.named_modules() if getattr(m, "_gf_fsdp", None) is not None]
    out = {"losses": losses, "units": units, "gf_units": ours}
    out["params"] = [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]  # floats: exact
    if ours:
        import gradientflow.fsdp as gf

        out["stats"] = gf.comm_stats(model, total=True)
    return out


def _scenarios(rank: int, world: int) -> dict:
    import torch.distributed.fsdp as torch_fsdp
    from accelerate import Accelerator

    from gradientflow.integrations.accelerate import GradientFlowAccelerator

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # accelerate joins the group _dist made
    torch_fully_shard = torch_fsdp.fully_shard
    out = {"torch": _run(Accelerator, rank)}
    for recipe in ("none", "3bit"):
        out[recipe] = _run(GradientFlowAccelerator, rank, compression=recipe)
    out["torch_restored"] = torch_fsdp.fully_shard is torch_fully_shard
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_scenarios, NODES * PER_NODE, timeout=240, ranks_per_node=PER_NODE)


def test_accelerate_shards_the_same_units_with_gradientflow(results: list[dict]) -> None:
    for r in results:
        assert r["torch"]["units"] == ["", "0", "2"]  # the root and the two Linear layers over 50 parameters
        for recipe in ("none", "3bit"):
            assert r[recipe]["units"] == r["torch"]["units"] == r[recipe]["gf_units"]
            assert r[recipe]["stats"]["nodes"] == NODES and r[recipe]["stats"]["ranks_per_node"] == PER_NODE
        assert r["torch_restored"]  # prepare() left torch's fully_shard as it found it


def test_none_is_torchs_hsdp_through_accelerate_bit_for_bit(results: list[dict]) -> None:
    for r in results:
        # the same reduce-scatter with ReduceOp.AVG inside the node, then the same all-reduce with ReduceOp.AVG
        # between nodes on the same shards, in the same order: the same floats (tolerance 0), AdamW included
        assert r["none"]["losses"] == r["torch"]["losses"]
        assert r["none"]["params"] == r["torch"]["params"]
        stats = r["none"]["stats"]
        assert stats["compression"] == "none" and stats["exchanges"] == 3 * STEPS
        # between 2 nodes a ring all-reduce sends 2 (M - 1) / M = 1 copy of the fp32 shard per exchange
        assert stats["sent_bytes"] == stats["dense_sent_bytes"] == STEPS * 4 * sum(SHARD_NUMELS)


def test_3bit_through_accelerate_sends_its_wire_format_and_keeps_replicas_identical(results: list[dict]) -> None:
    from gradientflow.comm.quantize import wire_bytes

    for r in results:
        stats = r["3bit"]["stats"]
        assert stats["compression"] == "3bit" and stats["exchanges"] == 3 * STEPS
        # between 2 nodes one exchange of whole quantised contributions: each shard once in 3-bit codes with a bf16
        # scale per block of 128 (150 bytes a step here, against the dense ring's 448)
        assert stats["sent_bytes"] == STEPS * sum(wire_bytes(n, 3, 128) for n in SHARD_NUMELS)
        assert stats["dense_sent_bytes"] == STEPS * 4 * sum(SHARD_NUMELS)
        assert r["3bit"]["losses"][0] == r["torch"]["losses"][0]  # the first forward precedes any exchange
        assert r["3bit"]["losses"] != r["torch"]["losses"]  # and then the quantised run is a different run
    # every node decodes the same bytes: every rank's gathered parameters are the same
    assert all(r["3bit"]["params"] == results[0]["3bit"]["params"] for r in results[1:])


def test_fsdp2_options_are_checked_before_accelerate_sets_up() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig

    from gradientflow.integrations.accelerate import GradientFlowAccelerator
    from gradientflow.integrations.accelerate_fsdp import check_parallelism

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    with pytest.raises(ValueError, match=r"\['topology'\] are options of the DDP wrapper"):
        GradientFlowAccelerator(fsdp_plugin=plugin, topology="2x2")  # the mesh is accelerate's ParallelismConfig
    GradientFlowAccelerator(fsdp_plugin=plugin, sync_every=4)  # fully_shard's fewer syncs: its options pass
    with pytest.raises(ValueError, match="outer_lr applies only with sync_every > 1"):
        GradientFlowAccelerator(fsdp_plugin=plugin, outer_lr=0.7)
    with pytest.raises(ValueError, match="did you mean"):
        GradientFlowAccelerator(fsdp_plugin=plugin, compression="3bits")
    with pytest.raises(ValueError, match="dp_replicate_size=1, dp_shard_size=4"):
        check_parallelism(ParallelismConfig(dp_shard_size=4))
    with pytest.raises(ValueError, match="'tp_size': 2"):
        check_parallelism(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2))
    # the advice works: the config it names is taken
    assert check_parallelism(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)) == (2, 2)
