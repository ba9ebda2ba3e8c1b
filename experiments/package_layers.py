"""The package's layout as a table: each top-level layer of ``src/gradientflow`` (a folder or a one-file module), its
files and lines, and which other layers it imports, at a git revision or in the working tree.

Why: a change that moves code between layers (issue 69: one exchange for every door) is judged by the layout before
and after, read the same way both times; docs/architecture.md states the layer order, and
tests/test_docs.py::test_no_module_imports_a_higher_layer checks it.  This prints, it does not judge.

    python experiments/package_layers.py                # the working tree
    python experiments/package_layers.py --rev b209430  # a commit (read with git show; nothing is checked out)
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "src/gradientflow"


def _files(rev: str | None) -> dict[str, str]:
    """Every ``.py`` file of the package (path relative to the package -> text), at ``rev`` or on disk."""
    if rev is None:
        base = ROOT / PACKAGE
        return {str(p.relative_to(base)): p.read_text() for p in sorted(base.rglob("*.py"))}
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, PACKAGE], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    return {
        n[len(PACKAGE) + 1 :]: subprocess.run(
            ["git", "show", f"{rev}:{n}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        for n in names
        if n.endswith(".py")
    }


def _layer(relative: str) -> str:
    """``exchange/ring.py`` -> ``exchange/``; ``config.py`` -> ``config.py``."""
    head, _, rest = relative.partition("/")
    return f"{head}/" if rest else head


def _imported_layers(relative: str, text: str) -> set[str]:
    """The layers a module imports (absolute ``gradientflow.x`` and relative ``..x`` imports)."""
    parts = relative[: -len(".py")].split("/")
    out: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ImportFrom) and not isinstance(node, ast.Import):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("gradientflow.")]
        elif node.level:
            anchor = parts[: len(parts) - node.level]
            mod = [*anchor, *(node.module.split(".") if node.module else [])]
            targets = [".".join(["gradientflow", *mod, a.name]) if not node.module else ".".join(["gradientflow", *mod])
                       for a in node.names]  # fmt: skip
        else:
            targets = [node.module] if node.module and node.module.startswith("gradientflow.") else []
            if node.module == "gradientflow":
                targets = [f"gradientflow.{a.name}" for a in node.names]
        for t in targets:
            name = t.split(".")[1] if len(t.split(".")) > 1 else ""
            if name:
                out.add(name)
    return out


def table(rev: str | None) -> str:
    files = _files(rev)
    folders = {r.partition("/")[0] for r in files if "/" in r}
    layers = {_layer(r) for r in files}
    lines: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    imports: dict[str, set[str]] = defaultdict(set)
    for rel, text in files.items():
        layer = _layer(rel)
        lines[layer] += len(text.splitlines())
        count[layer] += 1
        for name in _imported_layers(rel, text):
            target = f"{name}/" if name in folders else f"{name}.py"
            if target != layer and target in layers:
                imports[layer].add(target)
    out = ["| layer | files | lines | imports |", "|---|---|---|---|"]
    for layer in sorted(lines, key=lambda k: (k.endswith("/"), k)):
        deps = ", ".join(f"`{d}`" for d in sorted(imports[layer])) or "—"
        out.append(f"| `{layer}` | {count[layer]} | {lines[layer]} | {deps} |")
    out.append(f"| all | {sum(count.values())} | {sum(lines.values())} | |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default=None, help="a git revision (default: the working tree)")
    args = parser.parse_args()
    print(table(args.rev))


if __name__ == "__main__":
    main()
