"""Block quantisation of fp32 gradients: ``bits`` per element, one max-abs scale per block.

A segment of ``m`` elements is cut into blocks of ``block`` elements (the last one padded with
zeros).  Each block travels as its scale ``s = max |x|`` (bf16: fp32's range, so a large scaled
gradient never overflows the scale) and one code per element, ``L = 2**(bits-1) - 1``:

- ``levels="fitted"`` (the default) at widths with a :data:`.levels.CODEBOOKS` table (2 and 3 bits): the level
  nearest to ``x / s`` among ``0, ±l_1 .. ±l_L`` (a tie goes toward 0), stored sign-magnitude
  (``k | sign << (bits-1)``); decoded ``±l_k * s``;
- ``levels="zeroless"`` at widths with a :data:`.levels.ZEROLESS` table (2 bits): the nearest of ``±l_0 .. ±l_{K-1}``,
  ``K = 2**(bits-1)``, no zero level, so every code is used (sign-magnitude leaves "-0" unused); stored
  and decoded as above with ``k`` from 0;
- the other widths, and ``levels="uniform"``: ``q = clamp(round(x * L / s), -L, L)`` (round to nearest,
  ties to even), stored as ``q + L``; decoded ``q * s / L``.

Decoding uses the *transmitted* (bf16) scale, so a sender, its receiver and every rank of an
allgather decode the same bytes to the same floats.

Wire format of a segment (:func:`wire_bytes`): the codes of 8 elements packed little-endian into
``bits`` bytes, then the bf16 scales; one ``uint8`` tensor, so one message per segment.

``bits=32`` is the quantiser off: the segment travels as plain fp32 (no scales, no error), which
lets the ring and the error feedback around it be checked against a dense allreduce.

Everything is tensor ops on the segment's device: no host read, CUDA tensors work unchanged.  On
contiguous CPU tensors the tabled levels (:data:`.levels.CODEBOOKS`, :data:`.levels.ZEROLESS`) run
:mod:`.codec_native`'s fused C kernel instead: the same bits, one pass per block instead of ~40 passes per segment.
"""

from __future__ import annotations

import math

import torch

from . import codec_native
from .levels import kernel_levels as _kernel_levels
from .levels import max_code
from .levels import mids as _mids
from .levels import poly as _poly
from .levels import table as _table
from .levels import tabled as _tabled

SCALE_DTYPE = torch.bfloat16


