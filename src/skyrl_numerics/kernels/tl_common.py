"""Triton helpers shared by the kernels.

``dot``: the one matrix product all kernels use. On GPU it is ``tl.dot`` (tensor cores; fp32
inputs forced to IEEE, no TF32). Under the interpreter ``tl.dot`` calls numpy/OpenBLAS, whose
result for a row changes with the row's POSITION inside the tile (measured: ~800 of 3200 rows of
random 16x16 @ 16x8 products differ when the row moves), which would make every invariance
test meaningless; there (``PORTABLE``) it is an explicit multiply + sum over K instead, whose
order is the same for every row. The GPU claim (an MMA treats every row alike) is checked on the
GPU by the ``gpu``-marked tests (``benchmarks/gpu_check.py`` runs them); the ``tl.dot`` branch itself runs in the interpreter (fp32,
``portable=False``, vs the float64 reference) in ``tests/kernels/test_tl_dot_branch.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, PORTABLE: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if PORTABLE:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
