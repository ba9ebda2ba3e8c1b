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
