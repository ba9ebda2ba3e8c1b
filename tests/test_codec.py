"""The CPU quantisation kernel (comm/codec.c) against the torch-ops codec: the same bytes, the same floats.

Both paths must agree bit for bit, because ranks may differ in whether they could build the kernel and
every rank must decode a message to the same floats.  Inputs cover what changes a block's arithmetic:
ragged last blocks, all-zero blocks, subnormal blocks, ±0, values on a level's midpoint, inf and NaN.
"""

from __future__ import annotations

import pytest
import torch

from gradientflow.comm import codec_native
from gradientflow.comm.levels import CODEBOOKS, ZEROLESS
from gradientflow.comm.levels import mids as level_mids
from gradientflow.comm.quantize import (
    SCALE_DTYPE,
    code_bytes,
    dequantize,
    encode,
    quantize,
    wire_bytes,
)

pytestmark = pytest.mark.skipif(codec_native.library() is None, reason="no C compiler here")

TABLES = [(bits, "fitted") for bits in sorted(CODEBOOKS)] + [(bits, "zeroless") for bits in sorted(ZEROLESS)]
"""Every table the kernel has: with a zero level (``CODEBOOKS``) and without (``ZEROLESS``, ``"q2n"``)."""


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (so -0.0 != 0.0), except that any NaN equals any NaN: torch's own vectorised and
    scalar fp32 -> bf16 conversions write different NaN bytes (0xFFFF, 0x7FC0), and a NaN block decodes
    to NaN whatever its scale's bytes."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_native, "applies", lambda *t: False)


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    heavy = torch.randn(5000, generator=g) * torch.rand(5000, generator=g) ** 4  # most of a block far below its max
    edges = torch.zeros(384)
    edges[:128] = torch.randn(128, generator=g) * 1e-41  # subnormal: a tiny scale
    edges[128] = -0.0
    # block 2: values exactly on each midpoint of a block whose max is 1 (a tie goes toward 0)
    mids = torch.tensor([m for bits, levels in TABLES for m in level_mids(bits, levels)])
    edges[256 : 256 + len(mids)] = mids
    edges[256 + len(mids) : 256 + 2 * len(mids)] = -mids
    edges[300] = 1.0
    nonfinite = torch.randn(300, generator=g)
    nonfinite[5], nonfinite[140] = float("inf"), float("nan")
    return [heavy, heavy[:1001], edges, nonfinite, torch.randn(7, generator=g), torch.zeros(0)]


