"""How the engine hangs on autograd: hooks that do not keep the engine alive, and the output walk."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch


def weak_hook(reducer: Any, method: Callable[..., None], *bound: int) -> Callable[[torch.Tensor], None]:
    """``method(reducer, *bound, tensor)`` as an autograd hook that does not keep ``reducer`` alive.

    A hook lives on a parameter (or in a kept loss's graph), the reducer holds the parameters, and
    autograd keeps hooks where Python's collector cannot see the cycle: a strong reference kept the
    reducer, its pool, the model and the process group alive after ``del model``, past
    ``destroy_process_group()`` into interpreter shutdown, where Gloo can abort the process.
    """
    me = weakref.ref(reducer)

    def hook(tensor: torch.Tensor) -> None:
        alive = me()
        if alive is not None:
            method(alive, *bound, tensor)

    return hook


def remove_handles(handles: list[Any]) -> None:
    """Remove hooks by their handles (a finalizer's callback: holds the handles, not their owner)."""
    for h in handles:
        h.remove()


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a forward's output (tuples, namedtuples, lists, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_tensors(o)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
