"""Which parameters got a gradient: torch DDP's unused-parameter search and its error.

Every rank marks the parameters a backward produced a gradient for since the last synchronisation.
As in torch DDP:

- ``find_unused_parameters=True``: one SUM allreduce of those marks (int32, one per parameter) per
  synchronised step counts the ranks that used each parameter (``reducer._get_local_used_map()``);
  those no rank used, whose ``.grad`` was ``None`` before the step, get ``None`` back, so optimizers
  skip them;
- ``static_graph=True``: the same exchange, once (the first step's set holds for every step);
- otherwise no exchange at all: a parameter that got no gradient on this rank is torch's
  "Expected to have finished reduction ..." ``RuntimeError`` at the next forward (:func:`unused_error`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..diagnostics.stats import StepStats
from ..diagnostics.watchdog import Watchdog

if TYPE_CHECKING:
    from .backward import Backward as _Backward
    from .protocol import SyncStrategy


class ParamUsage:
    """The per-parameter bytes of one wrapper and the exchange that combines them across ranks."""

    def __init__(self, n: int, static_graph: bool) -> None:
        self.fresh = bytearray(n)  # 1: .grad was None when bound, and no backward has produced it since
        self.used = bytearray(n)  # 1: a backward on this rank produced the gradient since the last sync
        self.static_graph = static_graph
        self.static_unused: list[int] | None = None  # static_graph: learnt from the first exchange
        self.static_used: bytearray | None = None  # this rank's used set at the first step
        self.graph_static = True  # every step so far used the first step's set (torch's _ddp_graph_static)
        self.counts: torch.Tensor | None = None  # int32 per parameter: ranks that used it (the last exchange)

    def make_static(self) -> None:
        """torch's ``_set_static_graph()`` after construction: the used exchange runs once from now on."""
        self.static_graph = True

    def reset(self) -> None:
        """A synchronisation ended: nothing is fresh or used any more."""
        self.fresh = bytearray(len(self.fresh))
        self.used = bytearray(len(self.used))

    def start_exchange(
        self, group: Callable[[], dist.ProcessGroup], device: torch.device, stats: StepStats
    ) -> tuple[dist.Work, torch.Tensor] | None:
        """Start the SUM allreduce of the used marks on ``group()``; None when ``static_graph``
        already knows the unused parameters.  int32, as torch's map: a uint8 sum would wrap at 256 ranks."""
        if self.static_unused is not None:
            return None
        flags = torch.frombuffer(bytearray(self.used), dtype=torch.uint8).to(device=device, dtype=torch.int32)
        stats.control_bytes += flags.numel() * flags.element_size()
        return dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group(), async_op=True), flags

    def unused_fresh(self, pending: tuple[dist.Work, torch.Tensor] | None, watchdog: Watchdog) -> list[int]:
        """Indices of the parameters no rank used whose ``.grad`` was ``None``: they get ``None`` back."""
        if pending is not None:
            work, flags = pending
            watchdog.wait(work, "used-parameter counts", flags.numel() * flags.element_size())
            self.counts = flags
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


def unused_error(unused: list[int], names: list[str], rank: int) -> RuntimeError:
    """torch DDP's error for parameters that got no gradient without ``find_unused_parameters=True``.

    torch's reducer text (code and users match on it), the indices (registration order of the
    synchronised parameters) and, always, their names: torch prints the names only at a
    ``TORCH_DISTRIBUTED_DEBUG`` level, gradientflow has them anyway."""
    return RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a new one. This error "
        "indicates that your module has parameters that were not used in producing loss. You can enable unused "
        "parameter detection by passing the keyword argument `find_unused_parameters=True` to "
        "`torch.nn.parallel.DistributedDataParallel` (gradientflow's takes it too), and by \nmaking sure all "
        "`forward` function outputs participate in calculating loss. \nIf you already have done the above, then "
        "the distributed data parallel module wasn't able to locate the output tensors in the return value of "
        "your module's `forward` function. Please include the loss function and the structure of the return value "
        "of `forward` of your module when reporting this issue (e.g. list, dict, iterable).\n"
        f"Parameter indices which did not receive grad for rank {rank}: {' '.join(map(str, unused))}\n"
        f"Parameters which did not receive grad for rank {rank}: {', '.join(names[i] for i in unused)}\n"
        "(gradientflow names them at every debug level; torch DDP asks you to set the environment variable "
        "TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL for the names.)"
    )


