"""Every method and attribute the README names, called on the wrapper the way a user calls it."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import gradientflow as gf

from _dist import run_distributed
from _oracle import batch


def _readme_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    model = gf.DistributedDataParallel(
        net, fusion_threshold_mb=25, comm_dtype="fp16", density=0.5, chunk_size=16, warmup_steps=1, momentum=0.0
    )
    assert model.module is net
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    model.register_grad_scaler(scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.check_optimizer(opt)  # CSC momentum correction is off here: the optimizer may keep its momentum
    for step in range(3):
        opt.zero_grad()
        with model.no_sync():
            model(batch(rank, 100 + step)).pow(2).mean().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch(rank, step)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    stats = model.comm_stats()
    for key in ("collectives", "payload_bytes", "dense_bytes", "comm_seconds", "exposed_seconds"):
        assert key in stats
    assert 0 < stats["payload_bytes"] < stats["dense_bytes"]
    # Checkpoint: model state (DDP keys) and communication state, loadable with weights_only=True.
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "comm": model.comm_state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    torch.manual_seed(0)
    twin = gf.DistributedDataParallel(
        nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)),
        comm_dtype="fp16",
        density=0.5,
        chunk_size=16,
        warmup_steps=1,
    )
    twin.load_state_dict(ckpt["model"])
    twin.load_comm_state_dict(ckpt["comm"])
    for a, b in zip(model.comm_state_dict()["v"], twin.comm_state_dict()["v"]):
        assert torch.equal(a, b)
    # check_optimizer warns when CSC momentum correction meets optimizer momentum.
    mc = gf.DistributedDataParallel(nn.Linear(6, 4), density=0.5, momentum=0.9)
    with pytest.warns(UserWarning, match="momentum"):
        mc.check_optimizer(torch.optim.SGD(mc.parameters(), lr=0.1, momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mc.check_optimizer(torch.optim.SGD(mc.parameters(), lr=0.1))
    # ... and when an Adam-type optimizer meets a density below 0.3 (the quality bench's finding).
    for density, warns in ((0.1, True), (0.3, False)):
        lo = gf.DistributedDataParallel(nn.Linear(6, 4), density=density)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            lo.check_optimizer(torch.optim.AdamW(lo.parameters(), lr=1e-3))
            lo.check_optimizer(torch.optim.SGD(lo.parameters(), lr=0.1, momentum=0.9))  # never
        assert [("Adam-type" in str(w.message) and "AdamW" in str(w.message)) for w in seen] == [True] * warns
    # join(), as in the README's compatibility table.
    with model.join():
        opt.zero_grad()
        model(batch(rank, 9)).sum().backward()
    # The config object is public and frozen.
    assert isinstance(model.config, gf.GradientFlowConfig)


def test_readme_methods_on_the_wrapper() -> None:
    run_distributed(_readme_worker, 2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        opt.zero_grad()
        model(batch(0, step)).pow(2).mean().backward()
        opt.step()  # the line a warning from the automatic check must name


def _auto_check_worker(rank: int, world_size: int) -> None:
    def warnings_of(make_model, make_opt, explicit: bool = False) -> list[warnings.WarningMessage]:
        model = make_model()
        opt = make_opt(model)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if explicit:
                model.check_optimizer(opt)
            _train(model, opt)
        return [w for w in seen if "gradientflow" in str(w.message)]

    # Never calling check_optimizer: momentum twice (CSC's correction and SGD's) is reported at the
    # first step, once, pointing at the user's opt.step() line.
    (w,) = warnings_of(
        lambda: gf.DistributedDataParallel(nn.Linear(6, 4), density=0.5, momentum=0.9),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    )
    assert "momentum" in str(w.message) and w.filename == __file__
    # AdamW below density 0.3, likewise; an explicit call first is not repeated at the first step.
    for explicit in (False, True):
        (w,) = warnings_of(
            lambda: gf.DistributedDataParallel(nn.Linear(6, 4), density=0.1),
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
            explicit,
        )
        assert "Adam-type" in str(w.message) and w.filename == __file__
    # Nothing to say: a dense wrapper (no hook at all), or an optimizer of other parameters.
    dense = gf.DistributedDataParallel(nn.Linear(6, 4))
    assert dense._gf_optimizers.hook is None
    assert warnings_of(lambda: dense, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)) == []
    sparse = gf.DistributedDataParallel(nn.Linear(6, 4), density=0.1)
    other = nn.Linear(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            other(batch(0, 0)).sum().backward()
            torch.optim.AdamW(other.parameters(), lr=1e-3).step()
        sparse(batch(0, 0)).sum().backward()  # the sparse wrapper lives on, its hook registered


def test_check_optimizer_runs_by_itself_at_the_first_step() -> None:
    run_distributed(_auto_check_worker, 2)
