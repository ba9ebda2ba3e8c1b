"""accelerate: ``GradientFlowAccelerator`` against a stock ``Accelerator`` (torch DDP), 2 Gloo ranks.

As in the Lightning tests, every scenario runs twice, stock and gradientflow, from the same seed in
one pair of spawned processes; each test reads its scenario.  Parity is exact (gradientflow's
defaults sum the same fp32 values as torch DDP).
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

pytest.importorskip("accelerate")

from _dist import run_distributed  # noqa: E402

WORLD = 2
STEPS, FEATURES, CLASSES, BATCH = 8, 12, 4, 8


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, (x[:, :CLASSES] * 3).argmax(1)


def _net(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(32)] if batchnorm else []
    return nn.Sequential(nn.Linear(FEATURES, 32), *norm, nn.ReLU(), nn.Linear(32, CLASSES))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _train(accelerator, model, optimizer, rank: int, steps: range, validate: bool = False, clip: float | None = None):
    """The loop of accelerate's examples: accumulate(), backward(), clip when synchronising."""
    val = []
    for step in steps:
        x, y = _batch(rank, step)
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
        if validate and step % 4 == 3:
            model.eval()
            with torch.no_grad():
                val.append(nn.functional.cross_entropy(model(_batch(rank, -1)[0]), _batch(rank, -1)[1]).item())
            model.train()
    return val