class UnusedSearch:
    """The end of a step for parameters that got no gradient; a part the
    :class:`~gradientflow.engine.reducer.Reducer` holds (``reducer.unused``).  With ``find_unused_parameters``
    (or ``static_graph``) the used exchange decides; without, a step whose backward left parameters without
    gradient stays open for a further backward of the same forward, or becomes torch's error at the next
    forward (:attr:`pending_error`, which the reducer raises there).  ``control``: CSC's second group, where
    the used exchange runs (``None``: ``group``)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        group: dist.ProcessGroup,
        control: dist.ProcessGroup | None,
        watchdog: Watchdog,
        sync: SyncStrategy,
        usage: ParamUsage,
        find_unused: bool,
    ) -> None:
        self.params, self.names, self.group, self.watchdog = params, names, group, watchdog
        self.rank = dist.get_rank(group)
        # Held weakly: torch's registry owns the group (see wrapper.groups.control_group).
        self._control = weakref.ref(control) if control is not None else None
        self.sync, self.usage = sync, usage
        # As torch DDP: without find_unused_parameters no step sends anything but gradients (a used exchange
        # every step made small models' steps slower than torch DDP's:
        # docs/results/benchmarks.md#figures-behind-the-codes-comments).
        self.find_unused = find_unused
        self.pending_error: RuntimeError | None = None  # raised at the next forward with grad (torch's timing)

    def stays_open(self, bw: _Backward) -> bool:
        """Whether this backward's end leaves the step open, as torch DDP's reducer does.

        torch launches a bucket once all its parameters are marked ready, across however many backwards
        of one forward that takes (``o1, o2 = model(x); l(o1).backward(); l(o2).backward()``), and
        finalises in the backward that readies the last bucket.  So, without ``find_unused_parameters``
        (with it, or with ``static_graph``, the used exchange decides which gradients will not come), a
        backward that left parameters without gradient finishes nothing: a later backward may bring
        them.  If the next forward with grad comes first, the reducer's ``raise_pending`` ends the step
        and raises torch's error there (:attr:`pending_error`), naming the parameters still missing."""
        if bw.closing or bw.shadow or self.find_unused or self.usage.static_graph or len(bw.order) == len(bw.seen):
            return False
        self.pending_error = unused_error([i for i, s in enumerate(bw.seen) if not s], self.names, self.rank)
        return True

    def take_pending(self) -> RuntimeError | None:
        """The error to raise at this forward (once), or None; a further backward clears it (:meth:`clear`)."""
        error, self.pending_error = self.pending_error, None
        return error

    def clear(self) -> None:
        """A further backward of an open step: it may yet bring the missing gradients."""
        self.pending_error = None

    def unsearched_unused(self, bw: _Backward) -> RuntimeError:
        """Parameters this backward gave no gradient without ``find_unused_parameters``: torch's error at
        the next forward (returned too); a ``.grad`` that was ``None`` stays ``None``, as torch leaves it
        (e.g. a ``torch.func.functional_call`` with other tensors in place of the module's parameters)."""
        unused = [i for i, seen in enumerate(bw.seen) if not seen]
        self.pending_error = error = unused_error(unused, self.names, self.rank)
        for i in self.sync.untouched([i for i in unused if self.usage.fresh[i]]):
            self.params[i].grad = None
        return error

    def start_used_exchange(self, bw: _Backward) -> tuple[dist.Work, torch.Tensor] | None:
        if self.find_unused and not self.usage.static_graph:
            with torch.profiler.record_function("search_unused_parameters"):  # torch's profiler event name
                return self.usage.start_exchange(self._exchange_group, self.params[0].device, bw.stats)
        if self.usage.static_graph:
            return self.usage.start_exchange(self._exchange_group, self.params[0].device, bw.stats)
        return None

    def _exchange_group(self) -> dist.ProcessGroup:
        """Where the used exchange runs.  CSC sends chunks at launches that may differ between ranks
        (see csc.py): only the control group has a fixed order of collectives at this point."""
        group = self.group if self._control is None else self._control()
        if group is None:
            raise RuntimeError("gradientflow: CSC's control process group was destroyed while the model is in use")
        return group

    def release_unused(self, used: tuple[dist.Work, torch.Tensor] | None) -> None:
        """Give ``.grad = None`` back to parameters no rank used whose ``.grad`` was ``None``."""
        candidates = self.usage.unused_fresh(used, self.watchdog)
        if candidates:
            for i in self.sync.untouched(candidates):
                self.params[i].grad = None
