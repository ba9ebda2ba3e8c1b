"""Warnings raised inside a client's machinery, re-attributed to the user's line.

gradientflow's warnings carry a ``stacklevel`` that names the caller of the wrapper or of
``optimizer.step()``; under Lightning or accelerate that caller is the client's own code (its
precision plugin, its ``prepare_model``), which tells the user nothing.  Python 3.11 has no
``skip_file_prefixes``, so the warnings are recorded and re-issued at the innermost frame that is
not the client's, torch's or gradientflow's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return os.path.dirname(path) + os.sep if path else None


def user_frame(client_packages: tuple[str, ...]) -> tuple[str, int, dict[str, object]]:
    """(filename, lineno, globals) of the innermost frame outside gradientflow, torch and the clients."""
    skipped = tuple(d for d in map(_package_dir, ("gradientflow", "torch", *client_packages)) if d)
    skipped += (os.path.dirname(contextlib.__file__) + os.sep,)  # contextlib and the rest of the stdlib
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals


@contextlib.contextmanager
def attributed_to_user(client_packages: tuple[str, ...]) -> Iterator[None]:
    """Re-issue every warning raised inside the block at the user's frame (filters apply as usual)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    if not caught:
        return
    filename, lineno, module_globals = user_frame(client_packages)
    registry = module_globals.get("__warningregistry__")
    if not isinstance(registry, dict):
        registry = module_globals["__warningregistry__"] = {}
    for w in caught:
        # a recorded warning's message is the Warning instance (the category's, built by warn())
        message = w.message if isinstance(w.message, Warning) else w.category(w.message)
        warnings.warn_explicit(
            message,
            w.category,
            filename,
            lineno,
            module=str(module_globals.get("__name__", "")),
            registry=registry,
            module_globals=dict(module_globals),
        )