def _run(make, rank: int, net: dict | None = None, acc: dict | None = None, steps: int = STEPS, **loop: object):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # accelerate's state is a per-process singleton
    GradientState._reset_state()
    accelerator = make(cpu=True, **(acc or {}))
    model = _net(**(net or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    val = _train(accelerator, model, optimizer, rank, range(steps), **loop)
    return accelerator, model, optimizer, val


def _scenarios(rank: int, world: int, tmp: str) -> dict[str, object]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", WORLD_SIZE=str(world), RANK=str(rank))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # accelerate joins the group _dist made
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from gradientflow.integrations.accelerate import GradientFlowAccelerator

    out: dict[str, object] = {}
    features = {
        "defaults": ({}, {}, {}),
        "accumulate_clip": ({}, dict(gradient_accumulation_steps=2), dict(clip=0.5)),
        "batchnorm": (dict(batchnorm=True), {}, {}),
        "batchnorm_val": (dict(batchnorm=True), {}, dict(validate=True)),
    }
    for name, (net, acc, loop) in features.items():
        a_stock, stock, _, val_stock = _run(Accelerator, rank, net, acc, **loop)
        a_ours, ours, _, val_ours = _run(GradientFlowAccelerator, rank, net, acc, **loop)
        out[name] = _same(_params(stock), _params(ours)) and val_stock == val_ours
        out[name + "_types"] = (type(stock).__module__, type(ours).__module__, a_ours.distributed_type.value)
    # teardown: unwrap_model gives the module back; free_memory lets the wrapper go, hooks and all
    kept = []
    for make in (Accelerator, GradientFlowAccelerator):
        accelerator, model, optimizer, _ = _run(make, rank)
        inner = accelerator.unwrap_model(model)
        ref = weakref.ref(model)
        accelerator.free_memory()
        del model, optimizer
        gc.collect()
        hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in inner.parameters())
        kept.append((type(inner).__name__, ref() is None, hooks))
    out["teardown"] = kept
    # fp16 + density 0.1: save_state after step 4, a fresh accelerator/model/optimizer, load_state, go on
    sparse = dict(comm_dtype="fp16", density=0.1, warmup_steps=2)
    _, whole, _, _ = _run(lambda **kw: GradientFlowAccelerator(**kw, **sparse), rank)
    results = {}
    for case in ("with_state", "without_state"):
        a, model, optimizer, _ = _run(lambda **kw: GradientFlowAccelerator(**kw, **sparse), rank, steps=0)
        _train(a, model, optimizer, rank, range(4))
        path = os.path.join(tmp, case)
        a.save_state(path)
        a.wait_for_everyone()
        if case == "without_state":  # the control: the same checkpoint without the sync state
            os.remove(os.path.join(path, f"gradientflow_comm_0_rank{rank}.pt"))
        a, model, optimizer, _ = _run(lambda **kw: GradientFlowAccelerator(**kw, **sparse), rank, steps=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a.load_state(path)
        _train(a, model, optimizer, rank, range(4, STEPS))
        results[case] = _same(_params(whole), _params(model))
        results[case + "_warnings"] = [os.path.basename(w.filename) for w in caught if "gradientflow" in str(w.message)]
        results[case + "_files"] = sorted(f for f in os.listdir(path) if f.startswith("gradientflow"))
    out["resume"] = results
    # sync_every through the accelerator: the outer loop inside accelerate's optimizer step, its state saved by
    # save_state mid-interval (H = 3, cut after step 4) and loaded back
    outer = dict(sync_every=3, outer_compression="none")
    _, whole, _, _ = _run(lambda **kw: GradientFlowAccelerator(**kw, **outer), rank)
    stats = whole.comm_stats(total=True)
    a, model, optimizer, _ = _run(lambda **kw: GradientFlowAccelerator(**kw, **outer), rank, steps=0)
    _train(a, model, optimizer, rank, range(4))
    path = os.path.join(tmp, "outer")
    a.save_state(path)
    a.wait_for_everyone()
    a, model, optimizer, _ = _run(lambda **kw: GradientFlowAccelerator(**kw, **outer), rank, steps=0)
    a.load_state(path)
    _train(a, model, optimizer, rank, range(4, STEPS))
    out["outer"] = (_same(_params(whole), _params(model)), stats["sync_every"], stats["outer_syncs"])
    # a comm hook through accelerate's DistributedDataParallelKwargs, against torch DDP running it
    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    _, ours, _, _ = _run(GradientFlowAccelerator, rank, acc=dict(kwargs_handlers=[handler]))
    _, stock, _, _ = _run(Accelerator, rank, acc=dict(kwargs_handlers=[handler]))
    out["comm_hook"] = _same(_params(stock), _params(ours))
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(_scenarios, WORLD, tmp, timeout=240)


@pytest.mark.parametrize(
    "feature",
    ["defaults", "accumulate_clip", "batchnorm", "batchnorm_val"],
)
def test_bit_identical_to_accelerate_ddp(results, feature):
    for r in results:
        stock_type, our_type, kind = r[feature + "_types"]
        assert (stock_type, our_type, kind) == (
            "torch.nn.parallel.distributed",
            "gradientflow.wrapper.ddp",
            "MULTI_CPU",
        )
        assert r[feature] is True, feature


def test_sparse_resume_from_save_state_is_the_uninterrupted_run(results):
    for r in results:
        resume = r["resume"]
        assert resume["with_state_files"] == [f"gradientflow_comm_0_rank{q}.pt" for q in range(WORLD)]
        assert resume["with_state"] is True and resume["with_state_warnings"] == []
        # the control: without this rank's file the run differs, and load_state says so at the user's line
        assert resume["without_state"] is False
        assert resume["without_state_warnings"] == ["test_accelerate.py"]


def test_sync_every_passes_through_and_resumes_from_save_state(results):
    """8 steps at H = 3: synced after steps 3 and 6; the run cut after step 4 resumes on the uninterrupted bits."""
    for r in results:
        assert r["outer"] == (True, 3, 2)


def test_teardown_leaves_the_module_as_accelerate_does(results):
    for r in results:
        (stock_name, stock_freed, stock_hooks), (our_name, our_freed, our_hooks) = r["teardown"]
        assert stock_name == our_name == "Sequential"  # unwrap_model gives the user's module back
        assert stock_freed and our_freed
        assert stock_hooks == our_hooks == 0


def test_comm_hook_matches_torch_ddp_running_it(results):
    assert all(r["comm_hook"] is True for r in results)
