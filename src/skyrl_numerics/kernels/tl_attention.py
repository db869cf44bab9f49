"""Causal attention with a FIXED KV split, so prefill and decode give the same bits per query.

Keys are cut at fixed positions into splits of ``SPLIT`` keys (a constant, like vLLM/SGLang's
fixed split-KV size in their deterministic modes), each split into blocks of ``BLOCK_N`` keys.
For one query, split s yields a partial (m_s, l_s, a_s) by the usual online softmax over its
blocks, in block order; the partials are folded in split order:

  M' = max(M, m_s),  L' = L e^(M-M') + l_s e^(m_s-M'),  A' = A e^(M-M') + a_s e^(m_s-M');  out = A/L

Two code paths share these two helpers and therefore the bits:
* ``prefill`` (many queries): one program per query tile loops over the splits and folds in
  registers (no partials written);
* ``decode`` (few queries over a long KV cache): one program per (tile, split) writes its
  partial, a second kernel folds them. Parallel over the cache, like flash-decoding.
Blocks/splits past a query's causal limit are exact no-ops (p = 0, rescale by e^0 = 1), so a
query's result does not depend on which other queries share its tile or how long the cache is.
Queries sit at the END of the keys: query i has position Skv - Sq + i.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import interpreting
from .tl_common import dot

SPLIT = 512     # keys per split (fixed)
BLOCK_N = 64    # keys per block
BLOCK_M = 64    # queries per tile


@triton.jit
def _split_partial(q, qpos, k_base, v_base, stride_kn, stride_vn, split_lo, split_hi, Skv, scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                   PORTABLE: tl.constexpr):
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in range(split_lo, split_hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < Skv
        k = tl.load(k_base + kpos[:, None] * stride_kn + offs_d[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_base + kpos[:, None] * stride_vn + offs_d[None, :], mask=kmask[:, None], other=0.0)
        s = dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE, PORTABLE) * scale
        valid = kmask[None, :]
        if CAUSAL:
            valid = valid & (kpos[None, :] <= qpos[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, PORTABLE)
        m = m_new
    return m, l, acc


@triton.jit
def _fold_split(M, L, A, m_s, l_s, a_s):
    M_new = tl.maximum(M, m_s)
    M_safe = tl.where(M_new == float("-inf"), 0.0, M_new)
    alpha = tl.exp(M - M_safe)
    beta = tl.exp(m_s - M_safe)
    return M_new, L * alpha + l_s * beta, A * alpha[:, None] + a_s * beta[:, None]


@triton.jit
def _tile_setup(q_ptr, k_ptr, v_ptr, Sq, Skv, H, GROUP, stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_vb, stride_vh, BLOCK_M: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // GROUP).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :], mask=offs_m[:, None] < Sq, other=0.0)
    qpos = Skv - Sq + offs_m
    return q, qpos, offs_m, k_ptr + b * stride_kb + hk * stride_kh, v_ptr + b * stride_vb + hk * stride_vh


@triton.jit
def attn_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, Sq, Skv, H, GROUP, scale,
                        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                        PORTABLE: tl.constexpr):
    q, qpos, offs_m, k_base, v_base = _tile_setup(
        q_ptr, k_ptr, v_ptr, Sq, Skv, H, GROUP, stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_vb, stride_vh, BLOCK_M, HEAD_DIM)
    hi = Skv
    if CAUSAL:
        hi = tl.minimum(Skv, Skv - Sq + (tl.program_id(0) + 1) * BLOCK_M)
    M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    L = tl.zeros((BLOCK_M,), tl.float32)
    A = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for lo in range(0, hi, SPLIT):
        m_s, l_s, a_s = _split_partial(q, qpos, k_base, v_base, stride_kn, stride_vn, lo,
                                       tl.minimum(lo + SPLIT, hi), Skv, scale,
                                       BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, IEEE, PORTABLE)
        M, L, A = _fold_split(M, L, A, m_s, l_s, a_s)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
             (A / L[:, None]).to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < Sq)


@triton.jit
def attn_split_kernel(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, a_ptr, Sq, Skv, H, GROUP, scale,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn,
                      SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                        PORTABLE: tl.constexpr):
    """Grid (query tiles, B*H, splits): partial of one split -> buffers [bh, split, Sq, ...]."""
    q, qpos, offs_m, k_base, v_base = _tile_setup(
        q_ptr, k_ptr, v_ptr, Sq, Skv, H, GROUP, stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_vb, stride_vh, BLOCK_M, HEAD_DIM)
    split = tl.program_id(2)
    hi = Skv
    if CAUSAL:
        hi = tl.minimum(Skv, Skv - Sq + (tl.program_id(0) + 1) * BLOCK_M)
    lo = split * SPLIT
    m_s, l_s, a_s = _split_partial(q, qpos, k_base, v_base, stride_kn, stride_vn, lo,
                                   tl.minimum(lo + SPLIT, hi), Skv, scale,
                                   BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, IEEE, PORTABLE)
    row = (tl.program_id(1).to(tl.int64) * tl.num_programs(2) + split) * Sq + offs_m
    rmask = offs_m < Sq
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(m_ptr + row, m_s, mask=rmask)
    tl.store(l_ptr + row, l_s, mask=rmask)
    tl.store(a_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], a_s, mask=rmask[:, None])


@triton.jit
def attn_combine_kernel(m_ptr, l_ptr, a_ptr, o_ptr, Sq, H, NUM_SPLITS,
                        stride_ob, stride_oh, stride_om,
                        BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Grid (query tiles, B*H): fold the split partials in split order."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = offs_m < Sq
    offs_d = tl.arange(0, HEAD_DIM)
    bh = tl.program_id(1).to(tl.int64)
    M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    L = tl.zeros((BLOCK_M,), tl.float32)
    A = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for s in range(NUM_SPLITS):
        row = (bh * NUM_SPLITS + s) * Sq + offs_m
        m_s = tl.load(m_ptr + row, mask=rmask, other=float("-inf"))
        l_s = tl.load(l_ptr + row, mask=rmask, other=0.0)
        a_s = tl.load(a_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=rmask[:, None], other=0.0)
        M, L, A = _fold_split(M, L, A, m_s, l_s, a_s)
    b = bh // H
    h = bh % H
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
             (A / L[:, None]).to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def attention(q, k, v, causal: bool = True, scale: float | None = None, mode: str = "auto",
              split: int = SPLIT, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
              portable: bool | None = None):
    """q (B, H, Sq, D), k/v (B, Hkv, Skv, D) with unit stride on D. mode: auto|prefill|decode.
    ``portable``: None = the interpreter's explicit multiply-sum only when interpreting;
    False forces the ``tl.dot`` (GPU) branch (see ``tl_matmul._portable``)."""
    B, H, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else float(scale)
    out_dtype = q.dtype
    if interpreting() and q.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    ieee = q.dtype == torch.float32
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = torch.empty((B, H, Sq, D), device=q.device, dtype=q.dtype)
    if q.numel() == 0:
        return o.to(out_dtype)
    if mode == "auto":
        mode = "decode" if Sq <= 16 else "prefill"
    common = dict(SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D, CAUSAL=causal, IEEE=ieee,
                  PORTABLE=interpreting() if portable is None else bool(portable))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    tiles = triton.cdiv(Sq, block_m)
    if mode == "prefill":
        attn_prefill_kernel[(tiles, B * H)](q, k, v, o, Sq, Skv, H, H // Hkv, scale, *strides,
                                            o.stride(0), o.stride(1), o.stride(2), **common)
    else:
        ns = triton.cdiv(Skv, split)
        m = torch.empty((B * H, ns, Sq), device=q.device, dtype=torch.float32)
        l_ = torch.empty_like(m)
        a = torch.empty((B * H, ns, Sq, D), device=q.device, dtype=torch.float32)
        attn_split_kernel[(tiles, B * H, ns)](q, k, v, m, l_, a, Sq, Skv, H, H // Hkv, scale,
                                              *strides, **common)
        attn_combine_kernel[(tiles, B * H)](m, l_, a, o, Sq, H, ns, o.stride(0), o.stride(1),
                                            o.stride(2), BLOCK_M=block_m, HEAD_DIM=D)
    return o.to(out_dtype)


def compile_specs():
    i32 = "i32"
    qkv = dict(stride_qb=i32, stride_qh=i32, stride_qm=i32, stride_kb=i32, stride_kh=i32,
               stride_kn=i32, stride_vb=i32, stride_vh=i32, stride_vn=i32)
    head = dict(Sq=i32, Skv=i32, H=i32, GROUP=i32, scale="fp32")
    ce = dict(SPLIT=SPLIT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=128, CAUSAL=True, IEEE=False, PORTABLE=False)
    return [
        ("attn_prefill_bf16_d128", attn_prefill_kernel,
         dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", **head, **qkv,
              stride_ob=i32, stride_oh=i32, stride_om=i32), ce, 4),
        ("attn_split_bf16_d128", attn_split_kernel,
         dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", m_ptr="*fp32", l_ptr="*fp32",
              a_ptr="*fp32", **head, **qkv), ce, 4),
        ("attn_combine_bf16_d128", attn_combine_kernel,
         dict(m_ptr="*fp32", l_ptr="*fp32", a_ptr="*fp32", o_ptr="*bf16", Sq=i32, H=i32,
              NUM_SPLITS=i32, stride_ob=i32, stride_oh=i32, stride_om=i32),
         dict(BLOCK_M=BLOCK_M, HEAD_DIM=128), 4),
    ]
