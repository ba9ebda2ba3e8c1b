"""CSC's error-feedback state: the residual v (and the momentum u), laid out like the pool.

One :class:`Residuals` owns, per pool buffer, a flat v (and u with momentum correction) padded
to whole chunks, so every buffer is an exact ``[n_chunks, chunk_size]`` view; the pad stays 0.

Units: v and u hold ``scale x`` the residual, where ``scale`` is the loss scale of the step that
last touched them.  Autograd then accumulates a scaled gradient straight into v (no unscale
pass), and a packed chunk already carries the magnitudes an fp16 wire expects.  When the loss
scale changes, :meth:`Residuals.rescale` multiplies once (exact for GradScaler's powers of two).
Checkpoints hold the unscaled residual.

v is kept in fp32 for 16-bit pools (small residuals must not vanish in fp16), otherwise in the
pool's own dtype; a pool whose v has the parameters' dtype can take ``.grad`` views of v
("direct" accumulation, see :mod:`gradientflow.strategies.csc`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..engine.pool import Layout, transfer


def residual_dtype(pool_dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit pools, the pool's dtype otherwise."""
    return torch.float32 if pool_dtype.itemsize < 4 else pool_dtype


class Residuals:
    """v (and u) for one pool layout, padded to whole chunks, in units of ``scale``."""

    def __init__(
        self,
        layout: Layout,
        chunk_size: int,
        momentum: bool,
        shapes: Sequence[torch.Size],
        sizes: Sequence[int] | None = None,
    ) -> None:
        """``sizes``: elements per pool buffer, if not the layout's (two-level: this rank's shards); ``shapes``: the
        parameters' shapes for :attr:`param_views` (empty: no views)."""
        self.layout = layout
        self.chunk_size = chunk_size
        self.sizes = list(layout.sizes if sizes is None else sizes)
        self.n_chunks = [math.ceil(s / chunk_size) for s in self.sizes]
        self.v = self._zeros()
        self.u = self._zeros() if momentum else None
        self.scale: float | torch.Tensor = 1.0
        self._shapes = list(shapes)
        self.param_views = self._param_views()

    def _zeros(self) -> list[torch.Tensor]:
        return [
            torch.zeros(n * self.chunk_size, dtype=residual_dtype(dtype), device=device)
            for n, (dtype, device) in zip(self.n_chunks, self.layout.keys)
        ]

    def _param_views(self) -> list[torch.Tensor]:
        return [
            self.v[s.pool][s.offset : s.offset + s.numel].view(shape)
            for s, shape in zip(self.layout.slots, self._shapes)
        ]

    def rows(self, k: int, which: str = "v") -> torch.Tensor:
        """Pool ``k``'s v (or u) as ``[n_chunks, chunk_size]``."""
        return getattr(self, which)[k].view(-1, self.chunk_size)

    def buffers(self) -> list[torch.Tensor]:
        return self.v + (self.u or [])

    def rescale(self, scale: float | torch.Tensor) -> None:
        """Express v and u in units of the loss scale ``scale``.

        A host float (CPU): one pass, only when the scale changed.  A device tensor (a GradScaler
        on an accelerator): one pass every step, since comparing would be a host read, and a
        pass costs far less there than a stalled stream.
        """
        if isinstance(scale, torch.Tensor):
            ratio = scale / self.scale
            for t in self.buffers():
                t.mul_(ratio)
            self.scale = scale.clone()
        elif isinstance(self.scale, torch.Tensor) or scale != self.scale:
            factor = scale / self.scale  # a float, or a tensor when the last scale was one
            for t in self.buffers():
                t.mul_(factor)
            self.scale = scale

    def clean(self) -> None:
        """Reset non-finite entries to 0 (after a step whose local gradient overflowed)."""
        for t in self.buffers():
            torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)

    def moved_to(self, layout: Layout) -> Residuals:
        """The same residuals in another pool layout (the engine's one-time re-layout)."""
        new = Residuals(layout, self.chunk_size, self.u is not None, self._shapes)
        new.scale = self.scale
        # One residual at a time, straight into the new padded buffers: the transient is one buffer.
        new.v = transfer(self.layout, layout, self.v, out=new.v)
        self.v = []
        if self.u is not None:
            new.u = transfer(self.layout, layout, self.u, out=new.u)
        new.param_views = new._param_views()
        return new

    # ---- checkpoint -----------------------------------------------------------------------
    def unscaled(self, which: str) -> list[torch.Tensor] | None:
        """Unpadded, unscaled copies of v or u (what a checkpoint holds)."""
        bufs = getattr(self, which)
        if bufs is None:
            return None
        if isinstance(self.scale, float) and self.scale == 1.0:
            return [b[:n].clone() for b, n in zip(bufs, self.sizes)]
        return [b[:n] / self.scale for b, n in zip(bufs, self.sizes)]

    def load(self, state: dict[str, Any]) -> None:
        """Take v and u from :meth:`unscaled` copies (already validated against the layout)."""
        self.scale = 1.0
        for name in ("v", "u"):
            saved, bufs = state.get(name), getattr(self, name)
            if saved is None or bufs is None:
                continue
            for dst, src, n in zip(bufs, saved, self.sizes):
                dst.zero_()
                dst[:n].copy_(src)


def residual_state(res: Residuals | None, chunk_size: int, sizes: Sequence[int]) -> dict[str, Any]:
    """What a checkpoint holds of the residuals: unpadded, unscaled v and u (``None`` before any)."""
    return {
        "chunk_size": chunk_size,
        "sizes": list(sizes),
        "v": res.unscaled("v") if res is not None else None,
        "u": res.unscaled("u") if res is not None else None,
    }


def validate_residual_state(state: dict[str, Any], chunk_size: int, sizes: Sequence[int], momentum: bool) -> None:
    """Raise ``ValueError`` unless ``state`` (a :func:`residual_state`) fits pools of ``sizes``
    cut into chunks of ``chunk_size``; change nothing."""
    missing = {"chunk_size", "sizes", "v", "u"} - set(state)
    if missing:
        raise ValueError(f"gradientflow CSC: the communication state lacks {sorted(missing)} (truncated?)")
    if state["chunk_size"] != chunk_size or list(state["sizes"]) != list(sizes):
        raise ValueError(
            f"gradientflow CSC: checkpoint has chunk_size={state['chunk_size']} and pool sizes "
            f"{state['sizes']}, this model has chunk_size={chunk_size} and {list(sizes)}. "
            "Load it into the same model with the same chunk_size."
        )
    if state["v"] is not None and (state["u"] is None) == momentum:
        raise ValueError("gradientflow CSC: checkpoint and model disagree on momentum correction (u)")
    for name in ("v", "u"):
        tensors = state[name]
        if tensors is None:
            continue
        if len(tensors) != len(sizes) or any(
            not isinstance(t, torch.Tensor) or t.numel() != n for t, n in zip(tensors, sizes)
        ):
            raise ValueError(
                f"gradientflow CSC: residual {name} in the checkpoint does not have the pool's sizes "
                f"{list(sizes)} (truncated or from another model)."
            )
