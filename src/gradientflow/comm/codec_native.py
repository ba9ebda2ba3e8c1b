"""The block quantiser's CPU kernel (``codec.c``): compiled once per machine, called through ctypes.

On a CPU rank the torch-ops codec of :mod:`gradientflow.comm.quantize` walks a segment ~40 times and
cost more time than the bytes it saved (~28 ns per gradient element and step on the bench's
transformer); ``codec.c`` does one pass per block, bit-identical (tests/test_codec.py).  CUDA tensors
keep the torch ops (one kernel launch each, a few µs on a GPU).

1. At first use, ``codec.c`` is compiled with the system C compiler (``cc``, ~0.3 s) into
   ``$XDG_CACHE_HOME/gradientflow/`` (default ``~/.cache``) under a name with the hash of the source,
   the flags and the machine, then loaded with :mod:`ctypes`.  Ranks that start together each compile
   to a private temporary name and rename it into place, so none loads a half-written file.
2. ctypes releases the GIL for the call, so the ring's waiter thread keeps running beside it.
3. No compiler, a failed build or a read-only cache: a warning, once, and the torch ops (same bits,
   slower).  Whether a rank uses the kernel cannot change its results, so ranks need not agree on it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("codec.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off")
"""``-ffp-contract=off``: no fused multiply-add, so every float op rounds as torch's separate ops do."""


def _flags() -> tuple[str, ...]:
    """:data:`FLAGS`, plus 8-wide vectors where torch found AVX2 on this CPU (the encode 1.7x faster,
    measured on the bench's 3.2M transformer: 4.1 against 7.1 ms); the same bits, only wider."""
    wide = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return (*FLAGS, "-mavx2") if wide and platform.machine() in ("x86_64", "AMD64") else FLAGS


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gradientflow"


def _build() -> ctypes.CDLL:
    src, flags = SOURCE.read_bytes(), _flags()
    key = hashlib.sha256(src + " ".join(flags).encode() + platform.machine().encode()).hexdigest()[:16]
    target = _cache_dir() / f"codec-{key}.so"
    if not target.exists():
        cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if cc is None:
            raise OSError("no C compiler (cc, gcc or clang) on PATH")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    f32 = ctypes.c_float
    lib.gf_quantize.argtypes = [p, i64, i32, i32, p, p, f32, p, p, p, p, i32]
    lib.gf_quantize.restype = None
    lib.gf_dequantize.argtypes = [p, p, i64, i32, i32, p, f32, p, i32]
    lib.gf_dequantize.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it cannot be built here (logged once)."""
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _build()
                except (OSError, subprocess.SubprocessError) as exc:
                    logger.warning(
                        "gradientflow: the CPU quantisation kernel is unavailable (%s); using torch ops", exc
                    )
                _tried = True
    return _lib


def applies(*tensors: torch.Tensor) -> bool:
    """The kernel handles contiguous CPU tensors; everything else keeps the torch ops."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and library() is not None


@functools.cache  # the levels' midpoints and polynomial per width: built once, not per bucket and step
def _floats(values: tuple[float, ...]) -> ctypes.Array[ctypes.c_float]:
    return (ctypes.c_float * 3)(*values, *(0.0,) * (3 - len(values)))


def quantize(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    mids: tuple[float, ...],
    poly: tuple[float, ...],
    decoded: torch.Tensor,
    err: torch.Tensor | None,
    carry: bool = False,
    first: float = 0.0,
) -> None:
    """``codec.c``'s ``gf_quantize``: codes, bf16 scales, decoded values (may be ``x``) and the error;
    ``carry``: ``x + err`` is encoded; ``first``: the first level (0 but for levels without a zero)."""
    lib = library()
    assert lib is not None, "callers check applies() first"
    lib.gf_quantize(
        x.data_ptr(),
        x.numel(),
        bits,
        block,
        _floats(mids),
        _floats(poly),
        first,
        codes.data_ptr(),
        scales.data_ptr(),
        decoded.data_ptr(),
        None if err is None else err.data_ptr(),
        int(carry),
    )


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    m: int,
    bits: int,
    block: int,
    poly: tuple[float, ...],
    out: torch.Tensor,
    accumulate: bool,
    first: float = 0.0,
) -> None:
    """``codec.c``'s ``gf_dequantize``: ``m`` decoded values into ``out`` (added to it if ``accumulate``);
    ``first``: the first level (0 but for levels without a zero)."""
    lib = library()
    assert lib is not None, "callers check applies() first"
    lib.gf_dequantize(
        codes.data_ptr(), scales.data_ptr(), m, bits, block, _floats(poly), first, out.data_ptr(), int(accumulate)
    )
