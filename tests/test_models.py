"""Benchmark models and real data: parameter counts, shapes on small inputs, quick training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradientflow.bench.data import (
    char_corpus,
    char_vocab,
    decode,
    encode,
    lm_batch,
    load_digits,
    load_digits_split,
    shard,
    stratified_split,
)
from gradientflow.bench.models import (
    ALEXNET_MIN_SIZE,
    WORKLOADS,
    alexnet,
    build_model,
    resnet50,
    small_cnn,
    synthetic_batch,
    tiny_transformer,
)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and on a busy 2-core machine a second
    thread makes small convolutions ~10x slower through contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet50_matches_torchvision_count_and_runs_at_32():
    torch.manual_seed(0)
    model = resnet50()
    assert n_params(model) == 25_557_032  # torchvision.models.resnet50()
    assert n_params(resnet50(num_classes=10)) == 25_557_032 - 2049 * 990
    x, _ = synthetic_batch("resnet50", 2, seed=0)
    assert x.shape == (2, 3, 32, 32)
    out = model(x)
    assert out.shape == (2, 1000) and torch.isfinite(out).all()


def test_alexnet_count_and_smallest_input():
    model = alexnet().eval()
    assert n_params(model) == 61_100_840  # torchvision.models.alexnet()
    assert WORKLOADS["alexnet"].input_shape == (3, 64, 64)
    with torch.no_grad():
        for size in (ALEXNET_MIN_SIZE, 64):
            assert model(torch.randn(1, 3, size, size)).shape == (1, 1000)
        # one pixel less and the last max-pool has nothing left: the reason for the minimum
        small = torch.randn(1, 3, ALEXNET_MIN_SIZE - 1, ALEXNET_MIN_SIZE - 1)
        with pytest.raises(RuntimeError, match="too small"):
            model.features(small)
        with pytest.raises(ValueError, match="at least 63x63"):
            model(torch.randn(1, 3, 32, 32))


def test_synthetic_batches_are_deterministic_and_shaped():
    for name, w in WORKLOADS.items():
        x1, y1 = synthetic_batch(name, 3, seed=7)
        x2, y2 = synthetic_batch(name, 3, seed=7)
        x3, _ = synthetic_batch(name, 3, seed=8)
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
        assert x1.shape == (3, *w.input_shape)
        assert int(y1.max()) < w.num_classes
    with pytest.raises(ValueError, match="unknown model"):
        build_model("vgg16")


def test_small_cnn_learns_digits():
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_digits_split(seed=0)
    assert x_tr.shape[1:] == (1, 8, 8) and 0.0 <= float(x_tr.min()) and float(x_tr.max()) <= 1.0
    assert len(x_tr) + len(x_te) == 1797
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    loss_fn = nn.CrossEntropyLoss()
    with torch.no_grad():
        loss0 = float(loss_fn(model(x_tr), y_tr))
    gen = torch.Generator().manual_seed(0)
    for step in range(150):  # about 7 epochs at batch 64
        idx = torch.randint(0, len(x_tr), (64,), generator=gen)
        loss = loss_fn(model(x_tr[idx]), y_tr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 4:  # a couple of steps already help
            with torch.no_grad():
                assert float(loss_fn(model(x_tr), y_tr)) < loss0
    with torch.no_grad():
        acc = (model(x_te).argmax(1) == y_te).float().mean().item()
    assert acc > 0.95, acc


def test_tiny_transformer_is_causal_and_learns_text():
    torch.manual_seed(0)
    text = char_corpus()
    assert text.startswith("The Zen of Python") and 10_000 < len(text) < 200_000
    assert char_corpus() == text
    vocab = char_vocab(text)
    ids = encode(text, vocab)
    assert decode(ids[:500], vocab) == text[:500]
    model = tiny_transformer(len(vocab), d_model=64, n_layers=2, n_heads=4, seq_len=32)
    x, y = lm_batch(ids, 8, 32, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])
    logits = model(x)
    assert logits.shape == (8, 32, len(vocab))
    # changing the last token must not change any earlier position's logits
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % len(vocab)
    with torch.no_grad():
        diff = (model(x) - model(x2)).abs()
    assert diff[:, :-1].max() < 1e-5 and diff[:, -1].max() > 1e-4
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(40):
        xb, yb = lm_batch(ids, 16, 32, gen)
        loss = nn.functional.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5, losses


def test_shard_is_equal_disjoint_and_strided():
    x = torch.arange(23).float()
    y = torch.arange(23)
    shards = [shard(x, y, r, 4) for r in range(4)]
    assert all(len(sx) == 5 and len(sy) == 5 for sx, sy in shards)  # 23 -> 20, 3 dropped
    seen = torch.cat([sy for _, sy in shards]).sort().values
    assert torch.equal(seen, torch.arange(20))
    assert torch.equal(shards[1][1], torch.tensor([1, 5, 9, 13, 17]))
    with pytest.raises(ValueError):
        shard(x, y, 4, 4)


def test_digits_wide_is_fully_connected_heavy():
    """8.4M parameters for 8x8 digits, all but 320 of them in the three linear layers."""
    m = build_model("digits_wide")
    n = sum(p.numel() for p in m.parameters())
    conv = 1 * 32 * 9 + 32
    assert n == conv + (2048 * 2048 + 2048) * 2 + 2048 * 10 + 10
    assert m(torch.randn(4, 1, 8, 8)).shape == (4, 10)


def test_shipped_digits_and_split_are_scikit_learns():
    """The digits shipped in the package and their split are scikit-learn's (where it is installed): the
    demo and the quality figures keep their data without scikit-learn."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    from sklearn.model_selection import train_test_split

    x, y = load_digits()
    ref = sklearn_datasets.load_digits()
    assert torch.equal(x, torch.tensor(ref.data / 16.0, dtype=torch.float32))
    assert torch.equal(y, torch.tensor(ref.target, dtype=torch.int64))
    for seed in (0, 1, 7):
        for fraction in (0.2, 0.1, 0.5):
            tr, te = train_test_split(torch.arange(len(y)).numpy(), test_size=fraction, random_state=seed, stratify=y)
            mine = stratified_split(y, fraction, seed)
            assert mine[0].tolist() == tr.tolist() and mine[1].tolist() == te.tolist(), (seed, fraction)
