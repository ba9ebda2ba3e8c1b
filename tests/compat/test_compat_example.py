"""An existing DDP script, changed only in its import, gives torch DDP's result under torchrun."""

from __future__ import annotations

from pathlib import Path

from _example import run_example


def test_train_ddp_same_result_with_either_import(tmp_path: Path) -> None:
    ref = run_example(tmp_path, "torch")
    ours = run_example(tmp_path, "gradientflow", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "10")
    assert ref["steps"] == ours["steps"] > 0
    # Dense fp32, the same summation of the same gradients: equal to 1e-5.
    assert abs(ref["loss"] - ours["loss"]) <= 1e-5, (ref["loss"], ours["loss"])
    for name, values in ref["params"].items():
        assert max(abs(a - b) for a, b in zip(values, ours["params"][name])) <= 1e-5, name
    assert (tmp_path / "ckpt" / "checkpoint.pt").exists()