@pytest.mark.parametrize(("bits", "levels"), TABLES)
@pytest.mark.parametrize("block", [16, 128, 1024])
def test_kernel_matches_torch_ops_bit_for_bit(
    bits: int, levels: str, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for x in _inputs():
        m = x.numel()
        wire_k, err_k = torch.empty(wire_bytes(m, bits, block), dtype=torch.uint8), torch.empty(m)
        dec_k = quantize(x, wire_k, bits, block, err=err_k, levels=levels)
        back_k = dequantize(wire_k, m, bits, block, levels=levels)
        acc_k = dequantize(wire_k, m, bits, block, levels=levels, out=x.clone(), add=True)
        with monkeypatch.context() as mp:
            _torch_path(mp)
            wire_t, err_t = torch.empty_like(wire_k), torch.empty(m)
            dec_t = quantize(x, wire_t, bits, block, err=err_t, levels=levels)
            back_t = dequantize(wire_t, m, bits, block, levels=levels)
            acc_t = dequantize(wire_t, m, bits, block, levels=levels, out=x.clone(), add=True)
        cb = code_bytes(m, bits, block)
        assert torch.equal(wire_k[:cb], wire_t[:cb]), (bits, block, m)  # every code
        scale_k, scale_t = wire_k[cb:].view(SCALE_DTYPE).float(), wire_t[cb:].view(SCALE_DTYPE).float()
        assert _same_floats(scale_k, scale_t), (bits, block, m)
        for k, t in [(dec_k, dec_t), (err_k, err_t), (back_k, back_t), (acc_k, acc_t)]:
            assert _same_floats(k, t), (bits, block, m)


@pytest.mark.parametrize(("bits", "levels"), TABLES)
def test_carry_encodes_x_plus_the_last_error_as_adding_it_first(
    bits: int, levels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Error feedback fused into the encode: ``quantize(x, err=e, carry=True)`` is ``x += e`` then
    ``quantize(x, err=e)``, on both paths, to the bit."""
    g = torch.Generator().manual_seed(2)
    x, e = torch.randn(1000, generator=g), torch.randn(1000, generator=g) * 0.1
    wire = torch.empty(wire_bytes(1000, bits, 128), dtype=torch.uint8)
    ref_x, ref_e, ref_wire = x + e, torch.empty(1000), torch.empty_like(wire)
    with monkeypatch.context() as mp:
        _torch_path(mp)
        quantize(ref_x, ref_wire, bits, 128, err=ref_e, inplace=True, levels=levels)
    for path in ("kernel", "torch"):
        xs, es = x.clone(), e.clone()
        with monkeypatch.context() as mp:
            if path == "torch":
                _torch_path(mp)
            assert quantize(xs, wire, bits, 128, err=es, inplace=True, carry=True, levels=levels) is xs
        assert torch.equal(wire, ref_wire) and torch.equal(xs, ref_x) and torch.equal(es, ref_e), path
    with pytest.raises(ValueError, match="inplace=True"):
        quantize(x, wire, bits, 128, err=e, carry=True)


def test_inplace_writes_the_decoded_values_over_the_input() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    wire = torch.empty(wire_bytes(1000, 3, 128), dtype=torch.uint8)
    expected = quantize(x, wire, 3, 128)
    y = x.clone()
    assert quantize(y, wire, 3, 128, inplace=True) is y
    assert torch.equal(y, expected)


def test_a_cpu_segment_takes_the_kernel() -> None:
    """Not a timing claim (see docs/results/adamw.md), only that the dispatch reaches the kernel: a CPU segment
    must not take the torch ops' ~40 passes."""
    calls: list[int] = []
    lib = codec_native.library()
    assert lib is not None
    x = torch.randn(4096)
    wire = torch.empty(wire_bytes(4096, 3, 128), dtype=torch.uint8)
    orig = codec_native.quantize
    try:
        codec_native.quantize = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]  # type: ignore[assignment]
        quantize(x, wire, 3, 128)
    finally:
        codec_native.quantize = orig  # type: ignore[assignment]
    assert calls == [1]


def _history(n: int, kind: str) -> torch.Tensor:
    """A preconditioner's q: squared gradients spread over decades, with the cases that change r's arithmetic."""
    g = torch.Generator().manual_seed(1)
    if kind == "none":  # no history yet: r = 1
        return torch.zeros(n)
    q = (torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4).square() * 10 ** torch.randint(
        -8, 2, (n,), generator=g
    )
    if kind == "holes":  # coordinates the warm-up decoded to 0 (q = 0: the window floor), a window all zero
        q[::7] = 0.0
        q[128:256] = 0.0
    return q


@pytest.mark.parametrize("n", [1000, 1024, 37, 0, 200_000])
@pytest.mark.parametrize("kind", ["spread", "holes", "none"])
@pytest.mark.parametrize("lo", [0, 256])
def test_preconditioner_kernel_matches_torch_ops_bit_for_bit(
    n: int, kind: str, lo: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preconditioner's fused passes (``Root``: r recomputed where it is used) against ``precondition_root``
    and the torch ops, on a whole bucket (``lo`` 0) and on a two-level shard of it starting at ``lo``: divide
    before the ring, then multiply back and update q's EMA after it."""
    from gradientflow.exchange import precondition
    from gradientflow.exchange.precondition import Root

    q = _history(n + lo, kind)
    g = torch.Generator().manual_seed(2)
    x, e = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    ring_out = torch.randn(n, generator=g)  # what the ring hands back, in r's units
    ring_err = torch.randn(n, generator=g) * 0.05

    def run(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        root = Root(q)
        xs, es = x.clone(), e.clone()
        root.divide(xs, es, lo=lo)
        sent = xs.clone()
        xs.copy_(ring_out)
        es.copy_(ring_err)
        root.restore(xs, es, lo=lo, ema=True)
        return sent, xs, es, q, root.r is None

    *fused, took_kernel = run(q.clone())
    assert took_kernel or n + lo == 0 or not codec_native.applies(q)
    monkeypatch.setattr(precondition.codec_native, "applies", lambda *t: False)
    *reference, took_kernel = run(q.clone())
    assert not took_kernel
    for a, b in zip(fused, reference):
        assert _same_floats(a, b)


@pytest.mark.parametrize(("bits", "levels"), [*TABLES, (2, "uniform")])
@pytest.mark.parametrize("n", [1000, 37, 0, 70_000])
@pytest.mark.parametrize(("lo", "block"), [(0, 128), (200, 128), (256, 16), (0, 1024)])
def test_preconditioner_folded_into_the_codec_equals_its_own_passes(
    bits: int, levels: str, n: int, lo: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A two-rank exchange of the preconditioned recipe with ``Root.fused``: ``(x + e) / r`` made block by block
    inside the quantiser's pass and the multiply-back (result, error, q's EMA) inside the decoder's, against
    divide -> quantise -> decode-and-add -> restore as passes of their own in torch ops: the same bytes on
    the wire and the same floats after, for every table, blocks smaller and larger than the preconditioner's
    windows, a bucket slice starting mid-window (``lo`` 200), and a quantiser the kernel lacks (``"uniform"``:
    the divide and restore fall back to passes of their own)."""
    from gradientflow.exchange.precondition import Root

    q = _history(n + lo, "holes")
    g = torch.Generator().manual_seed(3)
    x, e = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    peer = torch.empty(wire_bytes(n, bits, block), dtype=torch.uint8)
    quantize(torch.randn(n, generator=g), peer, bits, block, levels=levels)  # what the other rank sent

    qa, xa, ea = q.clone(), x.clone(), e.clone()
    root = Root(qa)
    fused = root.fused(xa, ea, lo=lo)
    assert fused is not None  # CPU, fp32, contiguous: the kernel takes them
    wire_a = torch.empty_like(peer)
    quantize(xa, wire_a, bits, block, ea, levels=levels, inplace=True, carry=True, fused=fused)
    dequantize(peer, n, bits, block, levels, out=xa, add=True, fused=fused, err=ea)

    _torch_path(monkeypatch)
    qb, xb, eb = q.clone(), x.clone(), e.clone()
    root = Root(qb)
    assert root.fused(xb, eb, lo=lo) is None
    root.divide(xb, eb, lo=lo)
    wire_b = torch.empty_like(peer)
    quantize(xb, wire_b, bits, block, eb, levels=levels, inplace=True)
    dequantize(peer, n, bits, block, levels, out=xb, add=True)
    root.restore(xb, eb, lo=lo, ema=True)

    assert torch.equal(wire_a, wire_b)
    for a, b in [(xa, xb), (ea, eb), (qa, qb)]:
        assert _same_floats(a, b)


def test_fused_preconditioner_needs_the_error_it_folds_in() -> None:
    """``fused`` divides ``x + err`` and restores ``err``: without ``carry`` / ``err`` it is refused, not ignored."""
    from gradientflow.exchange.precondition import Root

    x, e = torch.randn(256), torch.zeros(256)
    fused = Root(torch.rand(256)).fused(x, e)
    wire = torch.empty(wire_bytes(256, 2, 128), dtype=torch.uint8)
    with pytest.raises(ValueError, match="carry=True"):
        quantize(x, wire, 2, 128, e, inplace=True, fused=fused)
    with pytest.raises(ValueError, match="pass both"):
        dequantize(wire, 256, 2, 128, out=x, add=True, fused=fused)


@pytest.mark.parametrize(("bits", "levels"), [*TABLES, (2, "uniform")])
@pytest.mark.parametrize("n", [1000, 37, 0, 70_000])
@pytest.mark.parametrize("precondition", [False, True])
def test_an_exchange_decoding_its_own_codes_beside_the_peers_equals_decoding_into_its_own_values(
    bits: int, levels: str, n: int, precondition: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A two-rank exchange on CPU: ``encode`` writes codes and error only, and ``dequantize(own, second=peer)``
    decodes both messages in one pass (``own + peer``), against ``quantize(inplace=True)`` (x = own decoded) and
    ``dequantize(peer, add=True)`` in torch ops: the same bytes, the same floats (with the preconditioner folded
    in or not; ``"uniform"``: a quantiser the kernel lacks, where ``encode`` leaves the decoded values in x)."""
    from gradientflow.exchange.precondition import Root

    q = _history(n, "holes")
    g = torch.Generator().manual_seed(4)
    x, e = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    peer = torch.empty(wire_bytes(n, bits, 128), dtype=torch.uint8)
    quantize(torch.randn(n, generator=g), peer, bits, 128, levels=levels)

    qa, xa, ea = q.clone(), x.clone(), e.clone()
    fused = Root(qa).fused(xa, ea) if precondition else None
    own = torch.empty_like(peer)
    skipped = encode(xa, own, bits, 128, ea, levels=levels, carry=True, fused=fused)
    assert skipped == (levels != "uniform")  # the kernel does not write the decoded values
    if skipped:
        dequantize(own, n, bits, 128, levels, out=xa, fused=fused, err=ea, second=peer)
    else:
        dequantize(peer, n, bits, 128, levels, out=xa, add=True, fused=fused, err=ea)

    _torch_path(monkeypatch)
    qb, xb, eb = q.clone(), x.clone(), e.clone()
    root = Root(qb)
    if precondition:
        root.divide(xb, eb)
    else:
        xb.add_(eb)
    wire_b = torch.empty_like(peer)
    quantize(xb, wire_b, bits, 128, eb, levels=levels, inplace=True)
    dequantize(peer, n, bits, 128, levels, out=xb, add=True)
    if precondition:
        root.restore(xb, eb, ema=True)

    assert torch.equal(own, wire_b)
    for a, b in [(xa, xb), (ea, eb), (qa, qb)]:
        assert _same_floats(a, b)


def test_a_second_message_needs_the_output_it_adds_into() -> None:
    wire = torch.empty(wire_bytes(256, 3, 128), dtype=torch.uint8)
    quantize(torch.randn(256), wire, 3, 128)
    with pytest.raises(ValueError, match="adds into out"):
        dequantize(wire, 256, 3, 128, second=wire)
    both = dequantize(wire, 256, 3, 128, out=torch.empty(256), second=wire)  # a + a, the kernel's one pass
    assert torch.equal(both, dequantize(wire, 256, 3, 128) * 2)
