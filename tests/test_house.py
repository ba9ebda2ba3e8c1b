"""The house rules the layering test (test_docs.py) does not read: one class, one file (issue 40).

A class's state is the attributes its methods assign on ``self`` (``self.x = ...``, ``self.a, self.b = ...``,
``self.x: T = ...``, ``self.x += ...``), its package bases' included: a mixin that assigns on ``self`` spreads
the class it is mixed into over two files.  Each class of the package must have all of those assignments in one
file; state that belongs to a part lives in an object of its own (the reducer's ``layout``, ``binding`` and
``unused``; the wrapper's ``_gf_torch`` and ``_gf_optimizers``).  Writes through ``self.__dict__[...]`` (a
property's storage) are not assignments of an attribute and are not counted.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gradientflow"


def _self_targets(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return [target.attr]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _self_targets(element)]
    if isinstance(target, ast.Starred):
        return _self_targets(target.value)
    return []


def _assigned(cls: ast.ClassDef) -> set[str]:
    """The attributes the methods of ``cls`` assign on ``self``."""
    names: set[str] = set()
    for item in cls.body:
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(item):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(_self_targets(target))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                names.update(_self_targets(node.target))
    return names


def spread_classes(sources: dict[str, str]) -> dict[str, dict[str, list[str]]]:
    """Classes whose ``self`` attributes (their own and their package bases') are assigned in more than one
    file: ``{class: {file: [attributes]}}``.  ``sources``: file name -> Python source."""
    classes: dict[str, list[tuple[str, ast.ClassDef]]] = defaultdict(list)
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes[node.name].append((name, node))

    def files_of(cls_name: str, seen: frozenset[str]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = defaultdict(set)
        for file, cls in classes.get(cls_name, []):
            attrs = _assigned(cls)
            if attrs:
                out[file] |= attrs
            for base in cls.bases:
                base_name = (
                    base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                )
                if base_name in classes and base_name not in seen:
                    for f, a in files_of(base_name, seen | {base_name}).items():
                        out[f] |= a
        return out

    spread = {}
    for cls_name in classes:
        files = files_of(cls_name, frozenset({cls_name}))
        if len(files) > 1:
            spread[cls_name] = {f: sorted(a) for f, a in sorted(files.items())}
    return spread


def test_no_class_has_attributes_assigned_in_more_than_one_file() -> None:
    sources = {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}
    spread = spread_classes(sources)
    assert not spread, (
        "classes whose attributes are assigned in more than one file (give the part an object of its own, or "
        f"assign in the class's own file): {spread}"
    )


def test_the_check_sees_a_mixin_that_assigns() -> None:
    """The shape the reducer had before issue 40 (``class Reducer(PoolLayout, GradBinding)``, ``self.bound`` set
    in layout.py and binding.py) is found; the composed shape is not."""
    mixins = {
        "layout.py": "class PoolLayout:\n    def install(self):\n        self.pool, self.bound = 1, 2\n",
        "binding.py": "class GradBinding:\n    def bind(self):\n        self.bound: list = []\n",
        "reducer.py": (
            "from .layout import PoolLayout\nfrom .binding import GradBinding\n"
            "class Reducer(PoolLayout, GradBinding):\n    def __init__(self):\n        self.sync = None\n"
        ),
    }
    spread = spread_classes(mixins)
    assert spread["Reducer"] == {"binding.py": ["bound"], "layout.py": ["bound", "pool"], "reducer.py": ["sync"]}
    composed = {
        "layout.py": "class PoolLayout:\n    def __init__(self):\n        self.pool = 1\n",
        "reducer.py": (
            "from .layout import PoolLayout\n"
            "class Reducer:\n    def __init__(self):\n        self.layout = PoolLayout()\n"
            "        self.layout.pool = 2  # another object's attribute: not this class's\n"
        ),
    }
    assert spread_classes(composed) == {}


@pytest.mark.parametrize(
    ("file", "name"), [("config.py", "GradientFlowConfig"), ("recipe_options.py", "RecipeOptions")]
)
def test_every_config_field_is_documented_under_it(file: str, name: str) -> None:
    """Each option of ``GradientFlowConfig`` (its own fields and the recipe options it extends) says what it is where
    it is declared: a docstring right under the field (not only in a class docstring far from it, and not a
    comment: a ``# noqa`` is one too)."""
    path = PACKAGE / file
    text = path.read_text(encoding="utf-8")
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == name)
    undocumented = []
    fields = 0
    for field, after in zip(cls.body, [*cls.body[1:], None]):
        if not isinstance(field, ast.AnnAssign) or not isinstance(field.target, ast.Name):
            continue
        fields += 1
        docstring = (
            isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
        )
        if not docstring:
            undocumented.append(field.target.id)
    assert fields, f"{file} declares no field of {name}"
    assert not undocumented, f"{name}'s fields without a docstring under them: {undocumented}"
