"""CSC's accumulate-and-score kernel: v gets torch's bits, the scores the chunks' L1 norms."""

from __future__ import annotations

import pytest
import torch

from gradientflow.strategies import csc_native

pytestmark = pytest.mark.skipif(not csc_native.available(), reason="no C compiler here")

# Summing n positive fp32 values in any order is within (n - 1) * 2**-24 of the exact sum, relatively;
# the kernel and torch's pass sum in different orders, so each is that close to the truth.
CHUNK = 100


def _bound(n: int) -> float:
    return 2 * n * 2.0**-24


@pytest.mark.parametrize(("offset", "n"), [(0, 1000), (37, 450), (99, 2), (250, 0), (0, 100), (3, 16)])
def test_add_l1_adds_like_torch_and_scores_each_chunk_it_wrote(offset: int, n: int) -> None:
    gen = torch.Generator().manual_seed(offset + n)
    pool = torch.randn(1200, generator=gen)
    g = torch.randn(n, generator=gen)
    expect = pool.clone()
    expect[offset : offset + n].add_(g)
    scores = torch.full((12,), 0.5)  # partial sums of earlier calls: the kernel adds to them
    csc_native.add_l1(pool[offset : offset + n], g, offset, CHUNK, scores)
    assert torch.equal(pool, expect)  # the same fp32 add, bit for bit
    written = torch.zeros(1200)
    written[offset : offset + n] = expect[offset : offset + n].abs()
    want = written.view(12, CHUNK).sum(1) + 0.5
    assert torch.allclose(scores, want, rtol=_bound(CHUNK), atol=0)


def test_pieces_of_a_chunk_from_several_parameters_sum_to_its_score() -> None:
    pool = torch.zeros(300)
    grads = [torch.randn(k, generator=torch.Generator().manual_seed(k)) for k in (70, 90, 140)]
    scores = torch.zeros(3)
    at = 0
    for g in grads:
        csc_native.add_l1(pool[at : at + g.numel()], g, at, CHUNK, scores)
        at += g.numel()
    want = torch.cat(grads).abs().view(3, CHUNK).sum(1)
    assert torch.allclose(scores, want, rtol=_bound(CHUNK), atol=0)


def test_non_finite_values_reach_the_score() -> None:
    v, g, scores = torch.zeros(8), torch.ones(8), torch.zeros(1)
    g[3] = float("inf")
    csc_native.add_l1(v, g, 0, 8, scores)
    assert scores.item() == float("inf")


def test_too_few_scores_is_an_error_not_a_write_past_the_end() -> None:
    with pytest.raises(ValueError, match="at least 3 chunks"):
        csc_native.add_l1(torch.zeros(50), torch.zeros(50), 180, CHUNK, torch.zeros(2))


def _rows_with_specials(n: int, chunk: int, seed: int) -> torch.Tensor:
    rows = torch.randn(n, chunk, generator=torch.Generator().manual_seed(seed)) * 300
    rows.view(-1)[:8] = torch.tensor([0.0, -0.0, 1e-8, -6e-5, 65504.0, 65520.0, 7e4, 2.0**-25])
    return rows


# Chunks of 48: 8-wide vectors only; 45: vectors and a scalar tail of 5 (both code paths of the kernel).
@pytest.mark.parametrize("chunk", [48, 45])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1.0 / 3])
def test_pack_rows_gives_the_bits_of_index_select_mul_and_cast(scale: float, chunk: int) -> None:
    rows = _rows_with_specials(9, chunk, 1)
    rows[3, -5:] = torch.tensor([65519.0, -65520.0, 3e-8, -0.0, 1.5e4])  # specials in the tail too
    idx = torch.tensor([0, 2, 3, 8])
    wire = torch.empty(4 * chunk, dtype=torch.float16)
    csc_native.pack_rows(rows, idx, scale, wire)
    expect = torch.index_select(rows, 0, idx).mul_(scale).to(torch.float16)  # CSC's torch path
    assert torch.equal(wire.view(4, chunk).view(torch.int16), expect.view(torch.int16))  # every bit, -0 included


@pytest.mark.parametrize("chunk", [16, 13])
def test_unpack_rows_writes_the_floats_of_the_wire_and_flags_an_overflow(chunk: int) -> None:
    dst = torch.zeros(6, chunk)
    idx = torch.tensor([1, 4])
    wire = torch.randn(2 * chunk, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    wire[3] = 65504.0  # the largest finite fp16 is not an overflow
    assert csc_native.unpack_rows(dst, idx, wire)  # all finite
    expect = torch.zeros(6, chunk)
    expect.index_copy_(0, idx, wire.view(2, chunk).float())
    assert torch.equal(dst, expect)
    for at in (2, chunk + 1, 2 * chunk - 1):  # in a vector, in the second row, in the last (tail) element
        for bad in (float("inf"), float("-inf"), float("nan")):
            w = wire.clone()
            w[at] = bad
            assert not csc_native.unpack_rows(dst, idx, w), (at, bad)


def test_pack_and_unpack_refuse_rows_they_would_read_past() -> None:
    rows, wire = torch.zeros(4, 8), torch.zeros(16, dtype=torch.float16)
    with pytest.raises(IndexError):
        csc_native.pack_rows(rows, torch.tensor([1, 4]), 1.0, wire)
    with pytest.raises(ValueError, match="len\\(idx\\) rows"):
        csc_native.unpack_rows(rows, torch.tensor([1]), wire)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_zero_rows_clears_exactly_the_indexed_rows(chunk: int) -> None:
    rows = torch.randn(9, chunk)
    rows[4, 0] = float("nan")  # a non-finite value in a cleared row becomes +0.0 too
    expect = rows.clone().index_fill_(0, torch.tensor([0, 4, 8]), 0.0)
    csc_native.zero_rows(rows, torch.tensor([8, 0, 4]))  # any order
    assert torch.equal(rows, expect) and not torch.signbit(rows[[0, 4, 8]]).any()
    with pytest.raises(IndexError):
        csc_native.zero_rows(rows, torch.tensor([9]))
    with pytest.raises(TypeError):
        csc_native.zero_rows(rows.double(), torch.tensor([0]))
