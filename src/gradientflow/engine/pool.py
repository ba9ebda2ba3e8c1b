"""The gradient memory pool: where every gradient lives, and how the pool is cut into buckets.

The layout is a pure function of (parameter sizes, dtypes/devices, backward order, θ), so every
rank computes the same one from the same inputs.  :class:`GradPool` owns the memory: one flat
buffer per (dtype, device), and each parameter's ``.grad`` is a view into it, so backward writes
straight into the pool and a bucket is just a slice — no copy into a fusion buffer, ever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PoolKey = tuple[torch.dtype, torch.device]


@dataclass(frozen=True)
class Slot:
    """Where parameter ``param`` keeps its gradient: ``pools[pool][offset : offset + numel]``."""

    param: int
    pool: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous slice of one pool, allreduced by one collective once all its params are ready."""

    index: int
    pool: int
    start: int
    end: int
    params: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Layout:
    keys: tuple[PoolKey, ...]  # (dtype, device) of each pool
    sizes: tuple[int, ...]  # elements in each pool
    slots: tuple[Slot, ...]  # indexed by parameter index
    buckets: tuple[Bucket, ...]  # in launch order (= backward order)
    order: tuple[int, ...]  # parameter indices in backward order


def plan_layout(
    numels: Sequence[int],
    keys: Sequence[PoolKey],
    order: Sequence[int],
    threshold_bytes: float,
    tail_bytes: float | None = None,
) -> Layout:
    """Lay gradients out in ``order`` (the order backward produces them) and cut buckets.

    1. Each (dtype, device) gets its own pool; within it, parameters are placed back to back
       in ``order``, so gradients produced one after another are neighbours in memory.
    2. Walking ``order``, a bucket closes as soon as it holds >= ``threshold_bytes`` (θ), or
       when the next parameter lives in another pool (a bucket is one contiguous slice).
       θ = 0 gives one bucket per parameter, θ = inf one bucket per pool.
    3. ``tail_bytes``: a pool's last bucket is cut in two, the second holding as many trailing
       parameters as fit in ``tail_bytes`` (at least one).  What the last bucket holds can only
       be handled once backward ends; CSC keeps that part small (see ``SparseSync``).
    """
    if sorted(order) != list(range(len(numels))):
        raise ValueError("order must be a permutation of the parameter indices")
    pool_keys: list[PoolKey] = []
    sizes: list[int] = []
    slots: list[Slot | None] = [None] * len(numels)
    buckets: list[Bucket] = []
    open_params: list[int] = []
    open_pool, open_start, open_bytes = -1, 0, 0

    def close(end: int) -> None:
        nonlocal open_params, open_bytes
        if open_params:
            buckets.append(Bucket(len(buckets), open_pool, open_start, end, tuple(open_params)))
        open_params, open_bytes = [], 0

    for i in order:
        key = keys[i]
        if key not in pool_keys:
            pool_keys.append(key)
            sizes.append(0)
        pool = pool_keys.index(key)
        if pool != open_pool:
            close(sizes[open_pool] if open_pool >= 0 else 0)
            open_pool, open_start = pool, sizes[pool]
        slots[i] = Slot(i, pool, sizes[pool], numels[i])
        sizes[pool] += numels[i]
        open_params.append(i)
        open_bytes += numels[i] * key[0].itemsize
        if open_bytes >= threshold_bytes:
            close(sizes[pool])
            open_start = sizes[pool]
    close(sizes[open_pool] if open_pool >= 0 else 0)
    if tail_bytes is not None:
        buckets = _split_tails(buckets, numels, [k[0].itemsize for k in pool_keys], tail_bytes)
    return Layout(tuple(pool_keys), tuple(sizes), tuple(slots), tuple(buckets), tuple(order))  # type: ignore[arg-type]


def _split_tails(
    buckets: list[Bucket], numels: Sequence[int], itemsize: Sequence[int], tail_bytes: float
) -> list[Bucket]:
    """Cut each pool's last bucket so that its trailing part holds at most ``tail_bytes``."""
    last = {b.pool: b.index for b in buckets}
    out: list[Bucket] = []
    for b in buckets:
        keep = len(b.params)
        if last[b.pool] == b.index and len(b.params) > 1 and b.numel * itemsize[b.pool] > tail_bytes:
            size = 0
            while keep > 1 and (size + numels[b.params[keep - 1]]) * itemsize[b.pool] <= tail_bytes:
                keep -= 1
                size += numels[b.params[keep]]
            keep = min(keep, len(b.params) - 1)  # the tail holds at least one parameter
        if keep == len(b.params):
            out.append(Bucket(len(out), b.pool, b.start, b.end, b.params))
            continue
        cut = b.start + sum(numels[i] for i in b.params[:keep])
        out.append(Bucket(len(out), b.pool, b.start, cut, b.params[:keep]))
        out.append(Bucket(len(out), b.pool, cut, b.end, b.params[keep:]))
    return out


