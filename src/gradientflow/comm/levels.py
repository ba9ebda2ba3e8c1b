"""The quantiser's level tables: which levels a code stands for, as :mod:`.quantize` encodes and decodes them.

A table's levels are fractions of a block's scale.  :func:`mids` (where one code gives way to the next) and
:func:`poly` (the levels as a polynomial in the code, for a decode without a lookup) are derived from them and
shared by the torch ops of :mod:`.quantize` and the C kernel of :mod:`.codec_native`, so both decode the same
floats.  :func:`kernel_table` is the kernel's view of one table, for callers that run the kernel on their own
layout (CSC's rows, ``strategies.csc_quantized``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ..option_values import QUANT_LEVELS


def max_code(bits: int) -> int:
    """``L``: uniform codes are the integers -L..L."""
    return 2 ** (bits - 1) - 1


CODEBOOKS: dict[int, tuple[float, ...]] = {2: (0.46,), 3: (0.2, 0.43, 0.75)}
"""Non-uniform levels ``l_1 < .. < l_L`` (fractions of the block's scale; level 0 is 0, code -k is
-l_k): a 1-D Lloyd-Max (k-means) fit to block-normalised gradients ``x / max|x|`` of the bench's AdamW
transformer.  Most of a block sits far below its max, so uniform steps of s/L round most of it to 0;
these levels cut the quantisation error's energy by 28-41% (3 bits) and 55-70% (2 bits) at the same
bytes (measured on its gradients at steps 5, 60 and 119), and took the transformer's final loss from
1.024x DDP's to 1.012x (3 bits, seed 0)."""


ZEROLESS: dict[int, tuple[float, ...]] = {2: (0.15, 0.54)}
"""Levels without a zero, ``l_0 < .. < l_{K-1}`` (``K = 2**(bits-1)``; code ``k`` is ``+l_k``, with the sign
bit ``-l_k``), fitted as :data:`CODEBOOKS` (``experiments/fit_levels.py``).  At 2 bits the fitted table
has three levels (``0, ±l_1``: the code "-0" is unused); these four carry less error energy at the same
bytes (``docs/results/adamw.md``, "Below 0.07 of the bytes")."""

LEVELS = QUANT_LEVELS
"""``levels``: :data:`CODEBOOKS` (with a zero), ``k / L`` of the scale, or :data:`ZEROLESS`."""


def table(bits: int, levels: str) -> tuple[float, ...]:
    """The level magnitudes by code magnitude ``k``: ``0, l_1 .. l_L`` or ``l_0 .. l_{K-1}``."""
    return ZEROLESS[bits] if levels == "zeroless" else (0.0, *CODEBOOKS[bits])


def tabled(bits: int, levels: str) -> bool:
    """Whether ``levels`` at ``bits`` is a table (else uniform steps); ``ValueError`` for levels that do not
    exist (a zeroless width without a table would silently be uniform)."""
    if levels not in LEVELS or (levels == "zeroless" and bits not in ZEROLESS):
        raise ValueError(
            f"levels must be one of {list(LEVELS)} ('zeroless' at bits in {list(ZEROLESS)}), got {levels!r} at "
            f"{bits} bits"
        )
    return (levels == "fitted" and bits in CODEBOOKS) or levels == "zeroless"


def kernel_levels(bits: int, levels: str) -> bool:
    """The levels :mod:`.codec_native`'s kernel has: the tables of 2 and 3 bits (with a zero or not)."""
    return bits in (2, 3) and levels in ("fitted", "zeroless") and tabled(bits, levels)


@functools.cache
def mids(bits: int, levels: str = "fitted") -> tuple[float, ...]:
    """The midpoints between consecutive levels of :func:`table`: a magnitude above ``mids[j]`` is at
    least code magnitude j+1."""
    lv = table(bits, levels)
    return tuple((a + b) / 2 for a, b in zip(lv, lv[1:]))


@functools.cache
def poly(bits: int, levels: str = "fitted") -> tuple[float, ...]:
    """``c_1 .. c_n`` with ``sum_i c_i j**i == l_j - l_0`` for every code magnitude ``j``: the levels, less the
    first (0 for :data:`CODEBOOKS`), as a polynomial in ``k`` (exact interpolation, solved in float64)."""
    lv = table(bits, levels)
    n = len(lv) - 1
    a = [[float(j**i) for i in range(1, n + 1)] for j in range(1, n + 1)]
    b = [v - lv[0] for v in lv[1:]]
    for c in range(n):  # Gauss-Jordan on an n x n Vandermonde (n <= 3)
        piv = a[c][c]
        a[c] = [v / piv for v in a[c]]
        b[c] /= piv
        for r in range(n):
            if r != c and a[r][c]:
                f = a[r][c]
                a[r] = [v - f * w for v, w in zip(a[r], a[c])]
                b[r] -= f * b[c]
    return tuple(b)


class KernelTable(NamedTuple):
    """What :mod:`.codec_native`'s kernel takes for one table: the first level (0 for :data:`CODEBOOKS`), the
    midpoints (:func:`mids`) and the polynomial's coefficients (:func:`poly`)."""

    first: float
    mids: tuple[float, ...]
    poly: tuple[float, ...]


def kernel_table(bits: int, levels: str) -> KernelTable:
    """The kernel's arguments for ``levels`` at ``bits`` (a table :func:`kernel_levels` accepts)."""
    return KernelTable(table(bits, levels)[0], mids(bits, levels), poly(bits, levels))
