"""``Trainer(strategy="gradientflow")`` after a plain ``import gradientflow``, without importing Lightning.

Lightning resolves a strategy name in its ``StrategyRegistry`` while the ``Trainer`` is built, and
offers no entry point for third-party strategies (its only entry-point group, callbacks, is read
after the strategy is resolved).  So the name must be registered by Python code that runs after
Lightning's strategies module exists and before ``Trainer(...)``:

- Lightning already imported when gradientflow is: register now.
- Not yet: a finder on ``sys.meta_path`` waits for ``pytorch_lightning.strategies`` (or the
  unified package's ``lightning.pytorch.strategies``) to finish importing and registers then.
  It costs nothing until that import and removes itself once both names are handled.

Without ``import gradientflow`` nothing of ours runs, so a script must import it (or
``gradientflow.integrations.lightning``) before building the ``Trainer``; installing code that
runs at every interpreter start (a ``.pth`` file) to avoid that one line is not worth its cost.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

# Lightning's strategies modules (standalone package, unified package) -> the namespace they live in.
WATCHED = {"pytorch_lightning.strategies": "pytorch_lightning", "lightning.pytorch.strategies": "lightning.pytorch"}


def register(namespace: str) -> None:
    """Add gradientflow's strategy names to ``namespace``'s registry (a no-op if already there)."""
    from .lightning import strategy_class

    strategies = sys.modules[f"{namespace}.strategies"]
    strategy_class(namespace).register_strategies(strategies.StrategyRegistry)


class _Loader(importlib.abc.Loader):
    """The real loader, then :func:`register` once the module is fully executed."""

    def __init__(self, inner: importlib.abc.Loader, namespace: str) -> None:
        self.inner, self.namespace = inner, namespace

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        register(self.namespace)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        namespace = WATCHED.get(fullname)
        if namespace is None:
            return None
        for finder in sys.meta_path:  # the spec the import would have used without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, namespace)
                return spec
        return None


def install() -> None:
    """Register where Lightning is already imported; watch for the imports that have not happened."""
    pending = False
    for module, namespace in WATCHED.items():
        if module in sys.modules:
            register(namespace)
        else:
            pending = True
    if pending and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
