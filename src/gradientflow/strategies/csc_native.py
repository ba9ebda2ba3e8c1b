"""CSC's CPU kernels (``csc_native.c``): one pass where torch's ops take two or three.

- :func:`add_l1`: ``v += g`` and the chunks' L1 norms.  Under CSC each fresh gradient is added into the
  residual and every chunk of it scored; the score pass re-read the whole pool from memory right after
  the add wrote it (a measurable part of a ResNet-50 step:
   docs/results/benchmarks.md#figures-behind-the-codes-comments).
  v gets the bits torch's ``add_`` gives; the scores are the L1 norms summed in another order.
- :func:`pack_rows` / :func:`unpack_rows`: the selected chunks onto an fp16 wire (gather, pre-divide,
  cast) and back into the pool (cast, scatter, finite check), bit for bit what the torch ops give.
- :func:`zero_rows`: ``rows[idx] = 0``, a memset per row (the pool's clear, the residual's masking).

Built and loaded by :mod:`gradientflow.comm.native` (no compiler: :func:`available` is False and CSC
keeps its torch ops).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from ..comm import native

SOURCE = Path(__file__).with_name("csc_native.c")


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gf_add_l1.argtypes = [p, p, i64, i64, i64, p]
    lib.gf_add_l1.restype = None
    lib.gf_pack_rows_f16.argtypes = [p, i64, p, i64, ctypes.c_float, p]
    lib.gf_pack_rows_f16.restype = None
    lib.gf_unpack_rows_f16.argtypes = [p, i64, p, i64, p]
    lib.gf_unpack_rows_f16.restype = ctypes.c_int
    lib.gf_zero_rows.argtypes = [p, i64, p, i64]
    lib.gf_zero_rows.restype = None


def _lib() -> ctypes.CDLL | None:
    return native.load(SOURCE, _declare, "CSC's accumulate-and-score and fp16 pack")


def available() -> bool:
    """Whether the kernels could be built on this machine."""
    return _lib() is not None


def add_l1(v: torch.Tensor, g: torch.Tensor, offset: int, chunk: int, scores: torch.Tensor) -> None:
    """``v += g`` and ``scores[c] += |v|`` summed over chunk ``c``'s elements of ``v``, where ``v``
    starts at element ``offset`` of a pool cut into ``chunk``-element chunks and ``scores[0]`` is
    the pool's first chunk's score: contiguous fp32 CPU tensors, ``v`` and ``g`` of one size.  Callers
    check :func:`available` first."""
    lib = _lib()
    assert lib is not None, "callers check available() first"
    last = (offset + max(v.numel(), 1) - 1) // chunk
    if scores.numel() <= last or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError(f"scores must be contiguous fp32 with at least {last + 1} chunks, got {scores.numel()}")
    lib.gf_add_l1(v.data_ptr(), g.data_ptr(), v.numel(), offset, chunk, scores.data_ptr())


def add_l1_unchecked() -> Any:
    """``gf_add_l1`` itself, called with ``(v_ptr, g_ptr, n, offset, chunk, scores_ptr)``: for a caller
    that has checked its tensors once for many calls (the engine's per-parameter hook, where
    :func:`add_l1`'s checks cost more than the kernel on small parameters).  None without a compiler."""
    lib = _lib()
    return None if lib is None else lib.gf_add_l1


def rows_fit(rows: torch.Tensor) -> bool:
    """Whether ``rows`` is the kernels' case: a contiguous 2-D fp32 CPU tensor."""
    return rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2 and rows.is_contiguous()


def _check_idx(rows: torch.Tensor, idx: torch.Tensor) -> None:
    """Contiguous int64 indices, none outside ``rows``: a raw pointer would read or write past it."""
    if not (rows_fit(rows) and idx.dtype == torch.int64 and idx.is_contiguous()):
        raise TypeError("csc_native: contiguous 2-D CPU fp32 rows and int64 indices only")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows.shape[0]):
        raise IndexError(f"row index out of range for {rows.shape[0]} rows")


def _check(rows: torch.Tensor, idx: torch.Tensor, wire: torch.Tensor) -> None:
    """The pack/unpack kernels' case: :func:`_check_idx`'s, and a contiguous fp16 wire of len(idx) rows."""
    _check_idx(rows, idx)
    if wire.dtype != torch.float16 or not wire.is_contiguous():
        raise TypeError("csc_native: an fp16 contiguous wire only")
    if wire.numel() != idx.numel() * rows.shape[1]:
        raise ValueError(f"wire must hold len(idx) rows of {rows.shape[-1]}, got {wire.numel()} for {idx.numel()}")


def pack_rows(rows: torch.Tensor, idx: torch.Tensor, scale: float, wire: torch.Tensor) -> None:
    """``wire = (rows[idx] * scale).to(float16)`` in one pass, the same bits as those torch ops
    (``scale`` rounded to fp32, the product to fp32, then to fp16)."""
    _check(rows, idx, wire)
    lib = _lib()
    assert lib is not None, "callers check available() first"
    lib.gf_pack_rows_f16(rows.data_ptr(), rows.shape[1], idx.data_ptr(), idx.numel(), scale, wire.data_ptr())


def unpack_rows(rows: torch.Tensor, idx: torch.Tensor, wire: torch.Tensor) -> bool:
    """``rows[idx] = wire.float()`` in one pass; returns whether every value was finite (an fp16 sum
    can overflow to inf)."""
    _check(rows, idx, wire)
    lib = _lib()
    assert lib is not None, "callers check available() first"
    return not lib.gf_unpack_rows_f16(rows.data_ptr(), rows.shape[1], idx.data_ptr(), idx.numel(), wire.data_ptr())


def zero_rows(rows: torch.Tensor, idx: torch.Tensor) -> None:
    """``rows[idx] = 0`` (``rows.index_fill_(0, idx, 0.0)``), one memset per row; like
    :func:`unpack_rows`, a raw write that does not bump ``rows``' version counter."""
    _check_idx(rows, idx)
    lib = _lib()
    assert lib is not None, "callers check available() first"
    lib.gf_zero_rows(rows.data_ptr(), rows.shape[1], idx.data_ptr(), idx.numel())
