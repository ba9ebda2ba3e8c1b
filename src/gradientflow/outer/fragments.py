"""Streaming's fragments: which parameters each holds, and the steps each is synchronised at (pure functions)."""

from __future__ import annotations


def cut(sizes: list[int], parts: int) -> list[list[int]]:
    """The parameters (their element counts ``sizes``, in order) cut into ``parts`` runs of whole tensors, about
    equal in elements: run f ends at the first tensor that reaches ``(f + 1) / parts`` of the total, or earlier
    when every later run would otherwise be left without a tensor.  Fewer tensors than ``parts``: the last runs
    are empty (:func:`check_cut` refuses that)."""
    total = sum(sizes)
    runs: list[list[int]] = [[] for _ in range(parts)]
    seen = 0
    f = 0
    for i, n in enumerate(sizes):
        runs[f].append(i)
        seen += n
        left = len(sizes) - 1 - i  # tensors still to place; every later run gets at least one while they last
        if f < parts - 1 and (seen * parts >= (f + 1) * total or left == parts - 1 - f):
            f += 1
    return runs


def check_cut(runs: list[list[int]], n_tensors: int) -> None:
    """``ValueError`` when a fragment would be empty (more fragments than tensors)."""
    if any(not r for r in runs):
        raise ValueError(
            f"sync_fragments={len(runs)} is more than the model's {n_tensors} trainable tensors (fragments hold whole "
            f"tensors): pass sync_fragments <= {n_tensors}."
        )


def offset(fragment: int, parts: int, every: int) -> int:
    """The step count at which fragment ``fragment`` is first synchronised: ``(f + 1) * H // F`` (the last
    fragment at H, as without fragments; the others spread evenly before it)."""
    return (fragment + 1) * every // parts


def due(steps: int, fragment: int, parts: int, every: int) -> bool:
    """Whether ``fragment`` is synchronised once ``steps`` optimizer steps are done: at its offset, then every H."""
    first = offset(fragment, parts, every)
    return steps >= first and (steps - first) % every == 0
