"""CUDA mapped onto the CPU for torch's own test suites (the DDP runner's and the FSDP runner's ranks).

torch's distributed tests are written for GPUs; on a CPU machine most are skipped or fail at their first
``.cuda()``.  Here, in a rank process only (never in the runner, never in gradientflow's own code):

- ``@skip_if_lt_x_gpu(n)`` behaves as torch's own ``allow_cpu=True``; ``@skip_if_no_gpu`` passes
  (:func:`allow_cpu_skips`, before the test module is imported: it binds the decorators at import);
- a ``TorchFunctionMode`` rewrites ``device=`` / ``.to(...)`` / ``nn.Module.to(...)`` / ``.cuda()`` to the CPU,
  and ``torch.cuda.set_device`` / ``synchronize`` / ``device`` are no-ops (:func:`map_cuda_to_cpu`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def patch(owner: object, name: str, value: object) -> None:
    """Replace ``owner.name`` at run time (torch's test modules, ``torch.cuda``): a patch, which the type checker
    would read as an assignment to a method or a class of another type."""
    setattr(owner, name, value)


def allow_cpu_skips() -> None:
    """torch's GPU-count skip decorators let a CPU rank run the test (as their own ``allow_cpu=True``)."""
    from torch.testing._internal import common_distributed as cd

    if getattr(cd.skip_if_lt_x_gpu, "_gf_allow_cpu", False):
        return
    original = cd.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Any:
        return original(x, allow_cpu=True)

    skip_if_lt_x_gpu._gf_allow_cpu = True  # type: ignore[attr-defined]
    patch(cd, "skip_if_lt_x_gpu", skip_if_lt_x_gpu)
    patch(cd, "skip_if_no_gpu", lambda func: func)


def cpu_device(d: Any) -> Any:
    """A CUDA device (as a device, a string or a bare index) becomes the CPU; anything else stays."""
    if isinstance(d, torch.device):
        return torch.device("cpu") if d.type == "cuda" else d
    if isinstance(d, str) and d.startswith("cuda"):
        return "cpu"
    if isinstance(d, int) and not isinstance(d, bool):
        return "cpu"
    return d


class CudaOnCpu(torch.overrides.TorchFunctionMode):
    """Every tensor a test puts on CUDA lives on the CPU instead."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], *map(cpu_device, args[1:]))
        elif func is torch._C._nn._parse_to:  # nn.Module.to(...)'s arguments
            args = tuple(map(cpu_device, args))
        return func(*args, **kwargs)


def map_cuda_to_cpu() -> None:
    """For the rest of this rank's life, CUDA means the CPU."""
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: 0
    patch(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
    CudaOnCpu().__enter__()
