"""The documentation a reader of the repository walks through: README.md (a landing page) and docs/.

Every relative link resolves (file, and heading anchor where one is given), the README stays short and
reaches every page, every ``gradientflow.x.y`` name the pages mention exists, and the layering that
docs/architecture.md states is the one the code's imports follow.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
RESULTS = DOCS / "results"
"""The lab record: the dated measurements with their commands, linked from the user pages (docs/*.md)."""
PACKAGE = ROOT / "src" / "gradientflow"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (a ``[x](y)`` in code is not a link)."""
    return FENCE.sub("", path.read_text())


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters of any script, digits,
    ``_`` and ``-`` stay), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.+)$", _prose(path), re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")  # GitHub numbers repeated headings
    return out


def _relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path)) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_readme_reaches_every_user_page_and_the_record_reaches_every_result() -> None:
    """README links every page of docs/ and the record's index; the index links every page of the record."""
    linked = {Path(t.partition("#")[0]).as_posix() for t in _relative_links(README) if t.startswith("docs/")}
    pages = {p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md")} | {"docs/results/README.md"}
    assert pages <= linked, f"docs/ pages the README does not link: {sorted(pages - linked)}"
    index = RESULTS / "README.md"
    in_index = {Path(t.partition("#")[0]).name for t in _relative_links(index)}
    results = {p.name for p in RESULTS.glob("*.md")} - {"README.md"}
    assert results <= in_index, f"docs/results/ pages its README does not link: {sorted(results - in_index)}"


def _decision_table() -> list[list[str]]:
    """The README's decision table: its rows' cells (the table under "## Which recipe")."""
    text = README.read_text()
    start = text.index("## Which recipe")
    lines = text[start:].splitlines()[1:]
    first = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    table = [ln for ln in itertools.takewhile(lambda ln: ln.startswith("|"), lines[first:])]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in table]
    return rows[2:]  # after the header and its rule


def test_readme_decision_table_is_one_short_line_per_situation() -> None:
    """A newcomer decides in 30 seconds: each situation (optimizer x network x layout) one row, no cell over 25
    words, and every recipe it names is a row of the recipe table."""
    from gradientflow.recipes import NAMES

    rows = _decision_table()
    assert len(rows) >= 4, rows
    situations = [tuple(r[:3]) for r in rows]
    assert len(set(situations)) == len(situations), "two rows for one situation"
    for row in rows:
        for cell in row:
            assert len(cell.split()) <= 25, f"a cell of {len(cell.split())} words: {cell}"
        named = re.findall(r'compression="([^"]+)"', row[3])
        assert named and all(n in NAMES for n in named), row


@pytest.mark.parametrize(
    ("optimizer", "network", "layout", "recipe"),
    [
        ("SGD", "1 Gbit/s", "2 machines", "auto"),  # an SGD CNN on two machines
        ("AdamW", "1 Gbit/s", "2 nodes of 2 GPUs", "auto"),  # an AdamW transformer, 2 nodes of 2 GPUs
        ("SGD", "100 Mbit/s", "2 machines", "auto"),  # an SGD language model on a slow link
    ],
)
def test_a_newcomers_situation_maps_to_exactly_one_row(optimizer: str, network: str, layout: str, recipe: str) -> None:
    """Each situation falls in exactly one row: the optimizer cell names it, the network cell's range holds its
    speed, the layout cell its layout."""

    def network_holds(cell: str) -> bool:  # the table's two kinds of network
        mbit = float(network.split()[0]) * (1000 if "Gbit" in network else 1)
        return mbit <= 10_000 if cell == "up to 10 Gbit/s" else cell == "any"

    def layout_holds(cell: str) -> bool:
        several = " of " in layout  # "2 nodes of 2 GPUs"
        if cell == "nodes of several GPUs":
            return several
        return not several if cell == "one rank per machine" else cell == "any"

    hits = [
        r
        for r in _decision_table()
        if (optimizer in r[0].split(", ") or r[0] == "any") and network_holds(r[1]) and layout_holds(r[2])
    ]
    assert len(hits) == 1, hits
    assert f'compression="{recipe}"' in hits[0][3], hits[0]


def test_no_page_points_outside_the_repository() -> None:
    for page in PAGES:
        text = page.read_text()
        assert "../shared/" not in text and "DESIGN.md" not in text, f"{page.name} points outside the repository"


def test_every_named_module_and_object_exists() -> None:
    """``gradientflow.a.b`` in prose or commands: a module, or a name in one (catches paths a move left stale)."""
    missing = []
    for page in PAGES:
        for dotted in sorted(set(re.findall(r"(?<![\w/.])gradientflow(?:\.\w+)+", page.read_text()))):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                    break
                except ModuleNotFoundError:
                    continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(f"{page.name}: {dotted}")
    assert not missing, missing


def _layers() -> list[str]:
    """The layer order as docs/architecture.md states it (``config < diagnostics < ... < cli``)."""
    match = re.search(r"^(\w+(?: < \w+)+)$", (DOCS / "architecture.md").read_text(), re.M)
    assert match, "docs/architecture.md states no layer order"
    return match.group(1).split(" < ")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of the package in ``path``."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from . import x` / `from ..engine import comm_state`: x may be a module
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return [(n, m) for n, m in out if m == "gradientflow" or m.startswith("gradientflow.")]


def test_no_module_imports_a_higher_layer() -> None:
    layers = _layers()
    assert set(layers) == {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()} - {
        "__init__",
        "__pycache__",
    }, "docs/architecture.md's layers are not the package's top-level modules"

    def layer(module: str) -> int:
        parts = module.split(".")
        # the package root re-exports the wrapper: importing it is importing the wrapper's layer
        return layers.index(parts[1]) if len(parts) > 1 and parts[1] in layers else layers.index("wrapper")

    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        here = layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for line, target in _imports(path):
            if layer(target) > here:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not upward, "imports against the layer order of docs/architecture.md:\n" + "\n".join(upward)


class _Parsed(Exception):
    """Raised in place of running a command, once its arguments parsed."""


COMMAND = re.compile(r"`((?:gradientflow|python -m gradientflow\.[\w.]+|python|torchrun) [^`]*--[^`]*)`")


def _documented_commands() -> list[str]:
    """Commands with options, as written in the pages (``mypkg``: the reader's own model, a placeholder)."""
    found = {c for page in PAGES for c in COMMAND.findall(page.read_text())}
    runnable = [c for c in found if "mypkg" not in c and "..." not in c]
    # a command, not an option named in prose (`gradientflow --help`, `torchrun --max-restarts 1`)
    return sorted(c for c in runnable if (".py" in c or " -m " in c) or not c.split()[1].startswith("-"))


def _declared_options(script: Path) -> set[str]:
    """The options a script's argparse declares: every string literal starting with ``--`` given to an
    ``add_argument`` call (read from its syntax tree, not by running it: the script imports torch)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            out |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return out


@pytest.mark.parametrize("command", _documented_commands())
def test_every_documented_command_parses(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command's arguments are accepted by its own parser, as written (nothing is run)."""
    import argparse
    import shlex

    argv = shlex.split(command)
    if argv[0] in ("python", "torchrun") and argv[1] != "-m":  # a script: it exists and knows every option
        script = ROOT / next(a for a in argv if a.endswith(".py"))
        assert script.exists(), f"{command}: no script {script.relative_to(ROOT)}"
        options = [a for a in argv[argv.index(next(a for a in argv if a.endswith(".py"))) :] if a.startswith("--")]
        declared = _declared_options(script)
        missing = [o for o in options if o.partition("=")[0] not in declared]
        assert not missing, f"{command}: {script.name} declares no {missing} (add_argument)"
        return
    original = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    with pytest.raises(_Parsed):
        if argv[0] == "gradientflow":
            from gradientflow.cli import build_parser

            build_parser().parse_args(argv[1:])
        else:
            importlib.import_module(argv[2]).main(argv[3:])


def _architecture_rows() -> list[tuple[str, str, str]]:
    """(layer, file, description) of docs/architecture.md's layer table; a blank layer cell continues the last."""
    text = (DOCS / "architecture.md").read_text()
    lines = text[text.index("| layer | files | what lives there |") :].splitlines()[2:]
    rows, layer = [], ""
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        layer = cells[0].strip("`") or layer
        rows.append((layer, cells[1].strip("`"), cells[2]))
    return rows


def _definitions() -> dict[str, set[Path]]:
    """Every class, function, method and module-level name the package defines, with the files defining it."""
    out: dict[str, set[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.setdefault(node.name, set()).add(path)
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, set()).add(path)
    return out


def _defines_code(path: Path) -> bool:
    """Whether a module defines a function or class (a package's ``__init__.py`` that only marks the
    folder, or re-exports, needs no row of its own)."""
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in ast.parse(path.read_text()).body)


def test_architecture_table_is_the_package_as_it_is() -> None:
    """Every module of the per-file layers has its row, every file named exists, and every name a row
    gives to a file is defined in that file (a name that moved leaves a stale row, which fails here)."""
    rows = _architecture_rows()
    defined = _definitions()
    problems = []
    described = set()
    for layer, file, what in rows:
        folder = PACKAGE / layer.rstrip("/") if layer.endswith("/") else PACKAGE
        if file.endswith(".py"):
            path = folder / file
        elif layer.endswith(".py"):
            path = PACKAGE / layer
        else:  # a folder described in one row (bench/, sim/): the files it names exist
            for name in re.findall(r"`(\w+\.py)`", what):
                if not (folder / name).exists():
                    problems.append(f"{layer} row names {name}, which {folder.relative_to(ROOT)} does not hold")
            continue
        described.add(path)
        if not path.exists():
            problems.append(f"row {layer} {file}: no such file")
            continue
        for name in re.findall(r"`([A-Za-z_]\w*)`", what):
            if name in defined and path not in defined[name]:
                where = ", ".join(str(p.relative_to(PACKAGE)) for p in sorted(defined[name]))
                problems.append(f"row {path.relative_to(PACKAGE)} names `{name}`, defined in {where}")
    per_file = {layer for layer, file, _ in rows if file.endswith(".py") or layer.endswith(".py")}
    for layer in per_file:
        folder = PACKAGE / layer.rstrip("/")
        for path in sorted(folder.glob("*.py")) if folder.is_dir() else [PACKAGE / layer]:
            if path not in described and not (path.name == "__init__.py" and not _defines_code(path)):
                problems.append(f"{path.relative_to(ROOT)} has no row in docs/architecture.md's layer table: add one")
    assert not problems, "\n".join(problems)
