"""CSC's step 2: each chunk's score, summed while the gradient is added into v where it can be.

Two ways to the same L1 norms (:func:`~.selection.chunk_scores` is the paper's score):

- **Fused** (CPU fp32 pools whose gradients accumulate straight into v, after ``zero_grad()``): the
  engine hands each fresh gradient to :meth:`ChunkScorer.add_fresh`, which adds it into v and adds
  the L1 of what it wrote to the chunks' scores in the same pass (:mod:`.csc_native`).  A chunk
  whose every element came that way is scored when its last parameter arrives; no pass of its own.
- **A score pass** over v's rows, for every chunk that holds an element not added that way (a
  parameter without a gradient this step keeps its residual; an accumulated ``.grad`` under
  ``no_sync`` was added by autograd; a GPU or fp64 pool; ``chunk_score="sampled_l1"``; no C
  compiler): it overwrites whatever partial sum the fused adds left there.

The choice is per bucket: a bucket launched with a parameter that was not fused makes every chunk
it touches take the score pass.  Both give each rank's local L1 norms; ranks agree on the scores
because they allreduce them, so the order of summation within a rank does not matter.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.pool import Bucket, GradPool
from ..exchange.selection import chunk_scores, score_scratch
from . import csc_native


class ChunkScorer:
    """The per-chunk scores of one pool layout (``scores``: every buffer's chunks, one global index)."""

    def __init__(self, chunk_size: int, sampled: bool) -> None:
        self.chunk_size = chunk_size
        self.sampled = sampled
        self._scratch: torch.Tensor | None = None
        self.scores = torch.zeros(0)
        self._add: Any = None  # csc_native's gf_add_l1 where the layout has a fusable buffer

    def set_pool(self, pool: GradPool, n_chunks: list[int], offsets: list[int], direct: list[bool]) -> None:
        """Follow a (new) pool layout; ``direct[k]``: buffer ``k``'s gradients are added straight into v."""
        self.pool = pool
        device = pool.buffers[0].device if pool.buffers else torch.device("cpu")
        self.scores = torch.zeros(sum(n_chunks), dtype=torch.float32, device=device)
        self._per_pool = [self.scores[o : o + n] for o, n in zip(offsets, n_chunks)]
        # The fused sum is the exact L1: a sampled score (chunk_score="sampled_l1") keeps its own pass.
        on = not self.sampled and csc_native.available()
        self.fusable = [
            on and d and b.device.type == "cpu" and b.dtype == torch.float32 for d, b in zip(direct, pool.buffers)
        ]
        # The kernel's arguments per parameter, fixed for this layout: the hook runs once per parameter
        # per step, and add_l1's checks cost more than the kernel itself on a small parameter.
        self._add = csc_native.add_l1_unchecked() if any(self.fusable) else None
        self._args = [
            (s.numel, s.offset, self.chunk_size, self._per_pool[s.pool].data_ptr()) if self.fusable[s.pool] else None
            for s in pool.layout.slots
        ]
        self.begin_step()

    def begin_step(self) -> None:
        """A sparse step starts: no chunk scored, no gradient added."""
        if any(self.fusable):
            self.scores.zero_()
        self._fused = bytearray(len(self.pool.layout.slots))
        self._exact_upto = [0] * len(self.fusable)  # per buffer: chunks below this take the score pass

    def add_fresh(self, index: int, grad: torch.Tensor, target: torch.Tensor) -> None:
        """``target += grad`` (``target``: parameter ``index``'s view of v), scoring as it goes where it can."""
        args = self._args[index]
        # target: the parameter's view of a fusable v (a slice of a flat fp32 buffer: contiguous, its numel);
        # grad: autograd's own tensor of the parameter's shape and device, maybe another dtype or strided
        if args is not None and grad.dtype is torch.float32 and grad.is_contiguous():
            self._add(target.data_ptr(), grad.data_ptr(), *args)
            self._fused[index] = 1
        else:
            target.add_(grad)

    def launched(self, bucket: Bucket) -> None:
        """``bucket``'s gradients are all in v: unless each was fused, its chunks take the score pass."""
        fused = self._fused
        if not self.fusable[bucket.pool] or not all(fused[i] for i in bucket.params):
            self._exact_upto[bucket.pool] = -(-bucket.end // self.chunk_size)

    def score(self, k: int, lo: int, hi: int, rows: torch.Tensor) -> None:
        """Chunks [lo, hi) of buffer ``k`` (``rows``: its v as ``[n_chunks, chunk_size]``) are complete:
        run the score pass on those that need it; the fused adds already summed the rest."""
        exact_hi = min(hi, self._exact_upto[k])
        if exact_hi <= lo:
            return
        if rows.device.type == "cpu" and (self._scratch is None or self._scratch.dtype != rows.dtype):
            self._scratch = score_scratch(self.chunk_size, rows.dtype, self.sampled)
        chunk_scores(rows[lo:exact_hi], out=self._per_pool[k][lo:exact_hi], scratch=self._scratch, sampled=self.sampled)
