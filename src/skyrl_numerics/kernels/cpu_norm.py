"""RMSNorm on CPU in a fixed order: one fused C kernel (``csrc/rms_norm.c``) that the trainer
(forward of ``kernels.rms_norm``, with its own backward) and the vLLM engine both run, and its
torch specification. Per row ``r`` of ``x (M, N)``, in binary32, each operation rounded on its
own::

    ss_r   = dot8(x_r, x_r)                         (:mod:`.fixed_order`: 8 lanes, fixed fold)
    rstd_r = 1 / sqrt(ss_r / N + eps)
    y_rd   = (x_rd * rstd_r) * w_d                  rounded once to x.dtype

``w`` is ``(N,)``, or ``(M, N)`` with a weight row per row (Qwen3's per-head q/k norms laid out
beside their rows). A row's bits depend only on its own values, ``w`` and ``eps``: not on M,
the other rows, the thread count, or the CPU's vector width (torch's own ``sum`` picks its
reduction order by the CPU's instruction set; this one does not).

:func:`qk_norm_rope` fuses Qwen3's per-head q/k norms with the rotary embedding
(``csrc/qk_norm_rope.c``): per head row the RMSNorm above with the head's ``(D,)`` weight, then,
at the token's ``c_i``, ``s_i`` (float32, ``i < D/2``), each result rounded once to bf16::

    neox: out_i = y_i c_i - y_{i+D/2} s_i,     out_{i+D/2} = y_{i+D/2} c_i + y_i s_i
    gptj: out_2i = y_2i c_i - y_{2i+1} s_i,    out_{2i+1} = y_{2i+1} c_i + y_2i s_i

(:func:`qk_norm_rope_spec` with torch ops: the same bits).
"""
from __future__ import annotations

import numpy as np
import torch

from . import cpu_gemm_amx
from .cpu_reduce import row_sum
from .fixed_order import DTYPE_CODES as _CODES, F32, c32, dot8, lib
from .pool import PAR_MIN_WORK, parallel

MAX_N = 65536
MAX_HEAD_DIM = 1024     # qk_norm_rope.c's ROPE_MAX_D


