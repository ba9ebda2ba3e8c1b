"""The shipped package: a plain (non-editable) install must carry every subpackage."""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages

SRC = Path(__file__).resolve().parents[1] / "src"


def test_every_folder_with_modules_is_a_package_that_setuptools_finds() -> None:
    # pyproject uses setuptools' package discovery: a folder without __init__.py would be left out
    # of a wheel, and `import gradientflow` would fail there although it works in an editable install.
    folders = {p.parent for p in (SRC / "gradientflow").rglob("*.py") if "__pycache__" not in p.parts}
    expected = {".".join(f.relative_to(SRC).parts) for f in folders}
    assert expected <= set(find_packages(str(SRC)))


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((SRC.parent / "pyproject.toml").read_text())


def test_extras_are_the_ones_the_messages_and_docs_name_and_test_holds_them_all() -> None:
    from gradientflow.diagnostics.extras import EXIT_MISSING_EXTRA, EXTRAS

    extras = _pyproject()["project"]["optional-dependencies"]
    assert set(extras) == {extra for _, extra in EXTRAS.values()} | {"test"}
    for dist, extra in EXTRAS.values():
        assert any(req.startswith(dist) for req in extras[extra]), (dist, extra)
    assert {req for name, reqs in extras.items() if name != "test" for req in reqs} <= set(extras["test"])
    doc = (SRC.parent / "docs/install.md").read_text()
    rows = [line.split("|")[1].strip().strip("`") for line in doc.splitlines() if line.startswith("| `")]
    assert rows == list(extras), "docs/install.md's table of extras, in pyproject's order"
    assert f"exits with status **{EXIT_MISSING_EXTRA}**" in doc
    readme = (SRC.parent / "README.md").read_text()
    assert f"extras: {', '.join(extras)}" in readme and "(docs/install.md)" in readme


def test_the_supported_torch_is_the_one_ci_installs() -> None:
    (torch_req,) = [r for r in _pyproject()["project"]["dependencies"] if r.startswith("torch")]
    ci_torch = next(ln for ln in (SRC.parent / "Makefile").read_text().splitlines() if ln.startswith("TORCH :="))
    tested = ci_torch.split("==")[1].strip()
    assert torch_req == "torch>=" + tested.rsplit(".", 1)[0]  # no older torch than CI's is claimed
    doc = (SRC.parent / "docs/install.md").read_text()
    assert f"| torch | `>={tested.rsplit('.', 1)[0]}` | {tested}, CPU build" in doc


def test_every_data_file_of_the_package_ships() -> None:
    # a file the package reads (the C kernels, the digits) but package-data leaves out exists in a
    # checkout and is missing from a wheel: `pip install .` would run without it
    listed = set(_pyproject()["tool"]["setuptools"]["package-data"]["gradientflow"])
    root = SRC / "gradientflow"
    files = {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }
    assert files == listed
