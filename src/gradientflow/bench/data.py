"""Real data that needs no download: scikit-learn's digits and text shipped with Python."""

from __future__ import annotations

import ast
import codecs
import importlib.util
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Small, stable, pure-Python stdlib modules: their source is English prose and code.
CORPUS_MODULES = ("textwrap", "string", "heapq", "bisect")


def load_digits_split(
    seed: int = 0, test_fraction: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package), split
    stratified by class: ``(x_train [N,1,8,8] float in [0,1], y_train, x_test, y_test)``."""
    from sklearn.datasets import load_digits  # optional dependency: only the demo needs it
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(
        torch.arange(len(y)).numpy(), test_size=test_fraction, random_state=seed, stratify=y.numpy()
    )
    tr, te = torch.from_numpy(idx_train), torch.from_numpy(idx_test)
    return x[tr], y[tr], x[te], y[te]


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's strided shard ``x[rank::world_size]``, after dropping the remainder so every
    rank holds the same number of samples (and so runs the same number of collectives)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
    n = len(x) // world_size * world_size
    return x[rank:n:world_size], y[rank:n:world_size]


def char_corpus(modules: tuple[str, ...] = CORPUS_MODULES) -> str:
    """A small deterministic text: the Zen of Python followed by the source of a few stdlib
    modules (about 50 kB on CPython 3.10-3.13). Same Python version, same text."""
    # `import this` would print the Zen to stdout, so read its rot13 string without running it
    zen_src = _stdlib_source("this")
    zen = next(
        ast.literal_eval(node.value)
        for node in ast.parse(zen_src).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "s"
    )
    parts = [codecs.decode(zen, "rot13")]
    parts += [_stdlib_source(name) for name in modules]
    return "\n".join(parts)


def pydoc_topics_corpus(val_fraction: float = 0.1) -> tuple[str, str]:
    """Python's own help topics (``pydoc_data.topics``: ~465 kB of English prose and code on
    CPython 3.11, shipped with Python) as ``(train, validation)`` text: every topic, in sorted
    order, gives its first ``1 - val_fraction`` to train and the rest to validation, so both
    sides see every kind of topic. Same Python version, same texts."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    from pydoc_data.topics import topics

    train, val = [], []
    for key in sorted(topics):
        text = topics[key]
        cut = round(len(text) * (1 - val_fraction))
        train.append(text[:cut])
        val.append(text[cut:])
    return "\n".join(train), "\n".join(val)


def _stdlib_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise RuntimeError(f"stdlib module {name!r} has no Python source here")
    return Path(spec.origin).read_text(encoding="utf-8")


def char_vocab(text: str) -> list[str]:
    """The sorted set of characters in ``text``: index i encodes character ``vocab[i]``."""
    return sorted(set(text))


def encode(text: str, vocab: list[str]) -> torch.Tensor:
    """Characters -> int64 ids under ``vocab``; an unknown character raises KeyError."""
    stoi = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long)


def decode(ids: torch.Tensor | list[int], vocab: list[str]) -> str:
    """int ids -> text under ``vocab``."""
    return "".join(vocab[int(i)] for i in ids)


def lm_batch(
    ids: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``ids``: inputs [B, T] and next-character targets [B, T]."""
    if len(ids) <= seq_len:
        raise ValueError(f"corpus of {len(ids)} tokens is too short for seq_len {seq_len}")
    starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=generator)
    offs = torch.arange(seq_len)
    return ids[starts[:, None] + offs], ids[starts[:, None] + offs + 1]
