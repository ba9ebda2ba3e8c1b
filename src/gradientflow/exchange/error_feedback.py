"""Error feedback's state, one home for every door and recipe with a residual: what was not sent is kept and
sent later.  Every residual is allocated here (:func:`zeros`), whichever door holds it:

- the top-k recipes (``"topk-fp16"``, ``"topk-3bit"``): the residual v (and the momentum u) of the chunks not
  selected; ``"topk-3bit"``'s sent rows leave their quantisation error there too;
- the quantised family (``"3bit"`` and the others) on a flat layout: each rank's quantisation error, laid out like
  the pool (:class:`Residuals`);
- the quantised family on nodes of several ranks: the error on this rank's shard of each bucket only
  (:class:`ShardResiduals`, 1/G of a flat rank's memory);
- the same exchanges behind the other doors: an FSDP module's shard (``gradientflow.fsdp``), the outer loop's
  fragments (``gradientflow.outer``), each a flat tensor from :func:`zeros`.

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
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..comm.topology import two_level_plan
from ..comm.two_level import NodeGroups
from ..engine.pool import Bucket, Layout, transfer


def zeros(numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new residual (or a preconditioner's ``q``, or an exchange's error buffer) of ``numel`` elements, all zero:
    the one place error feedback's state is allocated, whichever door holds it (the DDP pool's buffers, an FSDP
    module's shard, an outer fragment)."""
    return torch.zeros(numel, dtype=dtype, device=device)


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    """A new residual the shape, dtype and device of ``t`` (:func:`zeros`)."""
    return torch.zeros_like(t)


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
            zeros(n * self.chunk_size, device, residual_dtype(dtype))
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


class ShardResiduals:
    """Two-level error feedback: per pool, this rank's shard of each of its buckets, back to back.

    ``v[k]`` holds pool ``k``'s buckets' shards in bucket order (fp32, ``two_level_plan(...).shard``
    elements each, the padding included and kept at zero); :meth:`shard` is one bucket's.  The buffers are a
    :class:`Residuals` of the shards' sizes (its loss-scale units, :meth:`rescale` and :meth:`clean`);
    :meth:`expanded` / :meth:`take` convert from and to the pool's layout (checkpoints, the re-layout)."""

    def __init__(self, layout: Layout, groups: NodeGroups, block: int) -> None:  # noqa: D107
        topo = groups.topology
        self.layout = layout
        # bucket index -> (pool, offset in v[pool], shard length k, first element a in the bucket, real length m)
        self.spans: dict[int, tuple[int, int, int, int, int]] = {}
        sizes = [0] * len(layout.sizes)
        for b in layout.buckets:
            plan = two_level_plan(b.numel, topo.nodes, topo.per_node, block)
            a, end = plan.bounds[groups.local]
            self.spans[b.index] = (b.pool, sizes[b.pool], plan.shard, a, max(0, min(end, b.numel) - a))
            sizes[b.pool] += plan.shard
        self.store = Residuals(layout, 1, False, [], sizes=sizes)

    @property
    def v(self) -> list[torch.Tensor]:
        return self.store.v

    @property
    def scale(self) -> float | torch.Tensor:
        return self.store.scale

    def rescale(self, scale: float | torch.Tensor) -> None:
        self.store.rescale(scale)

    def clean(self) -> None:
        self.store.clean()

    def shard(self, bucket: Bucket) -> tuple[torch.Tensor, int]:
        """The bucket's shard of the residual (the ring's ``err``, written in place) and its real length."""
        k, off, n, _a, m = self.spans[bucket.index]
        return self.v[k][off : off + n], m

    def _regions(self) -> Iterator[tuple[int, int, int, int]]:
        """Per bucket: (pool, offset in ``v``, real length m, the shard's first element in the pool)."""
        for b in self.layout.buckets:
            k, off, _n, a, m = self.spans[b.index]
            yield k, off, m, b.start + a

    def expanded(self, plus: Residuals | None = None) -> Residuals:
        """The residual in the pool's layout (zero off this rank's shards), in the same units: a new buffer;
        ``plus``: a residual already in the pool's layout and these units (a pending fold), added."""
        full = Residuals(self.layout, 1, False, [])
        full.scale = self.store.scale
        for k, off, m, at in self._regions():
            full.v[k][at : at + m].copy_(self.v[k][off : off + m])
        for t, f in zip(full.v, plus.v if plus is not None else []):
            t.add_(f)
        return full

    def take(self, full: Residuals) -> bool:
        """Move this rank's shards out of ``full`` (the pool's layout, same units) into these buffers, zeroing
        them there; return whether anything is left in ``full`` (residual off the shards: a host read)."""
        self.store.scale = full.scale
        for k, off, m, at in self._regions():
            self.v[k][off : off + m].copy_(full.v[k][at : at + m])
            full.v[k][at : at + m].zero_()
        return any(bool(t.any()) for t in full.v)
