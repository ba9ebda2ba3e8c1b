"""Block quantisation of fp32 gradients: ``bits`` per element, one max-abs scale per block.

A segment of ``m`` elements is cut into blocks of ``block`` elements (the last one padded with
zeros).  Each block travels as its scale ``s = max |x|`` (bf16: fp32's range, so a large scaled
gradient never overflows the scale) and one code per element, ``L = 2**(bits-1) - 1``:

- widths with a :data:`CODEBOOKS` table (2 and 3 bits, the default): the level nearest to ``x / s``
  among ``0, ±l_1 .. ±l_L`` (a tie goes toward 0), stored sign-magnitude (``k | sign << (bits-1)``);
  decoded ``±l_k * s``;
- the others, and ``uniform=True``: ``q = clamp(round(x * L / s), -L, L)`` (round to nearest, ties
  to even), stored as ``q + L``; decoded ``q * s / L``.

Decoding uses the *transmitted* (bf16) scale, so a sender, its receiver and every rank of an
allgather decode the same bytes to the same floats.

Wire format of a segment (:func:`wire_bytes`): the codes of 8 elements packed little-endian into
``bits`` bytes, then the bf16 scales; one ``uint8`` tensor, so one message per segment.

``bits=32`` is the quantiser off: the segment travels as plain fp32 (no scales, no error), which
lets the ring and the error feedback around it be checked against a dense allreduce.

Everything is tensor ops on the segment's device: no host read, CUDA tensors work unchanged.  On
contiguous CPU tensors the codebook widths run :mod:`.codec_native`'s fused C kernel instead: the same
bits, one pass per block instead of ~40 passes per segment.
"""

from __future__ import annotations

import functools
import math

import torch

from . import codec_native

SCALE_DTYPE = torch.bfloat16


def levels(bits: int) -> int:
    """``L``: codes are the integers -L..L."""
    return 2 ** (bits - 1) - 1


CODEBOOKS: dict[int, tuple[float, ...]] = {2: (0.46,), 3: (0.2, 0.43, 0.75)}
"""Non-uniform levels ``l_1 < .. < l_L`` (fractions of the block's scale; level 0 is 0, code -k is
-l_k): a 1-D Lloyd-Max (k-means) fit to block-normalised gradients ``x / max|x|`` of the bench's AdamW
transformer.  Most of a block sits far below its max, so uniform steps of s/L round most of it to 0;
these levels cut the quantisation error's energy by 28-41% (3 bits) and 55-70% (2 bits) at the same
bytes (measured on its gradients at steps 5, 60 and 119), and took the transformer's final loss from
1.024x DDP's to 1.012x (3 bits, seed 0)."""


@functools.cache
def _mids(bits: int) -> tuple[float, ...]:
    """The midpoints between consecutive levels ``0, l_1, .., l_L``: a magnitude above ``mids[j]`` is
    at least level j+1."""
    lv = (0.0, *CODEBOOKS[bits])
    return tuple((a + b) / 2 for a, b in zip(lv, lv[1:]))


@functools.cache
def _poly(bits: int) -> tuple[float, ...]:
    """``c_1 .. c_L`` with ``sum_i c_i j**i == l_j`` for ``j = 0..L``: the levels as a polynomial in the
    magnitude ``k`` (exact interpolation through the L+1 points, solved in float64)."""
    lv = CODEBOOKS[bits]
    n = len(lv)
    a = [[float(j**i) for i in range(1, n + 1)] for j in range(1, n + 1)]
    b = list(lv)
    for c in range(n):  # Gauss-Jordan on an n x n Vandermonde (n <= 3)
        piv = a[c][c]
        a[c] = [v / piv for v in a[c]]
        b[c] /= piv
        for r in range(n):
            if r != c and a[r][c]:
                f = a[r][c]
                a[r] = [v - f * w for v, w in zip(a[r], a[c])]
                b[r] -= f * b[c]
    return tuple(b)


def _level_of(k: torch.Tensor, bits: int) -> torch.Tensor:
    """``l_k`` (up to fp32 rounding) for magnitudes ``k`` (0..L) as fp32, by Horner on the polynomial of
    :func:`_poly`: five elementwise ops, where a table lookup or a bool x float product is 3-5x slower on
    CPU.  Sender and receivers run this same function on the same codes, so they decode the same floats."""
    c = _poly(bits)
    kf = k.to(torch.float32)
    out = kf * c[-1]
    for ci in reversed(c[:-1]):
        out.add_(ci).mul_(kf)
    return out


def n_blocks(m: int, block: int) -> int:
    return math.ceil(m / block)


