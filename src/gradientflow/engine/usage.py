"""Which parameters got a gradient: torch DDP's unused-parameter search, always on, one byte each.

Every rank marks the parameters a backward produced a gradient for since the last synchronisation;
one MAX allreduce of those bytes (once under ``static_graph=True``; densely, only on steps where a
flag reduced with the last gradient bucket says some rank has a parameter without a gradient) tells
which parameters *no* rank used.  Those whose ``.grad`` was ``None`` before the step get ``None``
back, so optimizers skip them as they do under torch DDP, and no ``find_unused_parameters`` is
needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..diagnostics.stats import StepStats
from ..diagnostics.watchdog import Watchdog


class ParamUsage:
    """The per-parameter bytes of one wrapper and the exchange that combines them across ranks."""

    def __init__(self, n: int, static_graph: bool) -> None:
        self.fresh = bytearray(n)  # 1: .grad was None when bound, and no backward has produced it since
        self.used = bytearray(n)  # 1: a backward on this rank produced the gradient since the last sync
        self.static_graph = static_graph
        self.static_unused: list[int] | None = None  # static_graph: learnt from the first exchange
        self.static_used: bytearray | None = None  # this rank's used set at the first step
        self.graph_static = True  # every step so far used the first step's set (torch's _ddp_graph_static)

    def reset(self) -> None:
        """A synchronisation ended: nothing is fresh or used any more."""
        self.fresh = bytearray(len(self.fresh))
        self.used = bytearray(len(self.used))

    def start_exchange(
        self, group: Callable[[], dist.ProcessGroup], device: torch.device, stats: StepStats
    ) -> tuple[dist.Work, torch.Tensor] | None:
        """Start the MAX allreduce of the used bytes on ``group()``; None when ``static_graph``
        already knows the unused parameters."""
        if self.static_unused is not None:
            return None
        flags = torch.frombuffer(bytearray(self.used), dtype=torch.uint8).to(device)
        stats.control_bytes += flags.numel()
        return dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group(), async_op=True), flags

    def unused_fresh(self, pending: tuple[dist.Work, torch.Tensor] | None, watchdog: Watchdog) -> list[int]:
        """Indices of the parameters no rank used whose ``.grad`` was ``None``: they get ``None`` back."""
        if pending is not None:
            work, flags = pending
            watchdog.wait(work, "used-parameter flags", flags.numel())
            if not any(self.fresh) and not self.static_graph:
                return []  # every gradient was produced (or already existed) here: nothing to read
            unused = [i for i, u in enumerate(flags.tolist()) if not u]
            if self.static_graph:
                self.static_unused = unused
        else:
            unused = self.static_unused or []
        return [i for i in unused if self.fresh[i]]

    def check_static_graph(self, order: list[int], names: list[str], rank: int) -> RuntimeError | None:
        """``static_graph=True`` promises the same used parameters every step (the used exchange ran once).

        The error for a step that breaks it (torch DDP's messages), None if it keeps it: a changed
        graph would otherwise drop gradients silently."""
        used = bytearray(len(self.used))
        for i in order:
            used[i] = 1
        first = self.static_used
        if first is None:
            self.static_used = used
            return None
        if used == first:
            return None
        self.graph_static = False
        new = [i for i in range(len(used)) if used[i] and not first[i]]
        gone = [i for i in range(len(used)) if first[i] and not used[i]]

        def listed(idx: list[int]) -> str:
            return " ".join(map(str, idx)) + f" ({', '.join(names[i] for i in idx)})" if idx else "none"

        # torch's two messages (one for each direction) in one, so that code matching either matches
        msg = (
            "Your training graph has changed in this iteration, which static_graph=True forbids: pass "
            "static_graph=False (unused parameters are then found every step).\n"
            "Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your training graph has changed in this iteration, e.g., one parameter is used in "
            "first iteration, but then got unused in the second iteration. this is not compatible with "
            f"static_graph set to True.\nParameter indices which did not receive grad for rank {rank}: {listed(gone)}; "
            f"unused at the first iteration and received a grad now: {listed(new)}"
        )
        return RuntimeError(msg)