def _level_of(k: torch.Tensor, bits: int, levels: str = "fitted") -> torch.Tensor:
    """``l_k`` (up to fp32 rounding) for code magnitudes ``k`` as fp32, by Horner on the polynomial of
    :func:`.levels.poly` (then ``+ l_0`` where it is not 0): five elementwise ops, where a table lookup or a bool x
    float product is 3-5x slower on CPU.  Sender and receivers run this same function on the same codes,
    so they decode the same floats."""
    c = _poly(bits, levels)
    kf = k.to(torch.float32)
    out = kf * c[-1]
    for ci in reversed(c[:-1]):
        out.add_(ci).mul_(kf)
    first = _table(bits, levels)[0]
    return out.add_(first) if first else out


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
    x: torch.Tensor, out: torch.Tensor, err: torch.Tensor | None, bits: int, block: int, clip: float, levels: str
) -> bool:
    """Whether :mod:`.codec_native`'s kernel encodes this call: tabled levels (not uniform steps), no clipping,
    contiguous CPU tensors."""
    if not _kernel_levels(bits, levels) or clip != 0 or block > 1024 or out.dtype != torch.uint8:
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
    levels: str = "fitted",
    inplace: bool = False,
    carry: bool = False,
    fused: codec_native.Fused | None = None,
) -> torch.Tensor:
    """Encode ``x`` (fp32, 1-D, ``m`` elements) into ``out`` (``wire_bytes(m)`` uint8).

    Returns the decoded values (``m`` fp32, what every receiver will decode); ``inplace``: written
    over ``x``, which is returned.  ``err``, if given, receives the quantisation error ``x - decoded``
    (error feedback keeps it for the next step).  ``carry`` (with ``err`` and ``inplace``): ``x + err``
    is encoded, ``err`` holding the last step's error on entry (one pass fewer than adding it first).
    A non-finite element makes its block's scale non-finite, so it decodes to NaN everywhere.
    ``clip`` > 0: the scale is ``min(max |x|, clip x RMS of the block)`` and larger elements are
    clamped (their excess goes to ``err``): finer steps for the bulk of a block.
    ``levels``: one of :data:`.levels.LEVELS` ("fitted": :data:`.levels.CODEBOOKS`; "uniform": steps ``k / L`` of
    the scale even where a table exists; "zeroless": :data:`.levels.ZEROLESS`).
    On contiguous CPU tensors the tabled levels without ``clip`` run :mod:`.codec_native`'s fused kernel (the
    same bits).  ``fused`` (with ``carry``): ``(x + err) / r`` is encoded, written over ``x`` (on CPU in the same pass).
    """
    m = x.numel()
    if carry and (err is None or not inplace):
        raise ValueError("quantize(carry=True) adds err to x in place: pass err and inplace=True")
    if fused is not None and not carry:
        raise ValueError("quantize(fused=...) divides x + err: pass carry=True")
    codebook = bits != FULL_PRECISION and _tabled(bits, levels)
    native = _native(x, out, err, bits, block, clip, levels)
    if fused is not None and not native:  # a quantiser the kernel lacks: the divide as a pass of its own
        assert err is not None  # checked above (carry)
        codec_native.precondition_in(x, err, fused.q, fused.wf, fused.bf, fused.unit, fused.offset, fused.window)
        fused, carry = None, False
    if carry and not native:
        x.add_(err)  # type: ignore[arg-type]  # checked above
        carry = False
    if bits == FULL_PRECISION:
        out.view(torch.float32).copy_(x)
        if err is not None:
            err.zero_()
        return x
    nb = n_blocks(m, block)
    L = max_code(bits)
    cb = code_bytes(m, bits, block)
    if native:
        decoded = x if inplace else torch.empty_like(x)
        _encode_native(x, out, bits, block, err, levels, carry, fused, decoded)
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
        mids = _mids(bits, levels)
        k = torch.gt(a, mids[0]).to(torch.uint8)  # the level's index: how many midpoints |u| is above
        for mid in mids[1:]:
            k.add_(torch.gt(a, mid))
        decoded = _level_of(k, bits, levels).copysign_(u).mul_(step[:, None]).view(-1)[:m]
        codes = k.add_(torch.signbit(u), alpha=1 << (bits - 1))  # sign-magnitude
    else:
        q = torch.round(u).clamp_(-L, L)
        decoded = (q * step[:, None]).view(-1)[:m]
        codes = q.add_(L).to(torch.uint8)
    if err is not None:
        torch.sub(x, decoded, out=err)
    _pack(codes.view(-1), bits, out[:cb])
    return x.copy_(decoded) if inplace else decoded


def encode(
    x: torch.Tensor,
    out: torch.Tensor,
    bits: int,
    block: int,
    err: torch.Tensor,
    clip: float = 0.0,
    levels: str = "fitted",
    carry: bool = False,
    fused: codec_native.Fused | None = None,
) -> bool:
    """:func:`quantize` with ``inplace=True`` for a sender that decodes its own bytes again: no decoded values where
    the kernel runs (True: ``x`` is then unspecified), else ``x`` holds them (False: the torch ops)."""
    if bits == FULL_PRECISION or not _native(x, out, err, bits, block, clip, levels):
        quantize(x, out, bits, block, err, clip, levels, inplace=True, carry=carry, fused=fused)
        return False
    if fused is not None and not carry:
        raise ValueError("encode(fused=...) divides x + err: pass carry=True")
    _encode_native(x, out, bits, block, err, levels, carry, fused, None)
    return True