FULL_PRECISION = 32
"""``bits`` meaning "quantiser off": fp32 on the wire."""


def code_bytes(m: int, bits: int, block: int) -> int:
    """Bytes of the packed codes of ``m`` elements (whole blocks; ``block`` is a multiple of 16, so the
    scales after them start 2-byte aligned)."""
    return n_blocks(m, block) * block * bits // 8


def wire_bytes(m: int, bits: int, block: int) -> int:
    """Bytes one segment of ``m`` elements takes on the wire: codes, then scales."""
    if bits == FULL_PRECISION:
        return 4 * m
    return code_bytes(m, bits, block) + n_blocks(m, block) * SCALE_DTYPE.itemsize


def _word_dtype(bits: int) -> torch.dtype:
    # 8 codes make one word of 8 x bits bits: int32 holds up to 3 bits (24), half int64's memory traffic
    return torch.int32 if bits <= 3 else torch.int64


def _shifts(n: int, step: int, bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=_word_dtype(bits), device=device) * step


def _pack(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Codes (uint8 < 2**bits, a multiple of 8 of them) -> ``out`` (``len/8 * bits`` bytes)."""
    if bits == 8:
        out.copy_(codes)
        return
    dt = _word_dtype(bits)
    word = (codes.view(-1, 8).to(dt) << _shifts(8, bits, bits, codes.device)).sum(1, keepdim=True, dtype=dt)
    out.view(-1, bits).copy_((word >> _shifts(bits, 8, bits, codes.device)) & 0xFF)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`_pack`: codes ``[len/bits, 8]`` (an integer dtype)."""
    if bits == 8:
        return packed.view(-1, 8)
    dt = _word_dtype(bits)
    word = (packed.view(-1, bits).to(dt) << _shifts(bits, 8, bits, packed.device)).sum(1, keepdim=True, dtype=dt)
    return (word >> _shifts(8, bits, bits, packed.device)) & ((1 << bits) - 1)


def _native(
    x: torch.Tensor, out: torch.Tensor, err: torch.Tensor | None, bits: int, block: int, clip: float, uniform: bool
) -> bool:
    """Whether :mod:`.codec_native`'s kernel encodes this call: the codebook widths, no clipping, contiguous
    CPU tensors."""
    if uniform or bits not in CODEBOOKS or clip != 0 or block > 1024 or out.dtype != torch.uint8:
        return False
    if x.dtype != torch.float32 or (err is not None and err.dtype != torch.float32):
        return False
    return codec_native.applies(x, out, *([] if err is None else [err]))


def quantize(
    x: torch.Tensor,
    out: torch.Tensor,
    bits: int,
    block: int,
    err: torch.Tensor | None = None,
    clip: float = 0.0,
    uniform: bool = False,
    inplace: bool = False,
    carry: bool = False,
) -> torch.Tensor:
    """Encode ``x`` (fp32, 1-D, ``m`` elements) into ``out`` (``wire_bytes(m)`` uint8).

    Returns the decoded values (``m`` fp32, what every receiver will decode); ``inplace``: written
    over ``x``, which is returned.  ``err``, if given, receives the quantisation error ``x - decoded``
    (error feedback keeps it for the next step).  ``carry`` (with ``err`` and ``inplace``): ``x + err``
    is encoded, ``err`` holding the last step's error on entry (one pass fewer than adding it first).
    A non-finite element makes its block's scale non-finite, so it decodes to NaN everywhere.
    ``clip`` > 0: the scale is ``min(max |x|, clip x RMS of the block)`` and larger elements are
    clamped (their excess goes to ``err``): finer steps for the bulk of a block.
    ``uniform``: levels ``k / L`` of the scale even where :data:`CODEBOOKS` has a table.
    On contiguous CPU tensors the codebook widths without ``clip`` run :mod:`.codec_native`'s fused
    kernel (the same bits).
    """
    m = x.numel()
    if carry and (err is None or not inplace):
        raise ValueError("quantize(carry=True) adds err to x in place: pass err and inplace=True")
    native = _native(x, out, err, bits, block, clip, uniform)
    if carry and not native:
        x.add_(err)  # type: ignore[arg-type]  # checked above
        carry = False
    if bits == FULL_PRECISION:
        out.view(torch.float32).copy_(x)
        if err is not None:
            err.zero_()
        return x
    nb = n_blocks(m, block)
    L = levels(bits)
    cb = code_bytes(m, bits, block)
    codebook = not uniform and bits in CODEBOOKS
    if native:
        decoded = x if inplace else torch.empty_like(x)
        scales = out[cb:].view(SCALE_DTYPE)
        codec_native.quantize(x, out, scales, bits, block, _mids(bits), _poly(bits), decoded, err, carry)
        return decoded
    if m % block:
        padded = x.new_zeros(nb * block)
        padded[:m] = x
    else:
        padded = x
    rows = padded.view(nb, block)
    scale = out[cb:].view(SCALE_DTYPE)
    lo, hi = torch.aminmax(rows, dim=1)  # one pass; max |x| = max(hi, -lo)
    # abs: an all-zero block's max is +0, whatever signs its zeros had (torch's vectorised and scalar
    # maximum disagree on max(0, -0); the CPU kernel must produce the same scale bytes)
    amax = torch.maximum(hi, lo.neg_()).abs_()
    if clip > 0:
        amax = torch.minimum(amax, rows.square().mean(dim=1).sqrt_().mul_(clip))
    scale.copy_(amax)  # rounded to bf16: the scale as sent
    step = scale.float() if codebook else scale.float() / L  # decoded value of level 1 / of code 1
    # Divide, not multiply by 1/step: a block of tiny (subnormal) gradients has a step whose reciprocal
    # overflows to inf, and 0 * inf is NaN.  A zero step means an all-zero block: divide by 1.
    safe = torch.where(step > 0, step, torch.ones_like(step))
    u = rows / safe[:, None]
    if codebook:
        a = u.abs()
        mids = _mids(bits)
        k = torch.gt(a, mids[0]).to(torch.uint8)  # the level's index: how many midpoints |u| is above
        for mid in mids[1:]:
            k.add_(torch.gt(a, mid))
        decoded = _level_of(k, bits).copysign_(u).mul_(step[:, None]).view(-1)[:m]
        codes = k.add_(torch.signbit(u), alpha=1 << (bits - 1))  # sign-magnitude
    else:
        q = torch.round(u).clamp_(-L, L)
        decoded = (q * step[:, None]).view(-1)[:m]
        codes = q.add_(L).to(torch.uint8)
    if err is not None:
        torch.sub(x, decoded, out=err)
    _pack(codes.view(-1), bits, out[:cb])
    return x.copy_(decoded) if inplace else decoded


def dequantize(
    wire: torch.Tensor,
    m: int,
    bits: int,
    block: int,
    uniform: bool = False,
    out: torch.Tensor | None = None,
    add: bool = False,
) -> torch.Tensor:
    """Decode a segment of ``m`` elements from its ``wire_bytes(m)`` bytes (fp32, 1-D).

    ``out`` (``m`` fp32): written there and returned; with ``add``, added to it (``out + decoded``, the
    same float adds on either path).
    """
    decoded = _dequantize(wire, m, bits, block, uniform, out, add)
    if out is None or decoded is out:
        return decoded
    return out.add_(decoded) if add else out.copy_(decoded)


def _dequantize(
    wire: torch.Tensor, m: int, bits: int, block: int, uniform: bool, out: torch.Tensor | None, add: bool
) -> torch.Tensor:
    """The decoded values, or ``out`` itself where the CPU kernel already wrote (or added) them there."""
    if bits == FULL_PRECISION:
        return wire.view(torch.float32)
    nb = n_blocks(m, block)
    cb = code_bytes(m, bits, block)
    kernel = not uniform and bits in CODEBOOKS and block <= 1024 and wire.dtype == torch.uint8
    if (
        kernel
        and (out is None or out.dtype == torch.float32)
        and codec_native.applies(wire, *[t for t in [out] if t is not None])
    ):
        target = out if out is not None else torch.empty(m, dtype=torch.float32)
        scales = wire[cb:].view(SCALE_DTYPE)
        codec_native.dequantize(wire, scales, m, bits, block, _poly(bits), target, add and out is not None)
        return target
    scale = wire[cb:].view(SCALE_DTYPE).float()
    codes = _unpack(wire[:cb], bits).view(nb, block)
    if not uniform and bits in CODEBOOKS:
        half = 1 << (bits - 1)
        mag = _level_of(codes.bitwise_and(half - 1).to(torch.uint8), bits)
        # the sign bit: copysign from (1 - 2 sign), exact, so -0.0 where the sender had it
        sign = codes.bitwise_right_shift(bits - 1).to(torch.float32).mul_(-2).add_(1)
        return mag.copysign_(sign).mul_(scale[:, None]).view(-1)[:m]
    q = codes.to(torch.float32) - levels(bits)
    return (q * (scale / levels(bits))[:, None]).view(-1)[:m]
