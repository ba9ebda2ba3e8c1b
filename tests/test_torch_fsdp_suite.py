"""The FSDP2 oracle runner's selection and substitution (docs/torch-fsdp-suite.md), without running torch's suite."""

from __future__ import annotations

import textwrap

import pytest

from gradientflow.bench.torch_suite import fsdp_selection
from gradientflow.bench.torch_suite.fsdp_selection import hsdp_tests, select
from gradientflow.bench.torch_suite.fsdp_substitute import routes_to_gradientflow, substitute

SOURCE = textwrap.dedent(
    """
    class TestA(FSDPTest):
        def test_fsdp_only(self):
            fully_shard(model, mesh=init_device_mesh("cpu", (4,)))

        def test_hsdp_direct(self):
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

        def test_through_subtests(self):
            self.run_subtests({"x": [1]}, self._helper)

        def _helper(self, x):
            self._deeper()

        def _deeper(self):
            mesh = init_device_mesh("cpu", (self.world_size // 2, 2))

        def test_mesh_shape_values(self):
            self.run_subtests({"mesh_shape": [(4,), (2, 2)]}, self._plain)

        def _plain(self, mesh_shape):
            pass

        def test_sliced_from_3d(self):
            m = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
            dp = m["a", "b"]

        def test_3d_only(self):
            init_device_mesh("cpu", (2, 2, 2))

    class TestB(TestA):
        def test_own(self):
            pass
    """
)


def test_a_test_reaches_a_2d_mesh_in_its_body_or_through_its_helpers_at_any_depth():
    got = hsdp_tests(SOURCE)
    a = ["test_hsdp_direct", "test_through_subtests", "test_mesh_shape_values", "test_sliced_from_3d"]
    assert got == [f"TestA.{n}" for n in a] + [f"TestB.{n}" for n in a]  # inherited tests run in the subclass too


def test_select_reads_a_checkout_directory_and_narrows_by_name(tmp_path):
    (tmp_path / "test_fully_shard_x.py").write_text(SOURCE)
    (tmp_path / "test_other.py").write_text(SOURCE)  # not an FSDP2 test file: not read
    assert fsdp_selection.test_files(str(tmp_path)) == [str(tmp_path / "test_fully_shard_x.py")]
    picked = select(fsdp_selection.test_files(str(tmp_path)), ["TestA.test_hsdp_direct", "test_sliced_from_3d"])
    assert [t for _, t in picked] == [
        "TestA.test_hsdp_direct",
        "TestA.test_sliced_from_3d",
        "TestB.test_sliced_from_3d",
    ]
    with pytest.raises(ValueError, match="test/distributed/_composable/fsdp"):
        fsdp_selection.test_files(str(tmp_path / "missing"))


class _Mesh:
    def __init__(self, ndim):
        self.ndim = ndim


def test_only_a_2d_mesh_goes_to_gradientflow(monkeypatch):
    from gradientflow.bench.torch_suite import fsdp_substitute

    monkeypatch.setattr(fsdp_substitute, "DeviceMesh", _Mesh)
    calls = []
    fs = substitute(
        lambda m, **k: calls.append(("torch", k)), lambda m, **k: calls.append(("gf", k)), compression="none"
    )
    assert fs.__name__ == "fully_shard"  # torch's compiled_fsdp_test swaps the test's global of this name
    fs("m")
    fs("m", mesh=_Mesh(1))
    fs("m", mesh=_Mesh(2), reshard_after_forward=False)
    fs("m", mesh=_Mesh(3))
    assert calls == [
        ("torch", {}),
        ("torch", {"mesh": calls[1][1]["mesh"]}),
        ("gf", {"mesh": calls[2][1]["mesh"], "reshard_after_forward": False, "compression": "none"}),
        ("torch", {"mesh": calls[3][1]["mesh"]}),
    ]
    assert not routes_to_gradientflow(None)
