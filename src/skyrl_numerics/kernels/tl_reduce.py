"""Sum / mean over any dims in Triton with an order that depends only on the reduced extent.

The input is viewed as (P, R): kept dims first, reduced dims last (a copy when they are not
already so). One program per output element walks R in chunks of a fixed ``BLOCK`` (a function
of R only) and adds chunk sums in order: the result for one output never depends on P.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import interpreting


@triton.jit
def row_reduce_kernel(x_ptr, out_ptr, R, stride_p, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = 0.0
    for r0 in range(0, R, BLOCK):
        cols = r0 + tl.arange(0, BLOCK)
        acc += tl.sum(tl.load(x_ptr + row * stride_p + cols, mask=cols < R, other=0.0).to(tl.float32),
                      axis=0)
    if MEAN:
        acc = acc / R
    tl.store(out_ptr + row, acc.to(out_ptr.dtype.element_ty))


def to_rows(x: torch.Tensor, dims) -> tuple[torch.Tensor, list[int]]:
    """Permute kept dims first and reduced dims last; -> ((P, R) view/copy, kept shape)."""
    nd = x.dim()
    red = sorted({d % nd for d in dims}) if dims else list(range(nd))
    kept = [d for d in range(nd) if d not in red]
    xp = x.permute(*kept, *red)
    P = 1
    for d in kept:
        P *= x.shape[d]
    x2 = xp.reshape(P, -1) if x.numel() else xp.reshape(P, 0 if P else 1)
    if x2.numel() and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, kept


def reduce(x: torch.Tensor, dims, keepdim: bool, mean: bool, dtype=None) -> torch.Tensor:
    out_dtype = dtype or x.dtype
    x2, kept = to_rows(x, dims)
    if interpreting() and x2.dtype != torch.float32:
        x2 = x2.float()
    P, R = x2.shape
    out = torch.empty(P, device=x.device, dtype=torch.float32 if interpreting() else out_dtype)
    if P:
        row_reduce_kernel[(P,)](x2, out, R, x2.stride(0), MEAN=mean,
                                BLOCK=min(triton.next_power_of_2(max(R, 1)), 4096))
    out = out.to(out_dtype).reshape([x.shape[d] for d in kept])
    if keepdim:
        nd = x.dim()
        red = sorted({d % nd for d in dims}) if dims else list(range(nd))
        for d in red:
            out = out.unsqueeze(d)
    return out


def compile_specs():
    return [("row_reduce_mean_bf16", row_reduce_kernel,
             dict(x_ptr="*bf16", out_ptr="*bf16", R="i32", stride_p="i32"),
             dict(MEAN=True, BLOCK=4096), 8)]
