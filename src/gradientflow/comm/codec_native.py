"""The block quantiser's CPU kernel (``codec.c``): compiled once per machine, called through ctypes.

On a CPU rank the torch-ops codec of :mod:`gradientflow.comm.quantize` walks a segment ~40 times and
cost more time than the bytes it saved (~28 ns per gradient element and step on the bench's
transformer); ``codec.c`` does one pass per block, bit-identical (tests/test_codec.py).  CUDA tensors
keep the torch ops (one kernel launch each, a few µs on a GPU).

The build, cache and fallback are :mod:`.native`'s: compiled once per machine, called with the GIL
released; without a compiler the torch ops (same bits, slower) with a warning.  Whether a rank uses
the kernel cannot change its results, so ranks need not agree on it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).with_name("codec.c")


@dataclass(frozen=True)
class Fused:
    """The preconditioner's divisor ``r`` (exchange/precondition.py's ``Root``) folded into the codec's own
    passes: :func:`quantize` makes each block ``(x + err) / r`` just before encoding it and :func:`dequantize`
    multiplies each decoded block (and its error) back by ``r``, updating ``q``'s EMA (``ema``: its beta and
    1 - beta), while the block is in the cache: two passes over the bucket fewer than dividing and
    restoring on their own, the same floats (``gf_precondition_in`` / ``_out`` per block)."""

    q: torch.Tensor
    wf: torch.Tensor
    bf: float
    unit: bool
    offset: int
    window: int
    ema: tuple[float, float] | None

    def args(self) -> tuple[int, int, float, int, int, int]:
        return (self.q.data_ptr(), self.wf.data_ptr(), self.bf, int(self.unit), self.offset, self.window)


_NONE = (None, None, 0.0, 0, 0, 0)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    f32 = ctypes.c_float
    # gf_quantize's last six and gf_dequantize's six before the EMA's three: Fused.args() (q NULL: none);
    # gf_dequantize's two after `accumulate`: a second message (NULL: none)
    lib.gf_quantize.argtypes = [p, i64, i32, i32, p, p, f32, p, p, p, p, i32, p, p, f32, i32, i64, i32]
    lib.gf_quantize.restype = None
    lib.gf_dequantize.argtypes = [p, p, i64, i32, i32, p, f32, p, i32, p, p, p, p, p, f32, i32, i64, i32, i32, f32, f32]
    lib.gf_dequantize.restype = None
    lib.gf_quantize_rows.argtypes = [p, p, i64, i64, i32, i32, p, p, f32, p, p]
    lib.gf_quantize_rows.restype = None
    lib.gf_dequantize_rows.argtypes = [p, p, p, p, p, i64, i64, i32, i32, p, f32, p, i32, f32]
    lib.gf_dequantize_rows.restype = None
    lib.gf_precondition_in.argtypes = [p, p, p, p, f32, i32, i64, i64, i32]
    lib.gf_precondition_in.restype = None
    lib.gf_precondition_out.argtypes = [p, p, p, p, f32, i32, i64, i64, i32, i32, f32, f32]
    lib.gf_precondition_out.restype = None


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it cannot be built here (logged once)."""
    return native.load(SOURCE, _declare, "the quantisation codec")


def applies(*tensors: torch.Tensor) -> bool:
    """The kernel handles contiguous CPU tensors; everything else keeps the torch ops."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and library() is not None


@functools.cache  # the levels' midpoints and polynomial per width: built once, not per bucket and step
def _floats(values: tuple[float, ...]) -> ctypes.Array[ctypes.c_float]:
    return (ctypes.c_float * 3)(*values, *(0.0,) * (3 - len(values)))


def quantize(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    mids: tuple[float, ...],
    poly: tuple[float, ...],
    decoded: torch.Tensor | None,
    err: torch.Tensor | None,
    carry: bool = False,
    first: float = 0.0,
    fused: Fused | None = None,
) -> None:
    """``codec.c``'s ``gf_quantize``: codes, bf16 scales, decoded values (may be ``x``; None: not written) and the
    error; ``carry``: ``x + err`` is encoded; ``first``: the first level (0 but for levels without a zero);
    ``fused`` (with ``err``): ``(x + err) / r`` is encoded, written over ``x`` block by block."""
    lib = library()
    assert lib is not None, "callers check applies() first"
    lib.gf_quantize(
        x.data_ptr(),
        x.numel(),
        bits,
        block,
        _floats(mids),
        _floats(poly),
        first,
        codes.data_ptr(),
        scales.data_ptr(),
        None if decoded is None else decoded.data_ptr(),
        None if err is None else err.data_ptr(),
        int(carry),
        *(_NONE if fused is None else fused.args()),
    )


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    m: int,
    bits: int,
    block: int,
    poly: tuple[float, ...],
    out: torch.Tensor,
    accumulate: bool,
    first: float = 0.0,
    fused: Fused | None = None,
    err: torch.Tensor | None = None,
    second: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``codec.c``'s ``gf_dequantize``: ``m`` decoded values into ``out`` (added to it if ``accumulate``);
    ``first``: the first level (0 but for levels without a zero); ``second`` (codes, scales): another message of
    the same ``m``, its values added in the same pass; ``fused`` (with ``err``): then ``out`` and ``err``
    multiplied back by ``r`` and ``q``'s EMA updated, as :func:`precondition_out`."""
    lib = library()
    assert lib is not None, "callers check applies() first"
    assert fused is None or err is not None, "the fused multiply-back restores err too"
    beta, c = fused.ema if fused is not None and fused.ema is not None else (0.0, 0.0)
    lib.gf_dequantize(
        codes.data_ptr(),
        scales.data_ptr(),
        m,
        bits,
        block,
        _floats(poly),
        first,
        out.data_ptr(),
        int(accumulate),
        None if second is None else second[0].data_ptr(),
        None if second is None else second[1].data_ptr(),
        None if err is None else err.data_ptr(),
        *(_NONE if fused is None else fused.args()),
        int(fused is not None and fused.ema is not None),
        beta,
        c,
    )


