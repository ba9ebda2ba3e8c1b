"""The optional packages: which extra of ``pip install 'gradientflow[EXTRA]'`` installs each, and the
one-line stop when one is missing.

A plain ``pip install gradientflow`` runs the library, ``gradientflow demo``, ``bench`` and
``simulate``. Where a command can do its job without an optional package (a plot), it goes on
and says what it skipped (:func:`have`, :data:`NO_PLOT`); where it cannot (torch's test suite
needs expecttest, the integrations need their client), it checks with :func:`require` before any
rank or long work starts, and the ``gradientflow`` command turns :class:`MissingExtra` into one
line naming the extra and exit status :data:`EXIT_MISSING_EXTRA` (no traceback). docs/install.md
lists the extras; tests/test_extras.py runs every subcommand with each of these packages made
unimportable.
"""

from __future__ import annotations

import importlib
import sys

EXTRAS: dict[str, tuple[str, str]] = {
    # import name: (the distribution pip installs, the extra that installs it)
    "matplotlib": ("matplotlib", "plot"),
    "expecttest": ("expecttest", "torch-suite"),
    "pytorch_lightning": ("pytorch-lightning", "lightning"),
    "accelerate": ("accelerate", "accelerate"),
    "transformers": ("transformers", "transformers"),
    "torchft": ("torchft", "torchft"),
}

EXIT_MISSING_EXTRA = 3
"""The exit status of a ``gradientflow`` command stopped for a missing optional package (2 is
argparse's for a bad option; 1 a failed run)."""


def install_hint(module: str) -> str:
    """``pip install 'gradientflow[EXTRA]'`` for an optional package's import name."""
    _, extra = EXTRAS[module]
    return f"pip install 'gradientflow[{extra}]'"


NO_PLOT = f"no plot written ({install_hint('matplotlib')})"
"""What a command prints instead of a plot when matplotlib is not installed."""


class MissingExtra(ModuleNotFoundError):
    """An optional package a command or integration needs is not installed; the message names the
    extra that installs it.  A ``ModuleNotFoundError``, as the failed import it replaces."""

    def __init__(self, module: str, what: str) -> None:
        dist, extra = EXTRAS[module]
        super().__init__(f"{what} needs {dist}: {install_hint(module)}", name=module)
        self.extra = extra


_said_no_plot = False


def can_plot() -> bool:
    """Whether matplotlib imports here; the first time it does not, one line says no plot is written
    and how to get plots (once per process: a command drawing several plots says it once)."""
    global _said_no_plot
    if have("matplotlib"):
        return True
    if not _said_no_plot:
        print(NO_PLOT, file=sys.stderr, flush=True)
        _said_no_plot = True
    return False


def have(module: str) -> bool:
    """Whether the optional package imports here (imported, so a broken install counts as missing)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def require(module: str, what: str) -> None:
    """Stop with :class:`MissingExtra` unless the optional package ``module`` imports; ``what`` says
    what needs it (``"gradientflow torch-suite"``)."""
    if not have(module):
        raise MissingExtra(module, what)
