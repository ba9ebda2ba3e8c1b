"""torch DDP's communication hooks on gradientflow's dense path.

``model.register_comm_hook(state, hook)`` hands every bucket of the pool to ``hook(state, bucket)``
instead of the engine's own strategy, with torch DDP's ``GradBucket`` contract: ``buffer()`` is
the bucket's flat slice of the pool holding the *local, undivided* gradients (the hook averages,
as torch's ``allreduce_hook`` does), ``gradients()`` the per-parameter views into it,
``parameters()``, ``index()``, ``is_last()``, ``set_buffer(t)``.  The hook returns a
``torch.futures.Future`` whose value is the bucket's result; the engine waits for every bucket's
future at the end of backward and writes each value into the pool (= into every ``.grad``).

So torch's own hooks run unchanged (``allreduce_hook``, ``fp16_compress_hook``,
``bf16_compress_hook``, PowerSGD, post-local SGD, ``then()`` chains), on gradientflow's buckets.
A hook replaces the strategy: it cannot be combined with ``comm_dtype`` other than fp32 or with
``density`` (the hook decides what goes on the wire; both would claim the bucket).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..diagnostics.stats import StepStats
from ..engine.pool import Bucket, GradPool
from ..engine.protocol import SyncStrategy

CommHook = Callable[[Any, Any], torch.futures.Future]


class GradBucket:
    """What a hook receives for one bucket (torch's ``dist.GradBucket`` interface)."""

    def __init__(self, index: int, last: bool, flat: torch.Tensor, grads: list[torch.Tensor], params: list) -> None:
        self._index, self._last, self._buffer = index, last, flat
        self._grads, self._params = grads, params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


class HookSync(SyncStrategy):
    """Each ready bucket goes to the user's hook; ``finish`` waits for the futures and writes the values back."""

    def __init__(self, pool: GradPool, params: list[torch.nn.Parameter], state: Any, hook: CommHook) -> None:
        self.pool, self.params, self.state, self.hook = pool, params, state, hook
        self._pending: list[tuple[torch.Tensor, torch.futures.Future]] = []

    def launch(self, bucket: Bucket, flat: torch.Tensor, stats: StepStats, divided: bool = False) -> None:
        # take_fresh is the base class's plain copy, so a bucket reaching a hook is never pre-divided
        assert not divided
        n = len(self.pool.layout.buckets)
        grads = [self.pool.views[i] for i in bucket.params]
        params = [self.params[i] for i in bucket.params]
        stats.record_collective(flat.numel() * flat.element_size())
        fut = self.hook(self.state, GradBucket(bucket.index, bucket.index == n - 1, flat, grads, params))
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future or a Work's get_future()
            raise RuntimeError(
                f"gradientflow: the communication hook must return a torch.futures.Future, got {type(fut).__name__}"
            )
        self._pending.append((flat, fut))

    def relayout(self, old_layout: Any, new_pool: GradPool) -> None:
        self.pool = new_pool

    def finish(self, stats: StepStats) -> None:
        pending, self._pending = self._pending, []
        for flat, fut in pending:
            value = fut.wait()
            result = value[0] if isinstance(value, (list, tuple)) else value
            if not isinstance(result, torch.Tensor) or result.numel() != flat.numel():
                raise RuntimeError(
                    "gradientflow: a communication hook's future must hold the bucket's tensor "
                    f"({flat.numel()} elements), got {type(result).__name__}"
                )
            if result.data_ptr() != flat.data_ptr():
                flat.copy_(result.view(flat.shape))


def make_hook_sync(params: list[torch.nn.Parameter], state: Any, hook: CommHook) -> Callable[..., SyncStrategy]:
    """The reducer's ``make_sync`` for a registered hook."""

    def make(pool: GradPool, shapes: list[torch.Size]) -> SyncStrategy:
        return HookSync(pool, params, state, hook)

    return make


def builtin_hook(comm_hook_type: Any) -> CommHook:
    """torch's ``dist.BuiltinCommHookType`` to the Python hook it names (same numerics)."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415

    if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
        return default_hooks.allreduce_hook
    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    raise ValueError(f"unknown built-in communication hook {comm_hook_type!r}: ALLREDUCE or FP16_COMPRESS")
