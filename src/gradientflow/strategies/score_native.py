"""CSC's accumulate-and-score kernel (``score_native.c``): ``v += g`` and the chunks' L1 in one pass.

Under CSC each fresh gradient is added into the residual and every chunk of the residual is then
scored by its L1 norm; the score pass re-read the whole pool from memory right after the add wrote
it (~19 ms of a ResNet-50 step, 2 ranks on 2 cores).  The kernel sums each chunk's score while it
writes v.  v gets the bits torch's ``add_`` gives; the scores are the L1 norms summed in another
order.  Built and loaded by :mod:`gradientflow.comm.native` (no compiler: ``available()`` is False
and CSC keeps its add and score pass).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..comm import native

SOURCE = Path(__file__).with_name("score_native.c")


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gf_add_l1.argtypes = [p, p, i64, i64, i64, p]
    lib.gf_add_l1.restype = None


def available() -> bool:
    """Whether the kernel could be built on this machine."""
    return native.load(SOURCE, _declare, "CSC's accumulate-and-score") is not None


def applies(v: torch.Tensor, g: torch.Tensor) -> bool:
    """The kernel's case: contiguous fp32 CPU tensors of the same size."""
    return (
        v.device.type == "cpu"
        and g.device.type == "cpu"
        and v.dtype == torch.float32
        and g.dtype == torch.float32
        and v.is_contiguous()
        and g.is_contiguous()
        and v.numel() == g.numel()
    )


def add_l1(v: torch.Tensor, g: torch.Tensor, offset: int, chunk: int, scores: torch.Tensor) -> None:
    """``v += g`` and ``scores[c] += |v|`` summed over chunk ``c``'s elements of ``v``, where ``v``
    starts at element ``offset`` of a pool cut into ``chunk``-element chunks and ``scores[0]`` is
    the pool's first chunk's score.  Callers check :func:`applies` and :func:`available` first."""
    lib = native.load(SOURCE, _declare, "CSC's accumulate-and-score")
    assert lib is not None, "callers check available() first"
    last = (offset + max(v.numel(), 1) - 1) // chunk
    if scores.numel() <= last or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError(f"scores must be contiguous fp32 with at least {last + 1} chunks, got {scores.numel()}")
    lib.gf_add_l1(v.data_ptr(), g.data_ptr(), v.numel(), offset, chunk, scores.data_ptr())
