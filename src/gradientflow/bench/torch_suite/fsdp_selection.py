"""Which of torch's FSDP2 tests reach a 2-D mesh (HSDP), read from the test files' text (never imported here).

torch's FSDP2 tests are not in the wheel: they are pytorch's ``test/distributed/_composable/fsdp/`` in the user's
checkout.  A test reaches a 2-D mesh where its method, or a method of its class it reaches through ``self.<name>``
(followed to any depth, as ``run_subtests(..., self._test_x)`` passes them), builds or names one:

- ``init_device_mesh(device, (a, b), ...)``: a shape of two dimensions;
- ``mesh_dim_names=("x", "y")``: two names;
- a slice of two named dimensions, ``mesh["dp_replicate", "dp_shard"]``;
- a 2-tuple among the values of a ``mesh_shape`` subtest (``{"mesh_shape": [(n,), (n // 2, 2)]}``);
- ``HSDPMeshInfo(...)`` (torch's HSDP layout itself).
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable

FILE_PREFIX = "test_fully_shard"
"""The FSDP2 test files of pytorch's ``test/distributed/_composable/fsdp/``."""


def test_files(path: str) -> list[str]:
    """``path``'s FSDP2 test files: the file itself, or a directory's ``test_fully_shard*.py``, sorted."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(
            f"gradientflow torch-suite --fsdp: {path!r} is neither a file nor a directory; pass a pytorch checkout's "
            "test/distributed/_composable/fsdp (or one of its test_fully_shard*.py files)"
        )
    names = sorted(n for n in os.listdir(path) if n.startswith(FILE_PREFIX) and n.endswith(".py"))
    if not names:
        raise ValueError(
            f"gradientflow torch-suite --fsdp: no {FILE_PREFIX}*.py in {path!r}; pass a pytorch checkout's "
            "test/distributed/_composable/fsdp"
        )
    return [os.path.join(path, n) for n in names]


def _two_tuple(node: ast.AST) -> bool:
    return isinstance(node, ast.Tuple) and len(node.elts) == 2


def _builds_2d_mesh(node: ast.AST) -> bool:
    """Whether ``node`` (a method) builds, slices or names a 2-D mesh by one of the module docstring's forms."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if name == "init_device_mesh" and len(n.args) > 1 and _two_tuple(n.args[1]):
                return True
            if name == "HSDPMeshInfo":
                return True
            if any(k.arg == "mesh_dim_names" and _two_tuple(k.value) for k in n.keywords):
                return True
        if isinstance(n, ast.Subscript) and _two_tuple(n.slice):
            if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.slice.elts):  # type: ignore[attr-defined]
                return True
        if isinstance(n, ast.Dict):
            for key, value in zip(n.keys, n.values):
                if isinstance(key, ast.Constant) and key.value == "mesh_shape" and isinstance(value, ast.List):
                    if any(_two_tuple(e) for e in value.elts):
                        return True
    return False


def _self_calls(node: ast.AST) -> set[str]:
    """The names ``node`` reaches as ``self.<name>``."""
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


def hsdp_tests(source: str) -> list[str]:
    """``Class.test_name`` of every test in ``source`` (a test file's text) that reaches a 2-D mesh, in file order."""
    tree = ast.parse(source)
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
    out: list[str] = []
    for cls in classes.values():
        methods: dict[str, ast.AST] = {}
        for base in _bases(cls, classes):  # a base's methods first, the class's own override them
            methods.update({m.name: m for m in base.body if isinstance(m, ast.FunctionDef)})
        direct = {name for name, m in methods.items() if _builds_2d_mesh(m)}
        calls = {name: _self_calls(m) for name, m in methods.items()}
        reach = set(direct)
        while True:
            more = {n for n in methods if n not in reach and calls[n] & reach}
            if not more:
                break
            reach |= more
        own = [m.name for m in cls.body if isinstance(m, ast.FunctionDef)]
        inherited = [n for n in methods if n not in own]
        out += [f"{cls.name}.{n}" for n in inherited + own if n.startswith("test_") and n in reach]
    return out


def _bases(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> list[ast.ClassDef]:
    """``cls``'s bases defined in the same file (outermost first), then ``cls``."""
    chain: list[ast.ClassDef] = []
    for b in cls.bases:
        if isinstance(b, ast.Name) and b.id in classes and classes[b.id] is not cls:
            chain += _bases(classes[b.id], classes)
    return [*chain, cls]


def select(files: Iterable[str], names: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(file, ``Class.test``) of the tests reaching a 2-D mesh in ``files``; ``names``: keep only those whose
    ``Class.test`` (or test name) is one of them."""
    wanted = set(names)
    out = []
    for path in files:
        with open(path) as f:
            found = hsdp_tests(f.read())
        out += [(path, t) for t in found if not wanted or t in wanted or t.split(".")[1] in wanted]
    return out
