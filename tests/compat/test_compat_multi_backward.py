"""One forward, several backwards (issue 38, item 18), beside torch DDP on 2 Gloo ranks.

torch DDP's reducer launches a bucket once all its parameters are marked ready, across however many
backwards that takes, and finalises (waits, writes ``.grad``) in the backward that makes the last
bucket ready; a backward that leaves parameters unready finishes nothing.  So
``o1, o2 = model(x); loss(o1).backward(); loss(o2).backward()`` on disjoint outputs synchronises every
parameter once and trains.

With ``find_unused_parameters=True`` torch DDP passes the outputs through one autograd node
(``_DDPSink``): the first backward marks the other head ready with an undefined gradient and
finalises, and the second backward fails with autograd's "Trying to backward through the graph a
second time".  gradientflow puts nothing between the outputs: its used exchange finds the other head
unused in the first backward, the second backward synchronises as a step of its own, and the result
is torch DDP's without the flag (the test below checks both).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _dist import run_distributed
from _oracle import assert_same_grads, assert_same_params, batch, pair


class TwoOutputs(nn.Module):
    """Two heads on the input, no parameter shared: each output's backward reaches only its head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), torch.tanh(self.b(x))


def _worker(rank: int, world_size: int, kw: dict, set_to_none: bool) -> None:
    ref, ours = pair(TwoOutputs, kw, {k: v for k, v in kw.items() if k != "find_unused_parameters"})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        for m, opt in zip((ref, ours), opts):
            opt.zero_grad(set_to_none=set_to_none)
            o1, o2 = m(batch(rank, step))
            o1.pow(2).sum().backward()
            o2.sum().backward()
        assert_same_grads(ref, ours, what=f"step {step}")
        stats = ours.comm_stats()
        assert stats["collectives"] >= 1 and stats["payload_bytes"] == stats["dense_bytes"], stats
        for opt in opts:
            opt.step()
        assert_same_params(ref, ours, what=f"step {step}")
    if not kw.get("find_unused_parameters"):
        # every parameter synchronised once per step: the gradients only (torch sends nothing else)
        assert ours.comm_stats()["control_bytes"] == 0


def _torch_find_unused_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = nn.parallel.DistributedDataParallel(TwoOutputs(), find_unused_parameters=True)
    o1, o2 = ref(batch(rank, 0))
    o1.pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        o2.sum().backward()


def test_torch_ddp_find_unused_refuses_the_second_backward() -> None:
    """Why the find_unused_parameters=True case is compared with torch DDP's default."""
    run_distributed(_torch_find_unused_worker, 2, timeout=120)


@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_two_backwards_on_disjoint_outputs_train_as_torch(find_unused: bool, set_to_none: bool) -> None:
    run_distributed(_worker, 2, {"find_unused_parameters": find_unused}, set_to_none, timeout=120)


def test_two_backwards_one_bucket_per_head() -> None:
    """Each head its own bucket (a tiny bucket cap): the first backward launches its bucket, the second the other."""
    run_distributed(_worker, 2, {"bucket_cap_mb": 0.00001}, True, timeout=120)


def _recipe_worker(rank: int, world_size: int, kw: dict) -> None:
    """Two backwards give what one backward of the summed loss gives, under a recipe too."""
    import gradientflow as gf  # noqa: PLC0415

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(gf.DistributedDataParallel(TwoOutputs(), **kw))
    split, summed = models
    for step in range(3):
        for m in models:
            m.zero_grad()
        o1, o2 = split(batch(rank, step))
        o1.pow(2).sum().backward()
        o2.sum().backward()
        p1, p2 = summed(batch(rank, step))
        (p1.pow(2).sum() + p2.sum()).backward()
        for a, b in zip(split.parameters(), summed.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kw", [{"comm_dtype": "fp16"}, {"density": 0.5, "chunk_size": 4}], ids=["fp16", "csc"])
def test_two_backwards_under_a_recipe_are_one_step(kw: dict) -> None:
    run_distributed(_recipe_worker, 2, kw, timeout=120)
