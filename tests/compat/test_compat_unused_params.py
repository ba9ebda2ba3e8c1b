"""Unused parameters, as torch DDP handles them, beside torch DDP on 2 Gloo ranks.

- ``find_unused_parameters=False`` (the default): a step sends the gradients and nothing else (one
  allreduce for a one-bucket model, no control bytes); a parameter that got no gradient is torch's
  ``RuntimeError`` ("Expected to have finished reduction ...") at the next forward, naming it.
- ``find_unused_parameters=True``: every step counts the ranks that used each parameter
  (``reducer._get_local_used_map()``, torch's values), ``.grad`` is ``None`` where torch leaves it
  ``None``, and the pool keeps its first layout (``has_rebuilt_buckets`` 0, as torch).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _dist import run_distributed
from _oracle import assert_same_grads, batch, pair


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 2)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.a(h) + (self.b(h) if use_b else 0)


def _default_worker(rank: int, world_size: int) -> list[str]:
    ref, ours = pair(TwoHeads)
    for step in range(2):  # every parameter used: gradients only, as torch DDP
        for m in (ref, ours):
            m.zero_grad()
            m(batch(rank, step, (4, 6))).sum().backward()
        assert_same_grads(ref, ours, what=f"step {step}")
        stats = ours.comm_stats()
        assert (stats["collectives"], stats["control_bytes"]) == (1, 0)
    messages = []
    # b gets no gradient (on every rank: where one rank raises, the others would wait for it)
    for m in (ref, ours):
        m(batch(rank, 2), use_b=False).sum().backward()
        with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration") as err:
            m(batch(rank, 3)).sum().backward()
        messages.append(str(err.value))
    for text in ("`find_unused_parameters=True`", "`forward` function outputs participate in calculating loss"):
        assert all(text in msg for msg in messages)
    # b.weight and b.bias: indices 4 and 5 in registration order, as torch counts them
    assert all(f"Parameter indices which did not receive grad for rank {rank}: 4 5" in msg for msg in messages)
    assert f"Parameters which did not receive grad for rank {rank}: b.weight, b.bias" in messages[1]
    assert messages[1] in ours._get_ddp_logging_data()["error"]
    ours(batch(rank, 4)).sum().backward()  # raised once: the failed step had completed, training goes on
    return messages


def _functional_call_worker(rank: int, world_size: int) -> None:
    """torch.func.functional_call with other tensors in place of the parameters: the module's own
    parameters get no gradient, and their ``.grad`` stays ``None`` on both DDPs."""
    ref, ours = pair(lambda: nn.Linear(1, 1))
    for m in (ref, ours):
        w, b = torch.ones(1, 1, requires_grad=True), torch.zeros(1, requires_grad=True)
        torch.func.functional_call(m, {"module.weight": w, "module.bias": b}, (torch.full((1, 1), 3.0),)).backward()
        assert (w.grad.item(), b.grad.item()) == (3.0, 1.0)  # local: w and b are not the model's parameters
        assert m.module.weight.grad is None and m.module.bias.grad is None


def _find_unused_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(TwoHeads, {"find_unused_parameters": True}, {"find_unused_parameters": True})
    n_params = len(list(TwoHeads().parameters()))
    # b: used by both ranks, by rank 0 only, by no rank
    for step, users in enumerate([{0, 1}, {0}, set()]):
        for m in (ref, ours):
            m.zero_grad(set_to_none=True)
            m(batch(rank, step), use_b=rank in users).sum().backward()
        assert_same_grads(ref, ours, what=f"step {step}")  # also None where torch DDP leaves None
        expected = torch.tensor([2, 2, 2, 2, len(users), len(users)], dtype=torch.int32)
        assert torch.equal(ref.reducer._get_local_used_map(), expected)
        assert torch.equal(ours.reducer._get_local_used_map(), expected)
        assert ours.comm_stats()["control_bytes"] == 4 * n_params  # one int32 count per parameter
    assert ours._get_ddp_logging_data()["has_rebuilt_buckets"] == ref._get_ddp_logging_data()["has_rebuilt_buckets"]
    assert ours._get_ddp_logging_data()["has_rebuilt_buckets"] == 0


def test_unused_parameter_is_torchs_error_at_next_forward() -> None:
    run_distributed(_default_worker, 2)


def test_functional_call_leaves_the_modules_grads_none() -> None:
    run_distributed(_functional_call_worker, 2)


def test_find_unused_parameters_counts_users_as_torch() -> None:
    run_distributed(_find_unused_worker, 2)
