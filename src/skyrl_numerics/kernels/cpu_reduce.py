"""Batch-invariant sums and means on CPU: a fixed pairwise tree (:func:`row_sum`), its C
version (``csrc/row_sum.c``) for large float32 inputs, and :func:`reduce` over any dims.

Stock torch on CPU is NOT batch-invariant here either (measured, torch 2.13 + MKL, 2 threads):
``x.mean(-1)`` / ``x.sum(-1)`` over rows longer than 32768 differ between M=1 and M>1 (one row
is split across threads; several rows are not), and torch's ``sum`` lands an element in its
vectorized body or its scalar tail by the row's length, so trailing zeros change its bits
(measured in 30 % of padded softmax rows).

:func:`row_sum` adds instead by a pairwise tree of IEEE additions at fixed positions — within
blocks of ``SUM_BLOCK`` (1024) elements by halving (``x[i] + x[i + h]``), then over the block
sums the same way, each level zero-padded to a power of two. A row of n values followed by zeros
reduces to the same bits as the n values alone (every extra addition adds +0), the order does
not depend on the number of rows, threads or the CPU's vector width, and every operation is a
correctly rounded add: the same bits on every ISA.
"""
from __future__ import annotations

import torch

from . import native
from ._util import compute_dtype as _compute_dtype, pad_last as _pad_last
from .pool import parallel

SUM_BLOCK = 1024       # row_sum's first-level block (a power of two)


def _halve_to_one(x: torch.Tensor) -> torch.Tensor:
    """(..., P) with P a power of two -> (...): ``x = x[..., :h] + x[..., h:]`` until one."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_NATIVE_SUM_MIN = 4096    # elements below which the torch code is as fast as a C call


def _row_sum_native(lib, x: torch.Tensor) -> torch.Tensor:
    """:func:`row_sum` of float32 ``x`` by ``csrc/row_sum.c`` (the same operations), rows split
    over the CPU kernels' thread pool for large calls (a row is one thread's: no bits change)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1 or x2.stride(0) < N:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.float32)

    def run(lo: int, hi: int) -> None:
        if lib.skyrl_row_sum(x2.data_ptr(), x2.stride(0), N, out.data_ptr(), lo, hi) != 0:
            raise MemoryError("skyrl_row_sum: no memory for its block buffer")

    parallel(run, x2.shape[0], x2.numel())
    return out.view(x.shape[:-1])


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in fp32 (fp64 stays fp64; integers and bools sum exactly in int64):
    the pairwise tree of the module doc. Invariant to the number of rows and to trailing zeros;
    the same bits on every CPU ISA; a sum of zeros is +0. Large float32 inputs run the same
    operations in C (``csrc/row_sum.c``) when the kernels are built."""
    if x.is_complex():
        raise NotImplementedError("batch-invariant sum of a complex tensor")
    x = x.to(torch.int64 if not x.is_floating_point() else _compute_dtype(x))
    N = x.shape[-1]
    if N == 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype)
    if x.dtype == torch.float32 and x.numel() >= _NATIVE_SUM_MIN:
        lib = native.lib()
        if lib is not None:
            return _row_sum_native(lib, x)
    P = min(_pow2(N), SUM_BLOCK)
    nb = -(-N // P)
    blocks = _halve_to_one(_pad_last(x, nb * P).reshape(*x.shape[:-1], nb, P))
    total = _halve_to_one(_pad_last(blocks, _pow2(nb)))
    return total + 0 if total.is_floating_point() else total   # (+0: a -0 total is +0, as padded)


def reduce(x: torch.Tensor, dims, keepdim: bool, mean: bool, dtype=None) -> torch.Tensor:
    """sum/mean over ``dims`` (None or empty = all): kept dims first, reduced dims flattened
    last, then :func:`row_sum`. The result's dtype follows torch: ``dtype``, else int64 for an
    integer or bool input, else the input's."""
    if x.dim() == 0:
        x = x.reshape(1)
        dims, keepdim = None, False
    nd = x.dim()
    red = sorted({d % nd for d in dims}) if dims else list(range(nd))
    kept = [d for d in range(nd) if d not in red]
    xp = x.permute(*kept, *red)
    P = 1
    for d in kept:
        P *= x.shape[d]
    R = x.numel() // P if P else 0
    x2 = xp.reshape(P, R)
    out = row_sum(x2)
    if mean:
        out = out / R
    res_dtype = dtype or (x.dtype if x.is_floating_point() else torch.int64)
    out = out.to(res_dtype).reshape([x.shape[d] for d in kept])
    if keepdim:
        for d in red:
            out = out.unsqueeze(d)
    return out
