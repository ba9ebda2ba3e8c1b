"""Block quantisation of fp32 gradients: ``bits`` per element, one max-abs scale per block.

A segment of ``m`` elements is cut into blocks of ``block`` elements (the last one padded with
zeros).  Each block travels as its scale ``s = max |x|`` (bf16: fp32's range, so a large scaled
gradient never overflows the scale) and one code per element,
``q = clamp(round(x * L / s), -L, L)`` with ``L = 2**(bits-1) - 1`` (3 bits: the 7 levels
-3..3; round to nearest, ties to even), stored as ``q + L`` in ``bits`` bits.  The decoded value
is ``q * s / L``, computed from the *transmitted* (bf16) scale, so a sender, its receiver and
every rank of an allgather decode the same bytes to the same floats.

Wire format of a segment (:func:`wire_bytes`): the codes of 8 elements packed little-endian into
``bits`` bytes, then the bf16 scales; one ``uint8`` tensor, so one message per segment.

``bits=32`` is the quantiser off: the segment travels as plain fp32 (no scales, no error), which
lets the ring and the error feedback around it be checked against a dense allreduce.

Everything is tensor ops on the segment's device: no host read, CUDA tensors work unchanged.
"""

from __future__ import annotations

import math

import torch

SCALE_DTYPE = torch.bfloat16


def levels(bits: int) -> int:
    """``L``: codes are the integers -L..L."""
    return 2 ** (bits - 1) - 1


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


def _shifts(n: int, step: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device) * step


def _pack(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Codes (uint8 < 2**bits, a multiple of 8 of them) -> ``out`` (``len/8 * bits`` bytes)."""
    if bits == 8:
        out.copy_(codes)
        return
    word = (codes.view(-1, 8).to(torch.int64) << _shifts(8, bits, codes.device)).sum(1, keepdim=True)
    out.view(-1, bits).copy_((word >> _shifts(bits, 8, codes.device)) & 0xFF)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`_pack`: int64 codes, ``[len/bits, 8]``."""
    if bits == 8:
        return packed.to(torch.int64).view(-1, 8)
    word = (packed.view(-1, bits).to(torch.int64) << _shifts(bits, 8, packed.device)).sum(1, keepdim=True)
    return (word >> _shifts(8, bits, packed.device)) & ((1 << bits) - 1)


def quantize(
    x: torch.Tensor, out: torch.Tensor, bits: int, block: int, err: torch.Tensor | None = None, clip: float = 0.0
) -> torch.Tensor:
    """Encode ``x`` (fp32, 1-D, ``m`` elements) into ``out`` (``wire_bytes(m)`` uint8).

    Returns the decoded values (``m`` fp32, what every receiver will decode).  ``err``, if given,
    receives the quantisation error ``x - decoded`` (error feedback keeps it for the next step).
    A non-finite element makes its block's scale non-finite, so it decodes to NaN everywhere.
    ``clip`` > 0: the scale is ``min(max |x|, clip x RMS of the block)`` and larger elements are
    clamped (their excess goes to ``err``): finer steps for the bulk of a block.
    """
    m = x.numel()
    if bits == FULL_PRECISION:
        out.view(torch.float32).copy_(x)
        if err is not None:
            err.zero_()
        return x
    nb = n_blocks(m, block)
    L = levels(bits)
    if m % block:
        padded = x.new_zeros(nb * block)
        padded[:m] = x
    else:
        padded = x
    rows = padded.view(nb, block)
    cb = code_bytes(m, bits, block)
    scale = out[cb:].view(SCALE_DTYPE)
    amax = rows.abs().amax(dim=1)
    if clip > 0:
        amax = torch.minimum(amax, rows.square().mean(dim=1).sqrt_().mul_(clip))
    scale.copy_(amax)  # rounded to bf16: the scale as sent
    step = scale.float() / L  # the decoded value of code 1, from the scale as sent
    # Divide, not multiply by 1/step: a block of tiny (subnormal) gradients has a step whose reciprocal
    # overflows to inf, and 0 * inf is NaN.  A zero step means an all-zero block: divide by 1.
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round(rows / safe[:, None]).clamp_(-L, L)
    decoded = (q * step[:, None]).view(-1)[:m]
    if err is not None:
        torch.sub(x, decoded, out=err)
    _pack(q.add_(L).to(torch.uint8).view(-1), bits, out[:cb])
    return decoded


def dequantize(wire: torch.Tensor, m: int, bits: int, block: int) -> torch.Tensor:
    """Decode a segment of ``m`` elements from its ``wire_bytes(m)`` bytes (fp32, 1-D)."""
    if bits == FULL_PRECISION:
        return wire.view(torch.float32)
    nb = n_blocks(m, block)
    cb = code_bytes(m, bits, block)
    step = wire[cb:].view(SCALE_DTYPE).float() / levels(bits)
    q = _unpack(wire[:cb], bits).view(nb, block).to(torch.float32) - levels(bits)
    return (q * step[:, None]).view(-1)[:m]
