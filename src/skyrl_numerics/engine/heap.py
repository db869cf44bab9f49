"""Keep a CPU worker's freed memory in its heap (glibc ``mallopt``), so per-step buffers do not
page-fault on every step.

The invariant forward allocates its working tensors fresh each step (row blocks, gathered
expert weights, attention outputs: 0.1–1 MB each on the tiny models, more on real ones).
glibc serves an allocation above its mmap threshold with a fresh ``mmap`` and unmaps it on
free, so every step touches new pages and takes a page fault per 4 KB; its dynamic threshold
starts at 128 KB and only moves when a large block is freed. Measured in the vLLM worker
(tiny Qwen3-MoE, 16 × 64 decode): an expert-weight gather of 512 KB took 197 µs per call
against 65 µs with the heap kept, and the decode forward 5.7 → 4.7 ms (BENCHMARKS.md). This is
what vLLM's CPU guide gets by preloading tcmalloc; here it is two ``mallopt`` calls in the
worker that runs the model (the engine calls :func:`keep_heap` when it builds the model):
``M_MMAP_THRESHOLD`` = 32 MiB (glibc's largest) and ``M_TRIM_THRESHOLD`` = 256 MiB. Freed
memory then stays mapped for reuse. Nothing changes numerically. A no-op where the C library
is not glibc; ``SKYRL_NUMERICS_KEEP_HEAP=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20

_DONE: bool | None = None


def keep_heap() -> bool:
    """Set the two thresholds once per process; True when glibc accepted both."""
    global _DONE
    if _DONE is not None:
        return _DONE
    _DONE = False
    if os.environ.get("SKYRL_NUMERICS_KEEP_HEAP", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _DONE = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _DONE