def rms_norm_spec(x: torch.Tensor, w: torch.Tensor, eps: float):
    """The kernel with torch ops (module doc): ``(y in x.dtype, rstd float32 (M,))``."""
    N = x.shape[-1]
    xf = x.reshape(-1, N).float()
    wf = w.float()
    ss = dot8(xf, xf)
    # (full tensors, not scalars: ATen divides by a scalar as a multiply by its reciprocal;
    # numpy's sqrt, not torch's: torch's CPU float sqrt is SLEEF's, not always correctly rounded)
    mean = ss / torch.full_like(ss, float(N))
    s = torch.from_numpy(np.sqrt((mean + c32(float(eps))).numpy()))
    rstd = torch.ones_like(s) / s
    y = ((xf * rstd[:, None]) * wf).to(x.dtype).reshape(x.shape)
    return y, rstd


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float):
    """The fused kernel when built, else :func:`rms_norm_spec`: ``(y, rstd)``, the same bits."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    M = x2.shape[0]
    L = lib()
    if L is None or N > MAX_N or M == 0 or (w.dim() == 2 and w.shape[0] != M):
        return rms_norm_spec(x, w, eps)
    xo = x2 if x2.dtype in _CODES else x2.float()
    if xo.stride(-1) != 1:
        xo = xo.contiguous()
    wo = w if w.dtype in _CODES else w.float()
    if wo.stride(-1) != 1:
        wo = wo.contiguous()
    w_ld = 0 if wo.dim() == 1 else wo.stride(0)
    y_dtype = x.dtype if x.dtype in _CODES else F32
    y = torch.empty((M, N), dtype=y_dtype)
    rstd = torch.empty(M, dtype=F32)
    args = (xo.data_ptr(), _CODES[xo.dtype], xo.stride(0), wo.data_ptr(), _CODES[wo.dtype], w_ld,
            y.data_ptr(), _CODES[y_dtype], rstd.data_ptr())

    def run(lo: int, hi: int) -> None:
        rc = L.skyrl_rms_norm_fwd(*args, lo, hi, N, float(eps))
        if rc != 0:
            raise RuntimeError(f"skyrl_rms_norm_fwd refused its sizes (rc {rc})")

    parallel(run, M, 2 * M * N)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y.reshape(x.shape), rstd



def add_rms_norm(h: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float):
    """A pre-norm decoder's residual add and the norm after it: ``(s, y)`` with ``s = h + a``
    (torch's bfloat16 add: one float32 addition, rounded once) and ``y = rms_norm(s, w, eps)[0]``,
    in one C pass per row (``skyrl_add_rms_norm``) for bfloat16 ``h``, ``a`` ``(M, N)`` and a
    weight row ``(N,)``; else those two torch-level calls. The same bits either way (tested)."""
    bf = torch.bfloat16
    L = lib()
    if (L is None or h.dtype != bf or a.dtype != bf or h.dim() != 2 or h.shape != a.shape
            or w.dim() != 1 or w.dtype not in _CODES or w.shape[0] != h.shape[1]
            or h.shape[1] > MAX_N or h.stride(1) != 1 or a.stride(1) != 1 or h.shape[0] == 0):
        s = h + a
        return s, rms_norm(s, w, eps)[0]
    M, N = h.shape
    wo = w if w.stride(0) == 1 else w.contiguous()
    s, y = torch.empty((M, N), dtype=bf), torch.empty((M, N), dtype=bf)
    args = (h.data_ptr(), h.stride(0), a.data_ptr(), a.stride(0), wo.data_ptr(), _CODES[wo.dtype],
            s.data_ptr(), y.data_ptr())

    def run(lo: int, hi: int) -> None:
        rc = L.skyrl_add_rms_norm(*args, lo, hi, N, float(eps))
        if rc != 0:
            raise RuntimeError(f"skyrl_add_rms_norm refused its sizes (rc {rc})")

    parallel(run, M, 3 * M * N)
    return s, y


def rms_norm_backward(g, x, w, rstd, rows_per_block: int = 256):
    """dx per row; dW: fp32 partial sums over fixed blocks of rows, folded in block order."""
    N = x.shape[-1]
    gf, xf, wf = g.reshape(-1, N).float(), x.reshape(-1, N).float(), w.float()
    r = rstd.unsqueeze(-1)
    gw = gf * wf
    c = row_sum(gw * xf).unsqueeze(-1) / N
    dx = (r * (gw - xf * r * r * c)).to(x.dtype).reshape(x.shape)
    contrib = (gf * xf) * r
    dw = torch.zeros(N, dtype=torch.float32)
    for start in range(0, contrib.shape[0], rows_per_block):
        dw = dw + contrib[start:start + rows_per_block].sum(0)
    return dx, dw.to(w.dtype)


def _rope_spec(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, gptj: bool) -> torch.Tensor:
    """``y (T, H, D)`` rotated at ``cos``/``sin (T, D/2)`` in float32, rounded once to bf16."""
    yf, c, s = y.float(), cos[:, None, :], sin[:, None, :]
    if not gptj:
        h = y.shape[-1] // 2
        y1, y2 = yf[..., :h], yf[..., h:]
        out = torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1)
    else:
        y1, y2 = yf[..., 0::2], yf[..., 1::2]
        out = torch.stack([y1 * c - y2 * s, y2 * c + y1 * s], dim=-1).flatten(-2)
    return out.to(torch.bfloat16)


def qk_norm_rope_spec(q, k, v, q_w, k_w, cos, sin, eps: float, gptj: bool):
    """:func:`qk_norm_rope` with torch ops (module doc): the same arguments and bits."""
    T, Hq, D = q.shape
    Hk = k.shape[1]
    cos, sin = cos.reshape(T, D // 2).float(), sin.reshape(T, D // 2).float()
    qn = rms_norm_spec(q.reshape(T * Hq, D), q_w, eps)[0].view(T, Hq, D)
    kn = rms_norm_spec(k.reshape(T * Hk, D), k_w, eps)[0].view(T, Hk, D)
    rows = torch.cat([_rope_spec(kn, cos, sin, gptj).reshape(T, Hk * D), v.reshape(T, Hk * D)], -1)
    return _rope_spec(qn, cos, sin, gptj), rows


def _f32_rows(t: torch.Tensor, T: int, n: int) -> torch.Tensor:
    """``t`` as contiguous float32 ``(T, n)`` (a view when it already is one)."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        t = t.float().contiguous()
    return t.view(T, n)


def qk_norm_rope(q, k, v, q_w, k_w, cos, sin, eps: float, gptj: bool):
    """Per-head RMSNorm and RoPE of bf16 ``q (T, Hq, D)`` (weight ``q_w (D,)``) and
    ``k (T, Hk, D)`` (``k_w``) at ``cos``/``sin`` (float32, ``T·D/2`` values each: the rotary
    multipliers of each token's position), and the cache rows ``[k | v]``:
    ``(q_out (T, Hq, D), rows (T, 2·Hk·D))``, bf16. The fused kernel when built (and
    ``D <= MAX_HEAD_DIM``), else :func:`qk_norm_rope_spec`: the same bits."""
    T, Hq, D = q.shape
    Hk = k.shape[1]
    bf = torch.bfloat16
    if any(t.dtype != bf for t in (q, k, v, q_w, k_w)) or D % 2:
        raise ValueError("qk_norm_rope takes bfloat16 tensors and an even head dim")
    L = lib()
    if L is None or D > MAX_HEAD_DIM:
        return qk_norm_rope_spec(q, k, v, q_w, k_w, cos, sin, eps, gptj)
    cos, sin = _f32_rows(cos, T, D // 2), _f32_rows(sin, T, D // 2)
    q2, k2 = q.reshape(T, Hq * D), k.reshape(T, Hk * D)
    if q2.stride(1) != 1:
        q2 = q2.contiguous()
    if k2.stride(1) != 1:
        k2 = k2.contiguous()
    qw, kw = q_w.contiguous(), k_w.contiguous()
    q_out = torch.empty((T, Hq, D), dtype=bf)
    rows = torch.empty((T, 2 * Hk * D), dtype=bf)
    rows[:, Hk * D:] = v.reshape(T, Hk * D)
    rc = L.skyrl_qk_norm_rope(q2.data_ptr(), q2.stride(0), Hq, k2.data_ptr(), k2.stride(0), Hk,
                              qw.data_ptr(), kw.data_ptr(), cos.data_ptr(), sin.data_ptr(), D,
                              float(eps), int(bool(gptj)), q_out.data_ptr(),
                              rows.data_ptr(), rows.stride(0), 0, T)
    if rc != 0:
        raise RuntimeError(f"skyrl_qk_norm_rope refused its sizes (rc {rc})")
    return q_out, rows


def qkv_norm_rope(x, ws, q_w, k_w, cos, sin, eps: float, gptj: bool, D: int, biases=None):
    """The attention inputs of bf16 ``x (T, K)`` in one C call (``skyrl_qkv_norm_rope``): its
    q/k/v projections by ``ws = (wq, wk, wv)`` (bf16 ``[Hq·D, K]``, ``[Hk·D, K]`` twice), plus
    ``biases`` (bf16 ``(bq, bk, bv)``, Qwen2's; torch's bf16 add), then :func:`qk_norm_rope`'s
    per-head norms (``q_w``, ``k_w``; both None: no q/k norms, Llama's and Mistral's) and RoPE:
    ``(q_out (T, Hq, D), rows (T, 2·Hk·D))``, the bits of
    :func:`~skyrl_numerics.kernels.cpu_gemm_bf16.linear` three times, the bias adds, then the
    norms and the rotation (tested; a NaN projection is the exception: its payload is the C
    rounding's 0x7FC0, where torch's AVX2 / AVX-512 ``.to`` writes 0xFFFF —
    ``csrc/fixed_order.h``). For a small model's decode step, where those calls cost more than
    their arithmetic. None where it does not apply: no library, the amx GEMM arithmetic,
    tensors not bf16 or not laid out as the kernel reads them, or work large enough for the
    thread pool to split (then the separate calls, split over threads, are faster)."""
    L = lib()
    wq, wk, wv = ws
    T, K = x.shape
    bf = torch.bfloat16
    norms = [t for t in (q_w, k_w) if t is not None]
    bs = list(biases) if biases is not None else []
    if (L is None or D > MAX_HEAD_DIM or D % 2 or x.dtype != bf or cpu_gemm_amx.uses_amx(x)
            or any(w.dtype != bf or w.dim() != 2 or w.shape[1] != K or w.stride(1) != 1
                   or (w.shape[0] > 1 and w.stride(0) < K) for w in ws)
            or wk.shape != wv.shape or wq.shape[0] % D or wk.shape[0] % D
            or len(norms) == 1 or any(t.dtype != bf or t.shape != (D,) for t in norms)
            or any(b.dtype != bf or b.shape != (w.shape[0],) for b, w in zip(bs, ws))
            or T * K * (wq.shape[0] + 2 * wk.shape[0]) >= PAR_MIN_WORK):
        return None
    Hq, Hk = wq.shape[0] // D, wk.shape[0] // D
    if x.stride(1) != 1 or (T > 1 and x.stride(0) < K):
        x = x.contiguous()
    cos, sin = _f32_rows(cos, T, D // 2), _f32_rows(sin, T, D // 2)
    norms, bs = [t.contiguous() for t in norms], [b.contiguous() for b in bs]   # (kept alive)
    ptr = [t.data_ptr() for t in norms] or [None, None]
    bptr = [b.data_ptr() for b in bs] or [None, None, None]
    q_out = torch.empty((T, Hq, D), dtype=bf)
    rows = torch.empty((T, 2 * Hk * D), dtype=bf)
    ld = [w.stride(0) if w.shape[0] > 1 else K for w in ws]
    rc = L.skyrl_qkv_norm_rope(x.data_ptr(), x.stride(0) if T > 1 else K, K, wq.data_ptr(), ld[0],
                               wk.data_ptr(), ld[1], wv.data_ptr(), ld[2], *bptr, Hq, Hk, *ptr,
                               cos.data_ptr(), sin.data_ptr(), D, float(eps), int(bool(gptj)),
                               q_out.data_ptr(), rows.data_ptr(), rows.stride(0), T)
    if rc != 0:
        raise RuntimeError(f"skyrl_qkv_norm_rope refused its sizes (rc {rc})")
    return q_out, rows
