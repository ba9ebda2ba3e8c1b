"""Restart: a worker killed mid-run is restarted by torchrun, resumes from the last checkpoint and ends
with the parameters of an uninterrupted run, bit for bit; bad communication states are refused."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

import gradientflow as gf

from _dist import run_distributed
from _example import run_example

CSC = ("--density", "0.25", "--comm-dtype", "fp16")


@pytest.mark.parametrize("mode", ["dense", "csc"])
def test_killed_worker_resumes_bit_identical(tmp_path: Path, mode: str) -> None:
    extra = CSC if mode == "csc" else ()
    whole = run_example(tmp_path, "gradientflow", *extra, tag="-whole")
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "10"]
    resumed = run_example(
        tmp_path, "gradientflow", *extra, *ckpt, "--die-at-step", "25", max_restarts=1, tag="-resumed"
    )
    assert "resumed from step 20" in resumed["stdout"]
    assert resumed["steps"] == whole["steps"]
    assert resumed["params"] == whole["params"]  # exact equality of every float
    assert resumed["loss"] == whole["loss"]


def _bad_state_worker(rank: int, world_size: int) -> None:
    def make(**kw):
        torch.manual_seed(0)
        # warmup_steps=1: step 1 is sparse (a longer ramp sends its first steps dense: tiny chunks)
        return gf.DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), density=0.5, chunk_size=8, warmup_steps=1, **kw
        )

    model = make()
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
    buf = io.BytesIO()
    torch.save(model.comm_state_dict(), buf)
    buf.seek(0)
    good = torch.load(buf, weights_only=True)  # plain tensors and Python values only

    target = make()
    before = target.comm_state_dict()

    def unchanged() -> None:
        after = target.comm_state_dict()
        assert after["layout_order"] == before["layout_order"] and after["step"] == before["step"]

    bad_cases = {
        "world size": {**good, "world_size": 3},
        "chunk_size": {**good, "chunk_size": 16},
        "truncated": {k: v for k, v in good.items() if k != "v"},
        "short residual": {**good, "v": [t[:-1] for t in good["v"]]},
        "other model": {**good, "layout_order": good["layout_order"][:-1]},
    }
    for what, state in bad_cases.items():
        with pytest.raises(ValueError):
            target.load_comm_state_dict(state)
            pytest.fail(f"a communication state with a wrong {what} was accepted")
        unchanged()
    dense = gf.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)))
    with pytest.raises(ValueError, match="densely"):
        dense.load_comm_state_dict(good)
    target.load_comm_state_dict(good)
    for a, b in zip(target.comm_state_dict()["v"], model.comm_state_dict()["v"]):
        assert torch.equal(a, b)


def test_bad_comm_state_is_refused_and_changes_nothing() -> None:
    run_distributed(_bad_state_worker, 2)
