"""Plain-torch references: the specification of every kernel in this package.

They compute in float64 (so their own reduction order does not matter at fp32/bf16 precision)
and round once to the output dtype. They are NOT batch-invariant by construction: they are what
the invariant kernels must agree with, within the dtype's tolerance.

Formulas (x: rows of logits or activations, V the row length):
  log_softmax(x)_j = x_j - m - log(sum_i exp(x_i - m)),  m = max_i x_i
  token logprob    = log_softmax(x / T)[target]
  entropy          = -sum_j p_j log p_j = lse - sum_j p_j x_j   (x already divided by T)
  rms_norm(x)      = x * rsqrt(mean(x^2) + eps) * w
  attention(q,k,v) = softmax(q k^T * scale + causal mask) v, queries aligned to the END of the keys
"""
from __future__ import annotations

import torch

_F64 = torch.float64


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` for a (M, K), b (K, N)."""
    out = a.to(_F64) @ b.to(_F64)
    if bias is not None:
        out = out + bias.to(_F64)
    return out.to(a.dtype)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a[i] @ b[i]`` for a (B, M, K), b (B, K, N)."""
    return torch.bmm(a.to(_F64), b.to(_F64)).to(a.dtype)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """MoE expert matmul: rows ``offsets[e]:offsets[e+1]`` of x (sorted by expert) times w[e] (K, N)."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=_F64, device=x.device)
    offs = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = x[lo:hi].to(_F64) @ w[e].to(_F64)
    return out.to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim."""
    return torch.log_softmax(x.to(_F64), dim=-1).to(x.dtype)


def token_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(logprob of ``targets``, entropy) per row of ``logits / temperature``, both float32."""
    z = logits.to(_F64) / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.float(), ent.float()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * w``."""
    x64 = x.to(_F64)
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return (x64 * rstd * w.to(_F64)).to(x.dtype)


def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor):
    """Gradients of rms_norm given the saved per-row ``rstd`` (float32, shape (M,)).

    dx = rstd * (g*w - x * rstd^2 * mean(g*w*x));   dw = sum_rows g * x * rstd
    """
    g64, x64, w64, r = g.to(_F64), x.to(_F64), w.to(_F64), rstd.to(_F64).unsqueeze(-1)
    gw = g64 * w64
    dx = r * (gw - x64 * r * r * (gw * x64).mean(-1, keepdim=True))
    dw = (g64 * x64 * r).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)


def rms_norm_dw_ordered(g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, rows_per_block: int):
    """The exact float32 order the dW kernels use (so they can be tested bitwise against it).

    Rows are cut into blocks of ``rows_per_block``; each block's partial is a sequential row-by-row
    float32 sum of ``g*x*rstd``; the partials are then added sequentially in block order.
    """
    contrib = g.float() * x.float() * rstd.float().unsqueeze(-1)
    total = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], rows_per_block):
        part = torch.zeros_like(total)
        for r in range(start, min(start + rows_per_block, x.shape[0])):
            part = part + contrib[r]
        total = total + part
    return total


def sum_dim(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return x.to(_F64).sum(dim, keepdim=keepdim).to(x.dtype)


def mean_dim(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return x.to(_F64).mean(dim, keepdim=keepdim).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: float | None = None, sinks: torch.Tensor | None = None,
              window: int | None = None) -> torch.Tensor:
    """q (B, H, Sq, D), k/v (B, Hkv, Skv, D), H a multiple of Hkv (grouped-query attention).

    Query i sits at key position ``Skv - Sq + i`` (prefill: Sq == Skv; decode: Sq == 1).
    ``sinks (H,)``: a logit per head joining the softmax denominator (a key with a zero value,
    GPT-OSS); ``window``: the query at ``pos`` sees keys ``pos - window < j <= pos``.
    """
    B, H, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    kk = k.to(_F64).repeat_interleave(H // Hkv, dim=1)
    vv = v.to(_F64).repeat_interleave(H // Hkv, dim=1)
    s = (q.to(_F64) @ kk.transpose(-1, -2)) * scale
    if causal:
        qpos = torch.arange(Skv - Sq, Skv, device=q.device).unsqueeze(-1)
        kpos = torch.arange(Skv, device=q.device).unsqueeze(0)
        s = s.masked_fill(kpos > qpos, float("-inf"))
        if window:
            s = s.masked_fill(kpos <= qpos - int(window), float("-inf"))
    if sinks is not None:
        sk = sinks.to(_F64).view(1, H, 1, 1).expand(B, H, Sq, 1)
        p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
        return (p @ vv).to(q.dtype)
    return (torch.softmax(s, dim=-1) @ vv).to(q.dtype)
