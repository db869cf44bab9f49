"""Row-wise Triton kernels over the vocabulary: log_softmax and fused token logprob + entropy.

Why invariant: one program owns one row and walks the row in chunks of a FIXED ``BLOCK_V``
(a constant, not a function of the number of rows), folding each chunk into a running
(max m, sum s, [u]) state in the same order every time:

  m' = max(m, max(chunk));  s' = s * e^(m - m') + sum e^(x - m')
  u' = (u + (m - m') s) e^(m - m') + sum e^(x - m') (x - m')        [u = sum e^(x-m) (x - m)]
  lse = m + log s,   entropy = log s - u / s,   logprob(t) = x_t - lse

so a token's logprob and entropy never see the other rows, and the full-vocab log-probs are
never written (the fused kernel reads the logits once for the state and writes 2 floats per row).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import interpreting

BLOCK_V = 4096  # vocabulary chunk on GPU; any fixed value keeps invariance


@triton.jit
def _fold(x, m, s, u, mask, WITH_U: tl.constexpr):
    """Fold one chunk (masked lanes already -inf) into the running (m, s, u)."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    e = tl.where(mask, tl.exp(x - m_safe), 0.0)
    if WITH_U:
        corr = tl.where(s > 0, m - m_safe, 0.0) * s
        u = (u + corr) * alpha + tl.sum(tl.where(mask, e * (x - m_safe), 0.0), axis=0)
    s = s * alpha + tl.sum(e, axis=0)
    return m_new, s, u


