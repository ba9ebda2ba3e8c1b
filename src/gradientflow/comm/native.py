"""Small C kernels for CPU tensors: compiled once per machine with the system's ``cc``, loaded with ctypes.

Used where torch's ops walk a tensor several times and one fused pass is what the step can afford
(the quantiser's codec, :mod:`.codec_native`; CSC's accumulate-and-score,
:mod:`gradientflow.strategies.csc_native`).  CUDA tensors keep torch's ops.

1. At first use, a kernel's ``.c`` file is compiled (``cc``, ~0.3 s) into
   ``$XDG_CACHE_HOME/gradientflow/`` (default ``~/.cache``) under a name with the hash of the source,
   the flags and the machine, then loaded with :mod:`ctypes`.  Ranks that start together each compile
   to a private temporary name and rename it into place, so none loads a half-written file.
2. ctypes releases the GIL for the call, so Gloo's and the ring's threads keep running beside it.
3. No compiler, a failed build or a read-only cache: a warning, once per kernel, and the caller's torch
   ops.  A kernel must give its caller's results (bit-identical, or equal up to what the caller
   documents), so whether a rank uses it never changes what ranks agree on.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
"""``-ffp-contract=off``: no fused multiply-add, so every float op rounds as torch's separate ops do;
``-fno-math-errno``: ``sqrtf`` vectorises (it need not set ``errno`` for a negative input; its value is NaN still)."""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def flags() -> tuple[str, ...]:
    """:data:`FLAGS`, plus 8-wide vectors where torch found AVX2 on this CPU (the codec's encode faster:
    docs/results/benchmarks.md#figures-behind-the-codes-comments), and the fp16 conversion
    instructions where the CPU lists them (else ``_Float16`` casts are libgcc calls); the same bits.  ``-mfma``
    with them: torch's AVX2 kernels fuse some multiply-adds (``addcmul_``), and a kernel that mirrors one calls
    ``fmaf`` where ``__FMA__`` is defined (no contraction elsewhere: ``-ffp-contract=off``)."""
    wide = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if not (wide and platform.machine() in ("x86_64", "AMD64")):
        return FLAGS
    return (*FLAGS, "-mavx2", "-mfma", "-mf16c") if "f16c" in _cpu_flags() else (*FLAGS, "-mavx2", "-mfma")


_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gradientflow"


def _build(source: Path) -> ctypes.CDLL:
    src, fl = source.read_bytes(), flags()
    key = hashlib.sha256(src + " ".join(fl).encode() + platform.machine().encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if cc is None:
            raise OSError("no C compiler (cc, gcc or clang) on PATH")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *fl, "-o", tmp, str(source), "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def load(source: Path, declare: Callable[[ctypes.CDLL], None], what: str) -> ctypes.CDLL | None:
    """The kernel built from ``source`` (``declare`` sets its functions' ctypes signatures), or None
    where it cannot be built here (logged once, naming ``what`` falls back to torch ops)."""
    if source not in _loaded:
        with _lock:
            if source not in _loaded:
                lib: ctypes.CDLL | None = None
                try:
                    lib = _build(source)
                    declare(lib)
                except (OSError, subprocess.SubprocessError, AttributeError) as exc:
                    logger.warning(
                        "gradientflow: the CPU kernel for %s is unavailable (%s); using torch ops", what, exc
                    )
                    lib = None
                _loaded[source] = lib
    return _loaded[source]