def small_last(order: Sequence[int], small: Sequence[bool]) -> list[int]:
    """``order`` with the parameters flagged ``small`` moved, in their relative order, to the end.

    CSC sends the chunks of 1-D parameters (biases, normalisation scales) every step; gathered at
    the end of the pool they fill a few chunks of their own instead of sharing one with every
    weight matrix.  Idempotent, so an order saved from such a layout comes back unchanged.
    """
    return [i for i in order if not small[i]] + [i for i in order if small[i]]


class GradPool:
    """Owns the flat gradient buffers of a layout and the per-parameter views into them."""

    def __init__(
        self, layout: Layout, params: Sequence[torch.Tensor], pad_to: int = 1, materialize: bool = True
    ) -> None:
        """``pad_to``: each buffer's storage is rounded up to a multiple of it (CSC: whole chunks),
        so ``padded[k]`` can be viewed as rows; ``buffers[k]`` is the exact-size view of it.  ``materialize=False``:
        the buffers are on the meta device (shapes, no memory), for an engine that never synchronises a gradient
        (``sync_every > 1`` on a flat layout)."""
        self.layout = layout
        self.padded = [
            torch.zeros(-(-size // pad_to) * pad_to, dtype=dtype, device=device if materialize else "meta")
            for (dtype, device), size in zip(layout.keys, layout.sizes)
        ]
        self.buffers = [t[:size] for t, size in zip(self.padded, layout.sizes)]
        self.views = [
            self.buffers[s.pool][s.offset : s.offset + s.numel].view(p.shape) for s, p in zip(layout.slots, params)
        ]
        # Each bucket's slice, made once (the engine launches them every step)
        self.bucket_views = [self.bucket_view(b) for b in layout.buckets]

    def bucket_view(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's slice of the pool."""
        return self.padded[bucket.pool][bucket.start : bucket.end]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class Scratch:
    """Reusable flat buffers, one per dtype, for per-step temporaries (wire casts, packed chunks).

    Allocating them fresh every step costs page faults on CPU (large blocks are mmapped and
    returned on free); buffers kept between steps do not.  :meth:`take` hands out consecutive
    views; :meth:`reset` (after the step's last use) sizes each buffer to what the step used,
    reallocating only when that grew or fell below half (CSC's density ramp uses less each step).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[torch.dtype, torch.Tensor] = {}
        self._used: dict[torch.dtype, int] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype``, disjoint from everything taken since the last reset."""
        used = self._used.get(dtype, 0)
        self._used[dtype] = used + numel
        buf = self._bufs.get(dtype)
        if buf is None or used + numel > buf.numel():  # first step, or more than last step: fresh
            return torch.empty(numel, dtype=dtype, device=self.device)
        return buf[used : used + numel]

    def reset(self) -> None:
        """The step's temporaries are dead: size the buffers for the next step."""
        for dtype in list(self._bufs):
            if dtype not in self._used:
                del self._bufs[dtype]
        for dtype, used in self._used.items():
            buf = self._bufs.get(dtype)
            if buf is None or buf.numel() < used or buf.numel() > 2 * used:
                self._bufs[dtype] = torch.empty(used, dtype=dtype, device=self.device)
        self._used = {}


def transfer(
    old: Layout, new: Layout, buffers: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Move per-parameter data held in ``old``'s pool layout (e.g. CSC residuals) into ``new``'s.

    ``out`` (zeroed buffers at least as long as ``new``'s pools) receives the data when given,
    so a caller can move straight into its own (e.g. padded) buffers without a second copy.
    """
    if out is None:
        out = [
            torch.zeros(size, dtype=buffers[0].dtype if buffers else dtype, device=device)
            for (dtype, device), size in zip(new.keys, new.sizes)
        ]
    for s_old, s_new in zip(old.slots, new.slots):
        out[s_new.pool][s_new.offset : s_new.offset + s_new.numel].copy_(
            buffers[s_old.pool][s_old.offset : s_old.offset + s_old.numel]
        )
    return list(out)
