"""The FP8 cache read's table lookup compiled (numba): ``out[i] = table[codes[i]]``.

A lookup moves bits and computes nothing, so it is bitwise the same as the torch gather it
replaces (``table.index_select(0, codes)``), which stays the fallback. Compiled on first use
with ``cache=True`` (numba's on-disk cache; per process where nothing is writable). Imported
only through :func:`skyrl_numerics.quant.kv_fp8_codec._take` (which catches a missing numba).
"""
from __future__ import annotations

from numba import njit


def _jit(fn):
    try:
        return njit(nogil=True, cache=True)(fn)
    except RuntimeError:      # no writable cache location at all: compile per process
        return njit(nogil=True, cache=False)(fn)


@_jit
def take(codes, table, out):
    """``out[i] = table[codes[i]]`` for flat ``codes`` (uint8) and a 256-entry ``table``."""
    for i in range(codes.size):
        out[i] = table[codes[i]]
