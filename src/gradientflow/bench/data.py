"""Real data that needs no download: the handwritten digits shipped with the package, text shipped with Python."""

from __future__ import annotations

import ast
import codecs
import importlib.util
import logging
import math
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Small, stable, pure-Python stdlib modules: their source is English prose and code.
CORPUS_MODULES = ("textwrap", "string", "heapq", "bisect")


DIGITS_FILE = Path(__file__).with_name("datasets") / "digits.npz"
"""The UCI ML hand-written digits test set as scikit-learn ships it (``sklearn.datasets.load_digits``:
1797 8x8 images, pixels 0..16), saved as uint8 so that a plain install runs the demo without
scikit-learn; CC BY 4.0, attribution in ``datasets/README.md``."""


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 digits as ``(pixels [1797, 64] float in [0, 1], labels [1797] int64)``, in
    scikit-learn's order (``load_digits(return_X_y=True)`` / 16)."""
    import numpy as np

    with np.load(DIGITS_FILE) as f:
        pixels, labels = f["pixels"], f["labels"]
    return torch.from_numpy(pixels.astype(np.float32) / 16.0), torch.from_numpy(labels.astype(np.int64))


def stratified_split(labels: torch.Tensor, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The train and test indices scikit-learn's ``train_test_split(arange(n), test_size=test_fraction,
    random_state=seed, stratify=labels)`` returns (its ``StratifiedShuffleSplit`` step by step, on the
    same numpy ``RandomState`` draws), so the demo and ``bench --quality`` keep the split their
    published figures were measured on, without scikit-learn (tests/test_models.py compares the two)."""
    import numpy as np

    y = labels.numpy()
    n = len(y)
    n_test = math.ceil(test_fraction * n)
    n_train = n - n_test
    _, y_idx, counts = np.unique(y, return_inverse=True, return_counts=True)
    if counts.min() < 2 or min(n_train, n_test) < len(counts):
        raise ValueError(f"cannot stratify {n} samples of {len(counts)} classes with test_fraction={test_fraction}")
    by_class = np.split(np.argsort(y_idx, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(counts, n_train, rng)
    t_i = _approximate_mode(counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i, members in enumerate(by_class):
        shuffled = members.take(rng.permutation(counts[i]), mode="clip")
        train.extend(shuffled[: n_i[i]])
        test.extend(shuffled[n_i[i] : n_i[i] + t_i[i]])
    return torch.from_numpy(rng.permutation(train)), torch.from_numpy(rng.permutation(test))


def _approximate_mode(counts: Any, n_draws: int, rng: Any) -> Any:
    """scikit-learn's ``_approximate_mode``: samples per class for ``n_draws`` draws, the floors of the
    proportional shares topped up by the largest remainders (ties broken by ``rng``, as there)."""
    import numpy as np

    continuous = counts / counts.sum() * n_draws
    floored = np.floor(continuous)
    need = int(n_draws - floored.sum())
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1]:
        if need <= 0:
            break
        (inds,) = np.where(remainder == value)
        add_now = min(len(inds), need)
        floored[rng.choice(inds, size=add_now, replace=False)] += 1
        need -= add_now
    return floored.astype(int)


def load_digits_split(
    seed: int = 0, test_fraction: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8x8 handwritten digits (1797 images, shipped with the package), split stratified by class
    as scikit-learn's ``train_test_split`` would: ``(x_train [N,1,8,8] float in [0,1], y_train, x_test,
    y_test)``."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    pixels, y = load_digits()
    x = pixels.reshape(-1, 1, 8, 8)
    tr, te = stratified_split(y, test_fraction, seed)
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


STDLIB_VAL_EVERY = 20
"""The standard library corpus: every 20th source file (in path order) is validation, never trained on."""


def stdlib_sources(val_every: int = STDLIB_VAL_EVERY) -> tuple[bytes, bytes]:
    """The Python standard library's own sources as ``(train, validation)`` bytes: every ``*.py`` under
    ``sysconfig``'s stdlib directory (``site-packages`` left out), in the order of their relative paths, each file's
    UTF-8 bytes; file ``i`` goes to validation where ``i % val_every == 0``, so validation is whole files the run
    never sees (31.5 MB in 1,790 files on CPython 3.11.7: a 4,000-step run of 4 ranks x 16 x 64 bytes sees half of
    it once).  It ships with every Python, so a quality measured on it needs no download; same Python, same bytes.
    Used where a run must not exhaust its corpus (the help topics, 465 kB, are overfitted within a few thousand
    steps, so averaging replicas there reads as quality that is only regularisation)."""
    import sysconfig

    if val_every < 2:
        raise ValueError(f"val_every must be at least 2 (one file in val_every is validation), got {val_every}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise RuntimeError(f"no Python sources under {root}: this Python ships its standard library compiled only")
    train: list[bytes] = []
    val: list[bytes] = []
    for i, path in enumerate(files):
        (val if i % val_every == 0 else train).append(path.read_bytes())
    return b"\n".join(train), b"\n".join(val)


def byte_ids(data: bytes) -> torch.Tensor:
    """Bytes as token ids 0..255 (uint8: 1 byte per token held; index with it, then ``.long()`` the batch)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


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
