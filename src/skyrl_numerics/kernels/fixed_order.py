"""The binary32 primitives the fused CPU kernels (``csrc/*.c``) are specified with, as torch
ops: each function here performs the C code's operations in the C code's order, every one
rounded on its own (IEEE-754 binary32 ``+ - * /``, ``sqrt``, comparisons), so its results equal
the kernel's bit for bit. Used by the kernels' torch specifications (``cpu_attention``,
``cpu_norm``), which are the fallback where the C library cannot be built.

    dot8(a, b):  lane c (0..7) adds a[8u + c] · b[8u + c] over u = 0, 1, ... in order from +0
                 (a tail shorter than 8 fills the first lanes); the lanes are then folded
                 ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
    fma(a, b, c): IEEE 754's fused multiply-add in binary32, a·b + c rounded once (nearest
                 even): computed in float64 — a·b is exact there (24 + 24 bits) — with the sum
                 rounded to odd (its exact error by TwoSum), so the final float64 -> float32
                 rounding is the single correct one (53 >= 24 + 2 bits)
    exp_s(x):    0 for x <= -87 (and -inf), +inf for x > 88, NaN for NaN; else
                 n = (x·log2e + 1.5·2^23) - 1.5·2^23          (nearest integer, ties to even)
                 r = (x - n·0.693359375) - n·(-2.12194440e-4)  (Cody–Waite)
                 exp_s = (((P(r)·r^2 + r) + 1) · 2^n,  P = Cephes' degree-5 Horner polynomial
                 (relative error < 1 ulp against float64 exp; tested)
    float32 -> bfloat16: round to nearest even (torch's conversion)
"""
from __future__ import annotations

import torch

from . import native

F32 = torch.float32
#: the C kernels' dtype codes (``fixed_order.h``'s ``load_row``): the dtypes they read and write
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}



def kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the C kernels read it: float32 or bfloat16 as is (another dtype widened to
    float32: the kernel's bits are those of that widening), last dim contiguous."""
    if t.dtype not in DTYPE_CODES:
        t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()

def c32(x: float) -> torch.Tensor:
    """``x`` as a 0-d float32 tensor (so an op with it is a float32 op, as in C)."""
    return torch.tensor(x, dtype=F32)


_LOG2E, _MAGIC = c32(1.44269502162933349609375), c32(12582912.0)
_LN2_HI, _LN2_LO = c32(0.693359375), c32(-2.12194440e-4)
_POLY = [c32(v) for v in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                          1.6666665459e-1, 5.0000001201e-1)]
ONE, ZERO = c32(1.0), c32(0.0)


def exp_s(x: torch.Tensor) -> torch.Tensor:
    """The kernels' exp (module doc), elementwise on a float32 tensor."""
    xc = x.clamp(-87.0, 88.0)     # the polynomial's range (values outside are replaced below)
    t = xc * _LOG2E
    n = (t + _MAGIC) - _MAGIC
    r = xc - n * _LN2_HI
    r = r - n * _LN2_LO
    r2 = r * r
    p = _POLY[0].expand_as(r)
    for c in _POLY[1:]:
        p = p * r + c
    p = p * r2 + r
    p = p + ONE
    two_n = ((n.to(torch.int32) + 127) << 23).view(F32)
    out = p * two_n
    out = torch.where(x > -87.0, out, ZERO)
    out = torch.where(x > 88.0, torch.full_like(out, float("inf")), out)
    return torch.where(torch.isnan(x), x, out)


def dot8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The kernels' dot product over the last dim of broadcastable float32 ``a`` and ``b``."""
    prod = a * b
    n = prod.shape[-1]
    pad = -n % 8
    if pad:
        prod = torch.nn.functional.pad(prod, (0, pad))
    prod = prod.view(*prod.shape[:-1], -1, 8)
    acc = torch.zeros(prod.shape[:-2] + (8,), dtype=F32)
    for u in range(prod.shape[-2]):
        acc = acc + prod[..., u, :]
    h = acc[..., :4] + acc[..., 4:]
    q = h[..., :2] + h[..., 2:]
    return q[..., 0] + q[..., 1]


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a·b + c`` rounded once to float32 (module doc), elementwise on broadcastable float32
    tensors; inf and NaN as IEEE's fma (the float64 ops propagate them)."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bv = s - p                       # TwoSum: e = (p + cd) - s exactly
    e = (p - (s - bv)) + (cd - bv)
    inexact = (e != 0) & torch.isfinite(s) & ((s.view(torch.int64) & 1) == 0)
    toward = torch.where(e > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where(inexact, torch.nextafter(s, toward), s)     # round to odd
    return s.to(F32)


def lib():
    """The compiled kernels, or None (:mod:`.native`)."""
    return native.lib()
