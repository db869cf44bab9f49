"""Triton matmul family with a reduction order that does not depend on the batch.

Why invariant: every output element C[i, j] is produced by exactly one program, which walks K
from 0 to K in steps of a FIXED ``BLOCK_K`` and accumulates ``tl.dot`` partials in float32 in
that order. Tile sizes depend only on the dtype, never on M; there is no split-K and no atomics.
So row i of ``a @ b`` is the same bits whatever other rows are in the batch.

* ``matmul``          persistent kernel (grid = #SMs, programs walk tiles), optional bias
* ``bmm``             one program per (tile, batch entry)
* ``grouped_matmul``  MoE experts: rows of x sorted by expert, ``offsets[e]:offsets[e+1]`` use w[e];
                      a row tile that straddles experts runs the full K loop once per expert with
                      the rows of the other experts masked, so each row's K order is unchanged.

fp32 inputs use ``input_precision="ieee"`` (no TF32); bf16/fp16 accumulate in fp32 and round
once at the store. Under the interpreter (which lacks bf16 ``tl.dot``) inputs are upcast to fp32
first: bf16 x bf16 products are exact in fp32, so only the summation order can differ from GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import interpreting
from .tl_common import dot

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per input dtype. Independent of M.
CONFIGS = {
    torch.bfloat16: (128, 128, 64, 8, 8, 3),
    torch.float16: (128, 128, 64, 8, 8, 3),
    torch.float32: (64, 64, 32, 8, 4, 3),
}


@triton.jit
def _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering of output tiles (L2 reuse); affects speed only, never the math."""
    num_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_in_group
    first_m = group_id * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_size)
    pid_n = (tile_id % num_in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _dot_k_loop(a_ptr, b_ptr, offs_m, offs_n, K, stride_am, stride_ak, stride_bk, stride_bn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                IEEE: tl.constexpr, PORTABLE: tl.constexpr):
    """fp32 accumulator of a[offs_m, :] @ b[:, offs_n], K walked in fixed BLOCK_K steps."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=kk[None, :] < K, other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=kk[:, None] < K, other=0.0)
        acc = dot(a, b, acc, IEEE, PORTABLE)
    return acc


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  IEEE: tl.constexpr, PORTABLE: tl.constexpr):
    """Persistent: program p computes tiles p, p + NUM_PROGRAMS, ... each one completely."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile_id in range(start, num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_pid(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Out-of-range rows/cols read row/col 0 (always valid) and are masked at the store.
        safe_m = tl.where(offs_m < M, offs_m, 0)
        safe_n = tl.where(offs_n < N, offs_n, 0)
        acc = _dot_k_loop(a_ptr, b_ptr, safe_m, safe_n, K, stride_am, stride_ak, stride_bk,
                          stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, PORTABLE)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
               stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
               stride_cb, stride_cm, stride_cn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr, IEEE: tl.constexpr, PORTABLE: tl.constexpr):
    """Grid (tiles, batch): one program per output tile of one batch entry."""
    batch = tl.program_id(1).to(tl.int64)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_m = tl.where(offs_m < M, offs_m, 0)
    safe_n = tl.where(offs_n < N, offs_n, 0)
    acc = _dot_k_loop(a_ptr + batch * stride_ab, b_ptr + batch * stride_bb, safe_m, safe_n, K,
                      stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, PORTABLE)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grouped_matmul_kernel(x_ptr, w_ptr, c_ptr, offs_ptr, T, N, K, E,
                          stride_xm, stride_xk, stride_we, stride_wk, stride_wn,
                          stride_cm, stride_cn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          IEEE: tl.constexpr, PORTABLE: tl.constexpr):
    """Grid (row tiles of x, col tiles). Each expert whose segment meets this row tile gets a
    full K loop; rows outside its segment are masked at the store."""
    row0 = tl.program_id(0) * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe_m = tl.where(offs_m < T, offs_m, 0)
    safe_n = tl.where(offs_n < N, offs_n, 0)
    for e in range(E):
        lo = tl.load(offs_ptr + e)
        hi = tl.load(offs_ptr + e + 1)
        if (lo < row0 + BLOCK_M) & (hi > row0) & (hi > lo):
            acc = _dot_k_loop(x_ptr, w_ptr + e * stride_we, safe_m, safe_n, K,
                              stride_xm, stride_xk, stride_wk, stride_wn,
                              BLOCK_M, BLOCK_N, BLOCK_K, IEEE, PORTABLE)
            rows = (offs_m >= lo) & (offs_m < hi) & (offs_m < T)
            mask = rows[:, None] & (offs_n[None, :] < N)
            tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                     acc.to(c_ptr.dtype.element_ty), mask=mask)


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _prep(dtype: torch.dtype, config):
    cfg = config or CONFIGS[dtype]
    compute = torch.float32 if interpreting() else dtype
    return cfg, compute, compute == torch.float32


