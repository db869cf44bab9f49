"""The CPU kernels' thread pool: one small ``ThreadPoolExecutor`` shared by the row-block GEMMs
(:mod:`.cpu`) and the fused C kernels (:func:`parallel`, used by :mod:`.cpu_attention`,
:mod:`.cpu_norm` and the C row sums).

Splitting work over it never changes a bit: every item (a GEMM row block, a row, a head) is
computed whole by one thread with the same code, so only which thread computes it varies.
"""
from __future__ import annotations

import threading

import torch

PAR_MIN_WORK = 1 << 21     # multiply-adds below which a call stays on the calling thread

_POOL = None
_POOL_LOCK = threading.Lock()


def pool(n: int):
    """The shared executor, grown to at least ``n`` workers."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < n:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(n, thread_name_prefix="skyrl-invariant-gemm")
        return _POOL


def parallel(run, items: int, work: float) -> None:
    """``run(lo, hi)`` over ``0 .. items``: split over the CPU kernels' thread pool when the
    call is large (``work`` multiply-adds) and torch has more than one thread, else in place.
    Each item is computed by one thread with the same code, so the split changes no bits."""
    threads = torch.get_num_threads()
    if threads > 1 and items > 1 and work >= PAR_MIN_WORK:
        parts = min(threads, items)
        bounds = [items * j // parts for j in range(parts + 1)]
        futs = [pool(parts).submit(run, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
        for f in futs:
            f.result()
    else:
        run(0, items)
