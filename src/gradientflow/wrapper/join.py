"""Uneven inputs: torch's ``Join`` protocol for the gradientflow wrapper.

A rank that has run out of batches *joins*: while others still train, ``Join`` calls
:meth:`GradientFlowJoinHook.main_hook` once per iteration they run, and that hook issues exactly
the collectives a real synchronised iteration issues (buffer broadcast, every bucket, the
unused-parameter exchange, CSC's scores and chunks) with a zero gradient, so nobody hangs and
the average stays a sum over all ranks divided by the initial world size (DDP's default).  When
every rank has joined, :meth:`post_hook` broadcasts parameters and buffers from a rank that
joined last, so all ranks end with identical models.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from ..comm.collectives import broadcast_coalesced
from ..diagnostics.watchdog import Watchdog


def max_over_ranks(value: int, group: dist.ProcessGroup, device: torch.device, watchdog: Watchdog, what: str) -> int:
    """The largest ``value`` any rank passes (one bounded MAX allreduce of one int64)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
    watchdog.wait(work, what, 8)
    return int(t.item())


def common_rank(group: dist.ProcessGroup, device: torch.device, watchdog: Watchdog, candidate: bool) -> int:
    """The highest global rank among the ranks passing ``candidate=True``."""
    rank = max_over_ranks(dist.get_rank() if candidate else -1, group, device, watchdog, "join: common rank")
    if rank < 0:
        raise RuntimeError("gradientflow join: no rank qualified as the source of the final model")
    return rank


class GradientFlowJoinHook(JoinHook):
    """Shadows one synchronised iteration per call; syncs the final model at the end."""

    def __init__(self, ddp: Any) -> None:  # the wrapper (typed loosely: ddp.py imports this file)
        self.ddp = ddp

    def main_hook(self) -> None:
        """1. the forward's buffer broadcast (source: an active rank); 2. a zero-gradient sync step."""
        ddp = self.ddp
        if ddp._gf_syncs_buffers():
            ddp._gf_broadcast_buffers(active=False)
        ddp._gf_engine.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """3. Everyone has joined: parameters and buffers from a last joiner, to every rank."""
        ddp = self.ddp
        group, device, watchdog = ddp.process_group, ddp.join_device, ddp._gf_watchdog
        src = common_rank(group, device, watchdog, candidate=is_last_joiner)
        states = [p for n, p in ddp.module.named_parameters() if n not in ddp._gf_ignored]
        with torch.no_grad():
            broadcast_coalesced(states + ddp._gf_current_buffers(), src, group, watchdog, "final model broadcast")
        check = ddp._gf_engine.step_check
        if check is not None:  # joined ranks ran fewer forward passes: agree on the count again
            check.passes = max_over_ranks(check.passes, group, device, watchdog, "join: pass count")
