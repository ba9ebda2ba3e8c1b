"""Every wait of the FSDP door bounded by ``timeout`` and named, torch's own collectives inside the node included.

A rank that stalls (SIGSTOP, a deadlock, a stuck data loader) stops in one collective; its peers wait in whichever
collective they share with it next.  Under HSDP that is not only gradientflow's exchange between nodes (the
replicate group's, :mod:`.module_comm`): its node peers wait in torch FSDP's reduce-scatter or all-gather inside
the node, and a rank of the other node waits, in turn, on one of those.  So that each of them raises the same named
error within ``timeout`` (never a wait for the process group's own timeout, 30 minutes on Gloo, nor the backend's
"Connection closed" once a rank that gave up has left):

- one :class:`~gradientflow.diagnostics.watchdog.Watchdog` per mesh and timeout (:func:`mesh_watchdog`), on the
  default group where the mesh spans it: every rank that gives up checks in under the same keys, so each names the
  rank that never arrived (the stalled one), whatever collective it was itself waiting in;
- on Gloo, torch FSDP's reduce-scatter and all-gather replaced by the same collectives (the same calls, so the same
  bits: ``dist.reduce_scatter_single`` and ``dist.all_gather_single``, as torch's defaults call them) waited for
  through that watchdog (:class:`BoundedReduceScatter`, :class:`BoundedAllGather`, installed by
  :func:`bound_inside_node`).  On Gloo these collectives block the calling thread anyway; on NCCL they are left as
  torch issues them (a bounded wait there would block the host on the GPU's queue), and the process group's timeout
  bounds them.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # torch's Comm contract

from ..comm.waiter import waiter_for
from ..diagnostics.watchdog import Watchdog, resolve_timeout
from .mesh import HSDPMesh

_WATCHDOGS: dict[tuple[dist.ProcessGroup, timedelta | None], Watchdog] = {}


def mesh_watchdog(mesh: HSDPMesh, timeout: timedelta | None) -> Watchdog:
    """The watchdog every module sharded on ``mesh`` with ``timeout`` waits through (made in module order, the same
    on every rank, so its keys in the store are the same everywhere): on the default group where the mesh holds
    every rank, else on the replicate group (a mesh of some ranks only: its peers on the other nodes named)."""
    key = (mesh.replicate, timeout)  # the group object, not the mesh's ranks: a re-initialised process group is new
    found = _WATCHDOGS.get(key)
    if found is None:
        spans = mesh.nodes * mesh.per_node == dist.get_world_size()
        group = dist.group.WORLD if spans else mesh.replicate
        assert group is not None  # a process group exists: the mesh was made on it
        # no timeout given: the process group's, at most 5 minutes where the mesh spans nodes (a hung host noticed)
        found = _WATCHDOGS[key] = Watchdog(group, resolve_timeout(timeout, group, between_nodes=mesh.nodes > 1))
    return found


def _wait(watchdog: Watchdog, group: dist.ProcessGroup, work: dist.Work | None, what: str, nbytes: int) -> None:
    """``work`` done, or the watchdog's named error within its timeout.  Gloo's reduce-scatter does not honour
    ``Work.wait(timeout)`` (a stalled peer held it for the process group's timeout, measured): the work is waited
    for by the group's waiter thread (:mod:`gradientflow.comm.waiter`) and this thread waits, bounded, on its
    event."""
    if work is None:  # torch 2.14 types an async collective's result Optional (None: issued without async_op)
        raise RuntimeError(f"gradientflow: {what}: torch returned no Work for an asynchronous collective")
    if watchdog.failed is not None:  # the group is broken: do not add another full timeout
        watchdog.wait(work, what, nbytes)  # raises the earlier failure's "not attempted"
    t0 = time.perf_counter()
    arrival = waiter_for(group).watch([work], watchdog.timeout)
    with watchdog.watched(what, nbytes):
        arrived = arrival.event.wait(watchdog.timeout.total_seconds())
    if not arrived:
        late = TimeoutError(f"timed out after {watchdog.timeout.total_seconds():g} s")
        raise watchdog.failure(what, nbytes, late, time.perf_counter() - t0)
    try:
        arrival.check()
    except RuntimeError as exc:
        raise watchdog.failure(what, nbytes, exc, time.perf_counter() - t0) from exc


class _Bounded:
    """What both bounded collectives share: the watchdog they wait through, and torch's default allocation."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)  # torch's default allocation (DefaultAllocMixin)


class BoundedReduceScatter(_Bounded, ReduceScatter):
    """Torch FSDP's reduce-scatter inside the node (``dist.reduce_scatter_single``), waited for through ``watchdog``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=True)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        _wait(self.watchdog, group, work, "FSDP reduce-scatter inside the node", nbytes)


class BoundedAllGather(_Bounded, AllGather):
    """Torch FSDP's all-gather inside the node (``dist.all_gather_single``), waited for through ``watchdog``; done
    when it returns (torch then waits for nothing more)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        _wait(self.watchdog, group, work, "FSDP all-gather inside the node", nbytes)


def bound_inside_node(module: Any, mesh: HSDPMesh, watchdog: Watchdog) -> None:
    """On Gloo, ``module``'s (a torch ``FSDPModule`` of one parameter group) collectives inside the node waited for
    through ``watchdog``; elsewhere, or with several parameter groups (torch refuses one custom collective for
    them), left as torch issues them."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) != 1 or dist.get_backend(mesh.shard.get_group()) != "gloo":
        return
    module.set_custom_reduce_scatter(BoundedReduceScatter(watchdog))
    module.set_custom_all_gather(BoundedAllGather(watchdog))