def quantize_rows(
    rows: torch.Tensor,
    idx: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    mids: tuple[float, ...],
    poly: tuple[float, ...],
    first: float = 0.0,
) -> None:
    """``codec.c``'s ``gf_quantize_rows``: rows ``idx`` (int64) of ``rows`` ([*, C] fp32, C a multiple of ``block``)
    encoded as one message, as :func:`quantize` encodes them packed; each row's error written over the row."""
    lib = library()
    assert lib is not None, "callers check applies() first"
    assert rows.shape[1] % block == 0 and idx.dtype == torch.int64 and idx.is_contiguous()
    lib.gf_quantize_rows(
        rows.data_ptr(),
        idx.data_ptr(),
        idx.numel(),
        rows.shape[1],
        bits,
        block,
        _floats(mids),
        _floats(poly),
        first,
        codes.data_ptr(),
        scales.data_ptr(),
    )


def dequantize_rows(
    own: tuple[torch.Tensor, torch.Tensor],
    peer: tuple[torch.Tensor, torch.Tensor] | None,
    idx: torch.Tensor,
    out: torch.Tensor,
    bits: int,
    block: int,
    poly: tuple[float, ...],
    first: float = 0.0,
    mult: float = 1.0,
) -> None:
    """``codec.c``'s ``gf_dequantize_rows``: rows ``idx`` of ``out`` ([*, C] fp32) = (own + peer) * ``mult`` (own and
    peer: (codes, scales) of one message each, as :func:`quantize_rows` wrote them); ``peer`` None: out += own."""
    lib = library()
    assert lib is not None, "callers check applies() first"
    assert out.shape[1] % block == 0 and idx.dtype == torch.int64 and idx.is_contiguous()
    lib.gf_dequantize_rows(
        own[0].data_ptr(),
        own[1].data_ptr(),
        None if peer is None else peer[0].data_ptr(),
        None if peer is None else peer[1].data_ptr(),
        idx.data_ptr(),
        idx.numel(),
        out.shape[1],
        bits,
        block,
        _floats(poly),
        first,
        out.data_ptr(),
        int(peer is None),
        mult,
    )


def precondition_in(
    x: torch.Tensor, e: torch.Tensor, q: torch.Tensor, wf: torch.Tensor, bf: float, unit: bool, offset: int, window: int
) -> None:
    """``codec.c``'s ``gf_precondition_in``: ``x = (x + e) / r``, ``r`` from ``q`` and the floors (``wf`` per window,
    ``bf`` the bucket's; ``unit``: r = 1); ``offset``: ``x[0]``'s index in its bucket (which window it is in)."""
    lib = library()
    assert lib is not None, "callers check applies() first"
    lib.gf_precondition_in(
        x.data_ptr(), e.data_ptr(), q.data_ptr(), wf.data_ptr(), bf, int(unit), x.numel(), offset, window
    )


def precondition_out(
    x: torch.Tensor,
    e: torch.Tensor,
    q: torch.Tensor,
    wf: torch.Tensor,
    bf: float,
    unit: bool,
    offset: int,
    window: int,
    ema: tuple[float, float] | None,
) -> None:
    """``codec.c``'s ``gf_precondition_out``: ``x *= r``, ``e *= r``; ``ema=(beta, c)``: then
    ``q = q * beta + c * x * x`` (r from the ``q`` before it)."""
    lib = library()
    assert lib is not None, "callers check applies() first"
    beta, c = ema if ema is not None else (0.0, 0.0)
    lib.gf_precondition_out(
        x.data_ptr(),
        e.data_ptr(),
        q.data_ptr(),
        wf.data_ptr(),
        bf,
        int(unit),
        x.numel(),
        offset,
        window,
        int(ema is not None),
        beta,
        c,
    )
