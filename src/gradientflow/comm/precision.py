"""Casts between the fp32 gradient pool and the wire dtype, with pre-division by world size;
and the loss scale a GradScaler applied to this step's gradients.

Dividing *before* the sum keeps an fp16 wire from overflowing when N ranks add up large
gradients; no pass at all is spent on a cast when the wire dtype is the pool's dtype.
"""

from __future__ import annotations

from typing import Any

import torch


def divide(
    src: torch.Tensor, world_size: int, wire_dtype: torch.dtype | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``src / world_size``, computed as the wire needs it, into ``out`` (default: ``src``, in place).

    A pool-dtype wire divides; a cast wire multiplies by the reciprocal (the fp32 product, rounded
    once by the cast that follows), as the fused cast-and-scale op did.  One definition, so that a
    gradient divided while it enters the pool (:meth:`DenseSync.take_fresh`) is bit for bit the
    one :func:`to_wire` would have divided.
    """
    out = src if out is None else out
    if world_size == 1:
        return out if out is src else out.copy_(src)
    if wire_dtype is None or src.dtype == wire_dtype:
        return torch.div(src, world_size, out=out)
    return torch.mul(src, 1.0 / world_size, out=out)


def to_wire(
    flat: torch.Tensor,
    wire_dtype: torch.dtype | None,
    world_size: int,
    out: torch.Tensor | None = None,
    divided: bool = False,
) -> torch.Tensor:
    """Return ``flat / world_size`` in ``wire_dtype`` (``None``: its own dtype), in ``out`` if given.

    ``flat`` itself is divided in place (its content is replaced by the reduced result anyway),
    unless ``divided`` says :func:`divide` already ran on it; then cast by a plain copy: on CPU
    ``torch.mul(fp32, s, out=fp16)`` takes a slow mixed-dtype path where ``mul_`` + ``copy_`` are several
    times faster, with the same rounding (measured: docs/results/benchmarks.md#figures-behind-the-codes-comments).
    """
    if not divided:
        divide(flat, world_size, wire_dtype)
    if wire_dtype is None or flat.dtype == wire_dtype:
        return flat
    wire = torch.empty(flat.shape, dtype=wire_dtype, device=flat.device) if out is None else out
    wire.copy_(flat)
    return wire


def from_wire(flat: torch.Tensor, wire: torch.Tensor) -> None:
    """Write the reduced wire buffer back into the pool slice (no-op when it is the slice)."""
    if wire is not flat:
        flat.copy_(wire)


def loss_scale(scaler: Any) -> float | torch.Tensor:
    """The scale ``scaler`` (a GradScaler, or ``None``) put on this step's gradients.

    A host float on CPU; on accelerators the scaler's device tensor, so reading it costs no host
    synchronisation.
    """
    if scaler is None or not scaler.is_enabled():
        return 1.0
    t = scaler._get_scale_async()
    if t is None:  # before the first scaler.scale(): the initial scale, a host float
        return float(scaler.get_scale())
    return float(t) if t.device.type == "cpu" else t
