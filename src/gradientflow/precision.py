"""Casts between the fp32 gradient pool and the wire dtype, with pre-division by world size.

Dividing *before* the sum keeps an fp16 wire from overflowing when N ranks add up large
gradients; it is one fused pass (scale and cast together), and no pass at all is spent on a
cast when the wire dtype is the pool's dtype.
"""

from __future__ import annotations

import torch


def to_wire(flat: torch.Tensor, wire_dtype: torch.dtype | None, world_size: int) -> torch.Tensor:
    """Return ``flat / world_size`` in ``wire_dtype`` (``None``: its own); in place when no cast is needed."""
    if wire_dtype is None or flat.dtype == wire_dtype:
        return flat.div_(world_size) if world_size > 1 else flat
    wire = torch.empty(flat.shape, dtype=wire_dtype, device=flat.device)
    torch.mul(flat, 1.0 / world_size, out=wire) if world_size > 1 else wire.copy_(flat)
    return wire


def from_wire(flat: torch.Tensor, wire: torch.Tensor) -> None:
    """Write the reduced wire buffer back into the pool slice (no-op when it is the slice)."""
    if wire is not flat:
        flat.copy_(wire)
