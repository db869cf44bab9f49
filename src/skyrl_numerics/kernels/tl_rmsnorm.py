"""RMSNorm forward/backward in Triton, y = x * rsqrt(mean(x^2) + eps) * w.

Forward and dx are per row (one program per row, the row walked in chunks of a block size that
depends only on the hidden size). dW sums over ALL rows, so its order is pinned explicitly:

  partial[b] = ((0 + c[bR]) + c[bR+1]) + ... + c[bR+R-1]     c[r] = (g[r] * x[r]) * rstd[r]
  dW         = ((0 + partial[0]) + partial[1]) + ...          R = ROWS_PER_BLOCK (fixed)

two kernels, no atomics, FMA contraction off: the bits depend only on the rows and their order,
never on the grid or the GPU, and equal ``reference.rms_norm_dw_ordered`` exactly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import interpreting

ROWS_PER_BLOCK = 256


def row_block(n: int) -> int:
    """Chunk of the hidden dim: a function of the hidden size only."""
    return min(triton.next_power_of_2(n), 4096)


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, stride_x, stride_y, eps,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = 0.0
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += tl.sum(x * x, axis=0)
    rstd = 1.0 / tl.sqrt(acc / N + eps)
    tl.store(rstd_ptr + row, rstd)
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_dx_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, N, stride_g, stride_x, stride_dx,
                       BLOCK: tl.constexpr):
    """dx = rstd * (g w - x rstd^2 mean(g w x))."""
    row = tl.program_id(0).to(tl.int64)
    rstd = tl.load(rstd_ptr + row)
    acc = 0.0
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        mask = cols < N
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(g * w * x, axis=0)
    c = acc / N
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        mask = cols < N
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dx = rstd * (g * w - x * rstd * rstd * c)
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_dw_partial_kernel(g_ptr, x_ptr, rstd_ptr, part_ptr, M, N, stride_g, stride_x,
                               ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (row blocks, column blocks): sequential fp32 sum over the block's rows."""
    blk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    r0 = blk * ROWS
    for i in range(ROWS):
        r = (r0 + i).to(tl.int64)
        if r < M:
            g = tl.load(g_ptr + r * stride_g + cols, mask=cmask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + r * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
            acc = acc + (g * x) * tl.load(rstd_ptr + r)
    tl.store(part_ptr + blk.to(tl.int64) * N + cols, acc, mask=cmask)


@triton.jit
def rms_norm_dw_final_kernel(part_ptr, dw_ptr, NB, N, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for b in range(NB):
        acc = acc + tl.load(part_ptr + b * N + cols, mask=cmask, other=0.0)
    tl.store(dw_ptr + cols, acc.to(dw_ptr.dtype.element_ty), mask=cmask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    return x2.float() if interpreting() and x2.dtype != torch.float32 else x2


def forward(x: torch.Tensor, w: torch.Tensor, eps: float):
    """-> (y like x, rstd float32 (rows,))."""
    x2, w2 = _rows(x), _rows(w.reshape(1, -1)).reshape(-1)
    M, N = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    if M:
        rms_norm_fwd_kernel[(M,)](x2, w2, y, rstd, N, x2.stride(0), y.stride(0), float(eps),
                                  BLOCK=row_block(N))
    return y.to(x.dtype).reshape(x.shape), rstd


def backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
             rows_per_block: int = ROWS_PER_BLOCK, block_n: int = 128):
    """-> (dx like x, dw like w)."""
    g2, x2, w2 = _rows(g), _rows(x), _rows(w.reshape(1, -1)).reshape(-1)
    M, N = x2.shape
    dx = torch.empty_like(x2)
    nb = triton.cdiv(M, rows_per_block)
    part = torch.empty((max(nb, 1), N), device=x.device, dtype=torch.float32)
    dw = torch.zeros(N, device=x.device, dtype=torch.float32)
    if M:
        rms_norm_dx_kernel[(M,)](g2, x2, w2, rstd, dx, N, g2.stride(0), x2.stride(0), dx.stride(0),
                                 BLOCK=row_block(N))
        rms_norm_dw_partial_kernel[(nb, triton.cdiv(N, block_n))](
            g2, x2, rstd, part, M, N, g2.stride(0), x2.stride(0), ROWS=rows_per_block,
            BLOCK_N=block_n, enable_fp_fusion=False)
        rms_norm_dw_final_kernel[(triton.cdiv(N, block_n),)](part, dw, nb, N, BLOCK_N=block_n,
                                                             enable_fp_fusion=False)
    return dx.to(x.dtype).reshape(x.shape), dw.to(w.dtype)


def compile_specs():
    i32 = "i32"
    return [
        ("rms_norm_fwd_bf16", rms_norm_fwd_kernel,
         dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", rstd_ptr="*fp32", N=i32, stride_x=i32,
              stride_y=i32, eps="fp32"), dict(BLOCK=4096), 8),
        ("rms_norm_dx_bf16", rms_norm_dx_kernel,
         dict(g_ptr="*bf16", x_ptr="*bf16", w_ptr="*bf16", rstd_ptr="*fp32", dx_ptr="*bf16", N=i32,
              stride_g=i32, stride_x=i32, stride_dx=i32), dict(BLOCK=4096), 8),
        ("rms_norm_dw_partial_bf16", rms_norm_dw_partial_kernel,
         dict(g_ptr="*bf16", x_ptr="*bf16", rstd_ptr="*fp32", part_ptr="*fp32", M=i32, N=i32,
              stride_g=i32, stride_x=i32), dict(ROWS=ROWS_PER_BLOCK, BLOCK_N=128), 4),
        ("rms_norm_dw_final", rms_norm_dw_final_kernel,
         dict(part_ptr="*fp32", dw_ptr="*bf16", NB=i32, N=i32), dict(BLOCK_N=128), 4),
    ]
