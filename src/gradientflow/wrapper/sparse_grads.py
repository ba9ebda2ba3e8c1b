"""Sparse gradients (``nn.Embedding(sparse=True)``), synchronised the way torch DDP does.

torch DDP gives each parameter with a sparse gradient a bucket of its own and allreduces the
sparse tensor (Gloo sums sparse COO tensors), divided by the world size.  Such a gradient cannot
live in the dense pool, so these parameters stay out of it: at the end of a synchronised backward
(an autograd callback queued when backward reaches the forward's outputs) each one's gradient is
divided and allreduced, in registration order on every rank.  A rank that did not use the
parameter contributes an empty sparse gradient, so every rank issues the same collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..diagnostics.watchdog import Watchdog
from ..engine.hooks import iter_tensors, weak_hook


class SparseGradSync:
    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup, watchdog: Watchdog) -> None:
        self.params, self.group, self.watchdog = params, group, watchdog
        self.world_size = dist.get_world_size(group)
        self.queued = False
        self._hook = weak_hook(self, SparseGradSync._output_grad_hook)

    def arm(self, out: Any) -> None:
        """After a synchronised forward: the backward through ``out`` ends with :meth:`finish`."""
        for t in iter_tensors(out):
            if t.requires_grad:
                t.register_hook(self._hook)

    def _output_grad_hook(self, grad: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        self.queued = False
        for p in self.params:
            g = p.grad
            if g is None:
                g = torch.sparse_coo_tensor(
                    torch.empty(1, 0, dtype=torch.int64, device=p.device),
                    torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device),
                    p.shape,
                )
            elif not g.is_sparse:
                g = g.to_sparse(1) if g.dim() > 0 else g.to_sparse()
            g = g.coalesce() / self.world_size
            work = dist.all_reduce(g, group=self.group, async_op=True)
            self.watchdog.wait(work, "sparse gradient allreduce", g._values().numel() * g.element_size())
            p.grad = work.get_future().value()[0]  # Gloo's sparse sum is a new tensor, not ``g`` in place