def _portable(portable: bool | None) -> bool:
    """The explicit multiply-sum instead of ``tl.dot``: under the interpreter by default (see
    ``tl_common``); ``portable=False`` forces the ``tl.dot`` (GPU) branch, e.g. to run its
    indexing and masks in the interpreter with fp32 inputs."""
    return interpreting() if portable is None else bool(portable)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, config=None,
           portable: bool | None = None, out_dtype: torch.dtype | None = None):
    """a (M, K) @ b (K, N) (+ bias (N,)) in ``out_dtype`` (default a.dtype); float32 stores the
    fp32 accumulator as it is (the same K order as the rounded result)."""
    (BM, BN, BK, GM, warps, stages), compute, ieee = _prep(a.dtype, config)
    M, K = a.shape
    N = b.shape[1]
    out_dtype = out_dtype or a.dtype
    a, b = a.to(compute), b.to(compute)
    c = torch.empty((M, N), device=a.device, dtype=torch.float32 if out_dtype == torch.float32 else compute)
    if M == 0 or N == 0:
        return c.to(out_dtype)
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    progs = min(_num_programs(a.device), tiles)
    bias_arg = bias.contiguous() if bias is not None else c
    matmul_kernel[(progs,)](a, b, c, bias_arg, M, N, K, a.stride(0), a.stride(1),
                            b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                            BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GM, NUM_PROGRAMS=progs,
                            HAS_BIAS=bias is not None, IEEE=ieee, PORTABLE=_portable(portable), num_warps=warps, num_stages=stages)
    return c.to(out_dtype)


def bmm(a: torch.Tensor, b: torch.Tensor, config=None, portable: bool | None = None,
        out_dtype: torch.dtype | None = None):
    """a (B, M, K) @ b (B, K, N) in ``out_dtype`` (default a.dtype; float32: as :func:`matmul`)."""
    (BM, BN, BK, GM, warps, stages), compute, ieee = _prep(a.dtype, config)
    Bt, M, K = a.shape
    N = b.shape[2]
    out_dtype = out_dtype or a.dtype
    a, b = a.to(compute), b.to(compute)
    c = torch.empty((Bt, M, N), device=a.device, dtype=torch.float32 if out_dtype == torch.float32 else compute)
    if Bt == 0 or M == 0 or N == 0:
        return c.to(out_dtype)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN), Bt)
    bmm_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), a.stride(2),
                     b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1), c.stride(2),
                     BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GM, IEEE=ieee, PORTABLE=_portable(portable),
                     num_warps=warps, num_stages=stages)
    return c.to(out_dtype)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, config=None,
                   portable: bool | None = None):
    """x (T, K) sorted by expert, w (E, K, N), offsets (E+1,) -> (T, N)."""
    (BM, BN, BK, _, warps, stages), compute, ieee = _prep(x.dtype, config)
    T, K = x.shape
    E, _, N = w.shape
    out_dtype = x.dtype
    x, w = x.to(compute), w.to(compute)
    c = torch.zeros((T, N), device=x.device, dtype=compute)
    if T == 0 or N == 0:
        return c.to(out_dtype)
    offs = offsets.to(device=x.device, dtype=torch.int32).contiguous()
    grid = (triton.cdiv(T, BM), triton.cdiv(N, BN))
    grouped_matmul_kernel[grid](x, w, c, offs, T, N, K, E, x.stride(0), x.stride(1),
                                w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
                                BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, IEEE=ieee, PORTABLE=_portable(portable),
                                num_warps=warps, num_stages=stages)
    return c.to(out_dtype)


def compile_specs():
    """(name, kernel, signature, constexprs, num_warps) for the compile check, bf16 configs."""
    BM, BN, BK, GM, warps, _ = CONFIGS[torch.bfloat16]
    tile = dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    i32 = "i32"
    return [
        ("matmul_bf16", matmul_kernel,
         dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", bias_ptr="*bf16", M=i32, N=i32, K=i32,
              stride_am=i32, stride_ak=i32, stride_bk=i32, stride_bn=i32, stride_cm=i32, stride_cn=i32),
         dict(tile, GROUP_M=GM, NUM_PROGRAMS=132, HAS_BIAS=True, IEEE=False, PORTABLE=False), warps),
        ("matmul_fp32_ieee", matmul_kernel,
         dict(a_ptr="*fp32", b_ptr="*fp32", c_ptr="*fp32", bias_ptr="*fp32", M=i32, N=i32, K=i32,
              stride_am=i32, stride_ak=i32, stride_bk=i32, stride_bn=i32, stride_cm=i32, stride_cn=i32),
         dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, NUM_PROGRAMS=132, HAS_BIAS=False,
              IEEE=True, PORTABLE=False), 4),
        ("bmm_bf16", bmm_kernel,
         dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", M=i32, N=i32, K=i32,
              stride_ab=i32, stride_am=i32, stride_ak=i32, stride_bb=i32, stride_bk=i32, stride_bn=i32,
              stride_cb=i32, stride_cm=i32, stride_cn=i32),
         dict(tile, GROUP_M=GM, IEEE=False, PORTABLE=False), warps),
        ("grouped_matmul_bf16", grouped_matmul_kernel,
         dict(x_ptr="*bf16", w_ptr="*bf16", c_ptr="*bf16", offs_ptr="*i32", T=i32, N=i32, K=i32, E=i32,
              stride_xm=i32, stride_xk=i32, stride_we=i32, stride_wk=i32, stride_wn=i32,
              stride_cm=i32, stride_cn=i32),
         dict(tile, IEEE=False, PORTABLE=False), warps),
    ]
