"""Dense steps run one collective: the used-parameter exchange only when some rank needs it.

Every rank whose parameter got no gradient (and whose ``.grad`` was ``None``) must learn whether
another rank used it; the last bucket's allreduce carries that one flag, so a step where every
rank used every parameter sends no 1-byte-per-parameter exchange (``control_bytes`` is 0), as
torch DDP sends none with ``find_unused_parameters=False``.
"""

from __future__ import annotations

import torch
from torch import nn

import gradientflow as gf

from _dist import run_distributed


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 2)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.a(h) + (self.b(h) if use_b else 0)


def _worker(rank: int, world_size: int) -> list[tuple[int, int, bool, bool]]:
    torch.manual_seed(0)
    model = gf.DistributedDataParallel(TwoHeads())
    torch.manual_seed(0)
    ref = nn.parallel.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
    out = []
    # step 0: both ranks use b; step 1: only rank 0 does; step 2: no rank does
    for step, users in enumerate([{0, 1}, {0}, set()]):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            m(x, rank in users).sum().backward()
        stats = model.comm_stats()
        b_none = model.module.b.weight.grad is None
        assert b_none == (ref.module.b.weight.grad is None)  # torch DDP's verdict, with its own exchange
        if not b_none:
            torch.testing.assert_close(model.module.b.weight.grad, ref.module.b.weight.grad, rtol=0, atol=1e-6)
        out.append((stats["collectives"], stats["control_bytes"], b_none, users == set()))
    return out


def test_exchange_runs_only_when_a_rank_lacks_a_gradient() -> None:
    n_params = 6
    for rank_result in run_distributed(_worker, 2):
        (c0, ctl0, none0, _), (c1, ctl1, none1, _), (c2, ctl2, none2, _) = rank_result
        assert c0 == c1 == c2 == 1  # one bucket: one gradient allreduce per step, flag included
        flag = 4  # the fp32 flag riding on the gradient allreduce
        assert ctl0 == flag and not none0  # everyone used everything: no exchange
        assert ctl1 == flag + n_params and not none1  # rank 1 lacks b's gradient, rank 0 has it: exchanged
        assert ctl2 == flag + n_params and none2  # nobody used b: exchanged, .grad None as torch DDP leaves it