def _encode_native(
    x: torch.Tensor,
    out: torch.Tensor,
    bits: int,
    block: int,
    err: torch.Tensor | None,
    levels: str,
    carry: bool,
    fused: codec_native.Fused | None,
    decoded: torch.Tensor | None,
) -> None:
    """:mod:`.codec_native`'s encode of ``x`` into ``out`` (``decoded``: None, not written)."""
    scales = out[code_bytes(x.numel(), bits, block) :].view(SCALE_DTYPE)
    first, mids, poly = _table(bits, levels)[0], _mids(bits, levels), _poly(bits, levels)
    codec_native.quantize(x, out, scales, bits, block, mids, poly, decoded, err, carry, first, fused)


def dequantize(
    wire: torch.Tensor,
    m: int,
    bits: int,
    block: int,
    levels: str = "fitted",
    out: torch.Tensor | None = None,
    add: bool = False,
    fused: codec_native.Fused | None = None,
    err: torch.Tensor | None = None,
    second: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a segment of ``m`` elements from its ``wire_bytes(m)`` bytes (fp32, 1-D).

    ``out`` (``m`` fp32): written there and returned; with ``add``, added to it (``out + decoded``, the
    same float adds on either path).  ``second`` (with ``out``): another message of the same ``m``, its values
    added after (on CPU in the same pass).  ``fused`` (with ``out`` and ``err``): then ``out`` and ``err``
    multiplied back by the preconditioner's ``r`` and its ``q`` updated (on CPU in the same pass)."""
    if fused is not None and (out is None or err is None):
        raise ValueError("dequantize(fused=...) restores out and err in place: pass both")
    if second is not None and out is None:
        raise ValueError("dequantize(second=...) adds into out: pass it")
    decoded = _dequantize(wire, m, bits, block, levels, out, add, fused, err, second)
    if out is None or decoded is out:
        done = decoded
    else:
        done = out.add_(decoded) if add else out.copy_(decoded)
        if second is not None:  # not folded into the kernel's pass: decoded and added after
            done.add_(_dequantize(second, m, bits, block, levels, None, False))
    if fused is not None and decoded is not out:  # not folded into the kernel's pass: a pass of its own
        assert err is not None  # checked above
        codec_native.precondition_out(
            done, err, fused.q, fused.wf, fused.bf, fused.unit, fused.offset, fused.window, fused.ema
        )
    return done


def _dequantize(
    wire: torch.Tensor,
    m: int,
    bits: int,
    block: int,
    levels: str,
    out: torch.Tensor | None,
    add: bool,
    fused: codec_native.Fused | None = None,
    err: torch.Tensor | None = None,
    second: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoded values, or ``out`` itself where the CPU kernel already wrote (or added) them there (and did
    ``second`` and ``fused``)."""
    if bits == FULL_PRECISION:
        return wire.view(torch.float32)
    nb = n_blocks(m, block)
    cb = code_bytes(m, bits, block)
    kernel = _kernel_levels(bits, levels) and block <= 1024 and wire.dtype == torch.uint8
    if (
        kernel
        and (out is None or out.dtype == torch.float32)
        and codec_native.applies(wire, *[t for t in [out, second] if t is not None])
        and (second is None or second.dtype == torch.uint8)
    ):
        target = out if out is not None else torch.empty(m, dtype=torch.float32)
        scales = wire[cb:].view(SCALE_DTYPE)
        first = _table(bits, levels)[0]
        both = None if second is None else (second, second[cb:].view(SCALE_DTYPE))
        accumulate = add and out is not None
        codec_native.dequantize(
            wire, scales, m, bits, block, _poly(bits, levels), target, accumulate, first, fused, err, both
        )
        return target
    scale = wire[cb:].view(SCALE_DTYPE).float()
    codes = _unpack(wire[:cb], bits).view(nb, block)
    if _tabled(bits, levels):
        half = 1 << (bits - 1)
        mag = _level_of(codes.bitwise_and(half - 1).to(torch.uint8), bits, levels)
        # the sign bit: copysign from (1 - 2 sign), exact, so -0.0 where the sender had it
        sign = codes.bitwise_right_shift(bits - 1).to(torch.float32).mul_(-2).add_(1)
        return mag.copysign_(sign).mul_(scale[:, None]).view(-1)[:m]
    L = max_code(bits)
    q = codes.to(torch.float32) - L
    return (q * (scale / L)[:, None]).view(-1)[:m]
