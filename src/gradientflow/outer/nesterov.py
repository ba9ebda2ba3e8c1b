"""The outer optimizer: Nesterov SGD on the averaged pseudo-gradient, as ``torch.optim.SGD(nesterov=True)``
computes it (DiLoCo's outer optimizer), on flat fp32 tensors."""

from __future__ import annotations

import torch


def nesterov_step(anchor: torch.Tensor, buf: torch.Tensor, delta: torch.Tensor, lr: float, momentum: float) -> None:
    """In place: ``buf = momentum * buf + delta``; ``anchor -= lr * (delta + momentum * buf)``.

    ``delta`` is the averaged pseudo-gradient (the last synchronised parameters minus the replicas' current ones),
    the gradient of the outer step; torch's SGD starts its buffer at the first gradient, which equals
    ``0 * momentum + delta`` here (zero dampening).  ``delta`` is overwritten (the step's direction)."""
    buf.mul_(momentum).add_(delta)
    delta.add_(buf, alpha=momentum)
    anchor.sub_(delta, alpha=lr)
