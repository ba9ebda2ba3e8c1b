"""The exchange between nodes overlapping the next module's backward: posted in the all-reduce hook, finished later.

Torch 2.13's ``foreach_reduce`` calls the hook on the reduce-scatter's output and, as soon as it returns, post-divides
that tensor (fp16 only), casts it to the parameters' dtype and views each parameter's piece as its sharded ``.grad``,
or adds the piece to a ``.grad`` already there (accumulation across backward passes).  A hook that returns before
its exchange is done must therefore give torch something to write now and write the result later into the tensor
torch left as ``.grad``:

- :func:`post`: the shard is copied into a buffer of gradientflow's own, the exchange is posted on that buffer, and
  the shard torch keeps is zeroed: torch views zeros as the ``.grad`` (or adds zeros to it);
- :func:`finish_posted`: when the next module's hook runs (one exchange in flight, as the DDP engine keeps its
  rings), or at the latest in a final callback of the backward pass, queued by the first post (autograd runs it
  after torch's root callback, which runs the last post-backwards, and before ``backward()`` returns, so before any
  optimizer or ``clip_grad_norm_`` reads a gradient), the messages are waited for, the user's hook runs on the
  result (torch HSDP's order: after the reduction), and what torch does after its hook is replayed on the result
  (:func:`write_grads`): the post-division, the cast, each parameter's ``as_strided`` piece copied into its
  ``.grad``'s local tensor, or added to it where torch accumulated.

The same operations on the same values as a hook that waits: bit for bit its ``.grad`` (``x + 0 == x``; zeros
copied over).  Not deferred, the hook waits as before: parameters offloaded to the CPU (torch copies the piece to
host memory with events of its own), parameters with post-accumulate-grad hooks (torch calls them right after it
writes ``.grad``: they would see zeros), a shard that does not hold every parameter (frozen parameters: torch's
pieces are then not the module's layout), and a hook called outside a backward pass (no final callback to finish
in).  On a CUDA device the exchange is posted on the hook's stream and finished on the stream current where it is
finished (the next hook's, or the default stream in the final callback, which the optimizer then runs on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Variable
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _div_if_needed, _get_gradient_divide_factors
from torch.distributed.fsdp._fully_shard._fsdp_common import _to_dtype_if_needed

logger = logging.getLogger(__name__)


@dataclass
class Posted:
    """One module's exchange in flight: ``finish`` waits for it, leaving the average in ``x`` (the buffer it was
    posted on) and running what follows it (the user's hook, :func:`write_grads`)."""

    finish: Callable[[], None]


_IN_FLIGHT: list[Posted] = []  # at most one: the last module's exchange, finished when the next hook runs
_CALLBACK: list[bool] = []  # a final callback is queued for this backward pass


def deferrable(param_group: Any, t: torch.Tensor, numel: int) -> bool:
    """Whether torch's writes after the hook can be replayed for ``param_group`` (the module docstring's cases)."""
    if t.numel() != numel:
        return False
    for fsdp_param in param_group.fsdp_params:
        if fsdp_param.offload_to_cpu or getattr(fsdp_param.sharded_param, "_post_accumulate_grad_hooks", None):
            return False
    return True


def accumulating(param_group: Any) -> list[bool]:
    """Per parameter, whether torch will add the hook's output to a ``.grad`` already there (its own test)."""
    return [fsdp_param.sharded_param.grad is not None for fsdp_param in param_group.fsdp_params]


def post(finish: Callable[[], None]) -> bool:
    """Keep ``finish`` for later (the next hook, or the backward pass's final callback); False where no backward
    pass runs (nothing would finish it: the caller then finishes at once)."""
    if not _CALLBACK:
        try:
            Variable._execution_engine.queue_callback(_final_callback)
        except RuntimeError:  # "Final callbacks can only be installed during backward pass."
            return False
        _CALLBACK.append(True)
    _IN_FLIGHT.append(Posted(finish))
    return True


def finish_posted() -> None:
    """Finish every exchange in flight (one at most), in the order posted."""
    while _IN_FLIGHT:
        _IN_FLIGHT.pop(0).finish()  # popped first: an exchange that raises is not finished twice


def _final_callback() -> None:
    _CALLBACK.clear()
    finish_posted()


def write_grads(param_group: Any, x: torch.Tensor, accumulate: list[bool]) -> None:
    """What torch's ``foreach_reduce`` does with the hook's output after the hook, done with ``x`` (the reduced
    shard, ``reduce_dtype``) into the ``.grad`` torch made of zeros: post-division (fp16), cast to the parameters'
    dtype, each parameter's piece (its padded shard's place, ``as_strided`` as torch views it) copied into its
    ``.grad``'s local tensor, or added where ``accumulate`` (torch added zeros there)."""
    _pre, post_divide, _rs_op, _ar_op = _get_gradient_divide_factors(
        param_group._reduce_scatter_process_group,
        None,  # gradientflow's modules are torch's FSDP on the 1-D shard mesh: no all-reduce group
        x.dtype,
        param_group.device.type,
        param_group.gradient_divide_factor,
        param_group.force_sum_reduction_for_comms,
    )
    _div_if_needed(x, post_divide)
    out = _to_dtype_if_needed(x, param_group._orig_dtype)
    offset = 0
    for fsdp_param, add in zip(param_group.fsdp_params, accumulate):
        piece = torch.as_strided(
            out, size=fsdp_param.sharded_size, stride=fsdp_param.contiguous_sharded_stride, storage_offset=offset
        )
        local = fsdp_param.sharded_param.grad._local_tensor
        if add:
            local += piece
        else:
            local.copy_(piece)
        offset += fsdp_param.padded_sharded_param_size.numel()
