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


def _makefile_torch(variable: str) -> str:
    """The torch version the Makefile pins in ``variable`` (``TORCH := torch==2.13.0`` -> ``"2.13.0"``)."""
    line = next(ln for ln in (SRC.parent / "Makefile").read_text().splitlines() if ln.startswith(f"{variable} :="))
    return line.split("==")[1].strip()


def test_the_supported_torch_is_bounded_by_the_versions_tested() -> None:
    """pyproject asks for torch from the release CI installs (``make test``) to below the release after the newest
    one the suite was run on (``make test-newest``): a new machine without torch installs a tested one, not the
    newest release, whose DDP and FSDP2 internals may have moved. docs/install.md and the README name both, and
    docs/results/torch-versions.md records the newest one's run."""
    pinned, newest = _makefile_torch("TORCH"), _makefile_torch("TORCH_NEWEST")
    major, minor = (int(x) for x in newest.split(".")[:2])
    (torch_req,) = [r for r in _pyproject()["project"]["dependencies"] if r.startswith("torch")]
    assert torch_req == f"torch>={pinned.rsplit('.', 1)[0]},<{major}.{minor + 1}", torch_req
    doc = (SRC.parent / "docs/install.md").read_text()
    assert f"| torch | `{torch_req[len('torch') :]}` | {pinned} and {newest}, on the CPU" in doc
    assert f"Tested with torch {pinned} and {newest}" in (SRC.parent / "README.md").read_text()
    record = (SRC.parent / "docs/results/torch-versions.md").read_text()
    assert f"torch {newest}" in record and f"torch {pinned}" in record


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