@triton.jit
def log_softmax_fwd_kernel(x_ptr, y_ptr, V, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    xr = x_ptr + row * stride_x
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(xr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m, s, _ = _fold(x, m, s, 0.0, mask, False)
    lse = m + tl.log(s)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(xr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (x - lse).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def log_softmax_bwd_kernel(g_ptr, y_ptr, dx_ptr, V, stride_g, stride_y, stride_dx,
                           BLOCK: tl.constexpr):
    """dx = g - exp(y) * sum(g), the row sum taken chunk by chunk in a fixed order."""
    row = tl.program_id(0).to(tl.int64)
    total = 0.0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        g = tl.load(g_ptr + row * stride_g + cols, mask=cols < V, other=0.0).to(tl.float32)
        total += tl.sum(g, axis=0)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride_dx + cols, (g - tl.exp(y) * total).to(dx_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def token_logprob_entropy_fwd_kernel(x_ptr, t_ptr, lp_ptr, ent_ptr, lse_ptr, V, stride_x,
                                     temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    xr = x_ptr + row * stride_x
    m = float("-inf")
    s = 0.0
    u = 0.0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(xr + cols, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        m, s, u = _fold(x, m, s, u, mask, True)
    log_s = tl.log(s)
    target = tl.load(t_ptr + row).to(tl.int64)
    xt = tl.load(xr + target).to(tl.float32) / temperature
    lse = m + log_s
    tl.store(lp_ptr + row, xt - lse)
    tl.store(ent_ptr + row, log_s - u / s)
    tl.store(lse_ptr + row, lse)


@triton.jit
def token_logprob_entropy_bwd_kernel(x_ptr, t_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dx_ptr,
                                     V, stride_x, stride_dx, temperature, BLOCK: tl.constexpr):
    """dz_j = g_lp (1[j=t] - p_j) - g_H p_j (log p_j + H);  dx = dz / T. Elementwise per row."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    ent = tl.load(ent_ptr + row)
    glp = tl.load(glp_ptr + row)
    gent = tl.load(gent_ptr + row)
    target = tl.load(t_ptr + row).to(tl.int64)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) / temperature
        logp = z - lse
        p = tl.exp(logp)
        onehot = tl.where(cols == target, 1.0, 0.0)
        dz = glp * (onehot - p) - gent * p * (logp + ent)
        tl.store(dx_ptr + row * stride_dx + cols, (dz / temperature).to(dx_ptr.dtype.element_ty),
                 mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _in(x: torch.Tensor) -> torch.Tensor:
    # The interpreter handles bf16 loads poorly: hand it fp32 (exact upcast).
    return x.float() if interpreting() and x.dtype != torch.float32 else x


def log_softmax_fwd(x: torch.Tensor, block: int = BLOCK_V) -> torch.Tensor:
    x2 = _in(_rows(x))
    y = torch.empty_like(x2)
    if x2.numel():
        log_softmax_fwd_kernel[(x2.shape[0],)](x2, y, x2.shape[1], x2.stride(0), y.stride(0), BLOCK=block)
    return y.to(x.dtype).reshape(x.shape)


def log_softmax_bwd(g: torch.Tensor, y: torch.Tensor, block: int = BLOCK_V) -> torch.Tensor:
    g2, y2 = _in(_rows(g)), _in(_rows(y))
    dx = torch.empty_like(y2)
    if y2.numel():
        log_softmax_bwd_kernel[(y2.shape[0],)](g2, y2, dx, y2.shape[1], g2.stride(0), y2.stride(0),
                                               dx.stride(0), BLOCK=block)
    return dx.to(y.dtype).reshape(y.shape)


def token_logprob_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                              block: int = BLOCK_V):
    x2 = _in(_rows(logits))
    t = targets.reshape(-1).contiguous()
    n = x2.shape[0]
    lp, ent, lse = (torch.empty(n, device=x2.device, dtype=torch.float32) for _ in range(3))
    if n:
        token_logprob_entropy_fwd_kernel[(n,)](x2, t, lp, ent, lse, x2.shape[1], x2.stride(0),
                                               float(temperature), BLOCK=block)
    shape = logits.shape[:-1]
    return lp.reshape(shape), ent.reshape(shape), lse


def token_logprob_entropy_bwd(logits, targets, lse, ent, g_lp, g_ent, temperature: float,
                              block: int = BLOCK_V):
    x2 = _in(_rows(logits))
    t = targets.reshape(-1).contiguous()
    n = x2.shape[0]
    dx = torch.empty_like(x2)
    glp = g_lp.reshape(-1).float().contiguous()
    gent = g_ent.reshape(-1).float().contiguous()
    if n:
        token_logprob_entropy_bwd_kernel[(n,)](x2, t, lse, ent.reshape(-1).contiguous(), glp, gent, dx,
                                               x2.shape[1], x2.stride(0), dx.stride(0),
                                               float(temperature), BLOCK=block)
    return dx.to(logits.dtype).reshape(logits.shape)


def compile_specs():
    i32 = "i32"
    return [
        ("log_softmax_fwd_bf16", log_softmax_fwd_kernel,
         dict(x_ptr="*bf16", y_ptr="*bf16", V=i32, stride_x=i32, stride_y=i32), dict(BLOCK=BLOCK_V), 8),
        ("log_softmax_bwd_bf16", log_softmax_bwd_kernel,
         dict(g_ptr="*bf16", y_ptr="*bf16", dx_ptr="*bf16", V=i32, stride_g=i32, stride_y=i32,
              stride_dx=i32), dict(BLOCK=BLOCK_V), 8),
        ("token_logprob_entropy_fwd_bf16", token_logprob_entropy_fwd_kernel,
         dict(x_ptr="*bf16", t_ptr="*i64", lp_ptr="*fp32", ent_ptr="*fp32", lse_ptr="*fp32", V=i32,
              stride_x=i32, temperature="fp32"), dict(BLOCK=BLOCK_V), 8),
        ("token_logprob_entropy_bwd_bf16", token_logprob_entropy_bwd_kernel,
         dict(x_ptr="*bf16", t_ptr="*i64", lse_ptr="*fp32", ent_ptr="*fp32", glp_ptr="*fp32",
              gent_ptr="*fp32", dx_ptr="*bf16", V=i32, stride_x=i32, stride_dx=i32, temperature="fp32"),
         dict(BLOCK=BLOCK_V), 8),
    ]
