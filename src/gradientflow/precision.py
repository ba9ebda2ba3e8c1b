"""Casts between the fp32 gradient pool and the wire dtype, with pre-division by world size;
and the loss scale a GradScaler applied to this step's gradients.

Dividing *before* the sum keeps an fp16 wire from overflowing when N ranks add up large
gradients; no pass at all is spent on a cast when the wire dtype is the pool's dtype.
"""

from __future__ import annotations

from typing import Any

import torch


def to_wire(flat: torch.Tensor, wire_dtype: torch.dtype | None, world_size: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``flat / world_size`` in ``wire_dtype`` (``None``: its own dtype), in ``out`` if given.

    ``flat`` itself is divided in place (its content is replaced by the reduced result anyway),
    then cast by a plain copy: on CPU ``torch.mul(fp32, s, out=fp16)`` takes a slow
    mixed-dtype path (113 ms on ResNet-50's 25.6M-float pool, one thread) where ``mul_`` +
    ``copy_`` take 16 ms, with the same rounding (the fp32 product is rounded once to fp16).
    """
    if wire_dtype is None or flat.dtype == wire_dtype:
        return flat.div_(world_size) if world_size > 1 else flat
    if world_size > 1:
        flat.mul_(1.0 / world_size)  # as the fused op did: the fp32 product, rounded once below
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
