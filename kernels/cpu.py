"""Batch-invariant CPU path built from stock torch ops (no Triton), fast enough for real use.

Stock torch on CPU is NOT batch-invariant (measured here, torch 2.13 + MKL, 2 threads):
  * fp32 ``torch.mm``: rows of an M<=5 product differ from the same rows inside a larger M
    (MKL takes a GEMV / small-M kernel);
  * ``x.mean(-1)`` / ``x.sum(-1)`` over rows longer than 32768 differ between M=1 and M>1
    (one row is split across threads; several rows are not).
What this module does instead:
  * matmul: pad M up to ``MIN_ROWS`` (16) and call one fp32 MKL GEMM through ``baddbmm``
    (not ``mm``/``addmm``/``bmm``, so it can serve as the override of those ops without
    recursing). For M >= 16 MKL's per-row summation order does not depend on M, the row's
    position or the thread count: tested by hypothesis in tests/kernels/test_cpu.py and
    checkable on any machine with :func:`check_cpu_invariance`. bf16/fp16 are computed in fp32
    (exact products) and rounded once, like the Triton kernels.
  * row reductions: rows cut into chunks of ``CHUNK`` (below torch's 32768 parallel grain, so
    one thread owns a chunk) and the chunk sums folded left to right.
Everything else used (exp, log, rsqrt, amax, elementwise) is per element or order-free.
"""
from __future__ import annotations

import torch

MIN_ROWS = 16
CHUNK = 16384


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def matmul_2d(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) (+ bias) with a per-row result independent of M.

    Both M and N are padded to at least ``MIN_ROWS``: MKL takes GEMV-like kernels for a skinny
    side (seen here: N = 1 changed a row's bits between M = 16 and M = 18), and the invariance
    rests on every call taking the same blocked GEMM."""
    out_dtype = out_dtype or a.dtype
    cd = _compute_dtype(a)
    M, N = a.shape[0], b.shape[1]
    a32, b32 = a.to(cd), b.to(cd)
    if M < MIN_ROWS:
        a32 = torch.cat([a32, a32.new_zeros(MIN_ROWS - M, a32.shape[1])])
    if N < MIN_ROWS:
        b32 = torch.cat([b32, b32.new_zeros(b32.shape[0], MIN_ROWS - N)], dim=1)
    out = torch.empty((1, a32.shape[0], b32.shape[1]), dtype=cd)
    out = torch.baddbmm(out, a32.unsqueeze(0), b32.unsqueeze(0), beta=0)[0, :M, :N]
    if bias is not None:
        out = out + bias.to(cd)
    return out.to(out_dtype)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(..., K) @ (K, N)."""
    lead = a.shape[:-1]
    out = matmul_2d(a.reshape(-1, a.shape[-1]), b, bias)
    return out.reshape(*lead, b.shape[1])


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (B, M, K) @ b (B, K, N): one batched fp32 GEMM with M and N padded to ``MIN_ROWS``
    (as :func:`matmul_2d`: MKL's skinny paths — seen here for N = 5, 6 — break row invariance)."""
    cd = _compute_dtype(a)
    B, M, K = a.shape
    N = b.shape[2]
    a32, b32 = a.to(cd), b.to(cd)
    if M < MIN_ROWS:
        a32 = torch.cat([a32, a32.new_zeros(B, MIN_ROWS - M, K)], dim=1)
    if N < MIN_ROWS:
        b32 = torch.cat([b32, b32.new_zeros(B, K, MIN_ROWS - N)], dim=2)
    out = torch.empty((B, a32.shape[1], b32.shape[2]), dtype=cd)
    return torch.baddbmm(out, a32, b32, beta=0)[:, :M, :N].to(a.dtype)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e]:offsets[e+1] of x times w[e] (K, N), one invariant GEMM per expert."""
    out = torch.zeros((x.shape[0], w.shape[2]), dtype=x.dtype)
    offs = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = matmul_2d(x[lo:hi], w[e])
    return out


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of (M, N) in fp32 (fp64 stays fp64), order independent of M."""
    x = x.to(_compute_dtype(x))
    N = x.shape[-1]
    if N <= CHUNK:
        return x.sum(-1)
    nc = -(-N // CHUNK)
    if nc * CHUNK != N:
        x = torch.nn.functional.pad(x, (0, nc * CHUNK - N))
    parts = x.reshape(*x.shape[:-1], nc, CHUNK).sum(-1)
    total = parts[..., 0]
    for j in range(1, nc):
        total = total + parts[..., j]
    return total


def reduce(x: torch.Tensor, dims, keepdim: bool, mean: bool, dtype=None) -> torch.Tensor:
    """sum/mean over ``dims`` (None = all): kept dims first, reduced dims flattened last."""
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
    out = out.to(dtype or x.dtype).reshape([x.shape[d] for d in kept])
    if keepdim:
        for d in red:
            out = out.unsqueeze(d)
    return out


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x - m - log(sum exp(x - m)) over the last dim."""
    xf = x.to(_compute_dtype(x))
    m = xf.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    s = row_sum((xf - m).exp().reshape(-1, xf.shape[-1])).reshape(m.shape)
    return (xf - m - s.log()).to(x.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """exp(x - m) / sum exp(x - m) over the last dim."""
    xf = x.to(_compute_dtype(x))
    m = xf.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = (xf - m).exp()
    s = row_sum(e.reshape(-1, xf.shape[-1])).reshape(m.shape)
    return (e / s).to(x.dtype)


def softmax_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dx = y * (g - sum(g * y))."""
    gf, yf = g.to(_compute_dtype(g)), y.to(_compute_dtype(y))
    dot = row_sum((gf * yf).reshape(-1, gf.shape[-1])).reshape(*gf.shape[:-1], 1)
    return (yf * (gf - dot)).to(y.dtype)


def log_softmax_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dx = g - exp(y) * sum(g)."""
    gf, yf = g.to(_compute_dtype(g)), y.to(_compute_dtype(y))
    total = row_sum(gf.reshape(-1, gf.shape[-1])).reshape(*gf.shape[:-1], 1)
    return (gf - yf.exp() * total).to(y.dtype)


def token_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """-> (logprob, entropy, lse) float32; entropy = log s - sum e^(z-m) (z-m) / s."""
    V = logits.shape[-1]
    z = logits.reshape(-1, V).float() / temperature
    m = z.amax(-1, keepdim=True)
    d = z - m
    e = d.exp()
    s = row_sum(e)
    u = row_sum(e * d)
    log_s = s.log()
    lse = m.squeeze(-1) + log_s
    lp = z.gather(-1, targets.reshape(-1, 1).long()).squeeze(-1) - lse
    ent = log_s - u / s
    shape = logits.shape[:-1]
    return lp.reshape(shape), ent.reshape(shape), lse


def token_logprob_entropy_backward(logits, targets, lse, ent, g_lp, g_ent, temperature: float):
    V = logits.shape[-1]
    z = logits.reshape(-1, V).float() / temperature
    logp = z - lse.unsqueeze(-1)
    p = logp.exp()
    onehot = torch.zeros_like(z).scatter_(-1, targets.reshape(-1, 1).long(), 1.0)
    glp, gent = g_lp.reshape(-1, 1).float(), g_ent.reshape(-1, 1).float()
    dz = glp * (onehot - p) - gent * p * (logp + ent.reshape(-1, 1))
    return (dz / temperature).to(logits.dtype).reshape(logits.shape)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6):
    """-> (y, rstd float32 per row)."""
    N = x.shape[-1]
    xf = x.reshape(-1, N).float()
    rstd = torch.rsqrt(row_sum(xf * xf) / N + eps)
    y = (xf * rstd.unsqueeze(-1) * w.float()).to(x.dtype).reshape(x.shape)
    return y, rstd


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


def attention(q, k, v, causal: bool = True, scale: float | None = None, block_n: int = 64,
              kv_lens: torch.Tensor | None = None):
    """Online softmax over fixed key blocks [0, block_n), [block_n, 2 block_n), ... in order;
    every product through :func:`bmm` (invariant in the number of queries), so token-by-token
    decode over a KV cache equals full prefill bit for bit.

    ``kv_lens`` (B,): sequence b has only its first ``kv_lens[b]`` keys (the rest is padding) and
    its queries sit at the end of those. Blocks past a sequence's end are fully masked and leave
    (m, l, acc) exactly unchanged (alpha = 1, p = 0), so a padded batch gives every sequence the
    bits it gets alone."""
    B, H, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    if kv_lens is None:
        kv_lens = torch.full((B,), Skv, dtype=torch.long)
    kv_lens = torch.as_tensor(kv_lens, dtype=torch.long).reshape(B)
    lens = kv_lens.repeat_interleave(Hkv)[:, None, None]           # (B*Hkv, 1, 1)
    scale = D ** -0.5 if scale is None else float(scale)
    g = H // Hkv
    qf = q.float().reshape(B * Hkv, g * Sq, D)        # queries of one KV head share the GEMMs
    # keys/values padded once to whole blocks (the same zeros the last block got before); MLA
    # passes one tensor as k and v: converted once
    pad = -Skv % block_n
    kf = torch.nn.functional.pad(k.float().reshape(B * Hkv, Skv, D), (0, 0, 0, pad))
    vf = kf if v is k else torch.nn.functional.pad(v.float().reshape(B * Hkv, Skv, D),
                                                   (0, 0, 0, pad))
    qpos = torch.arange(Sq).repeat(g)[None, :, None] + (lens - Sq)  # (B*Hkv, g*Sq, 1)
    m = torch.full((B * Hkv, g * Sq), float("-inf"))
    l_ = torch.zeros(B * Hkv, g * Sq)
    acc = torch.zeros(B * Hkv, g * Sq, D)
    for n0 in range(0, Skv, block_n):
        kpos = torch.arange(n0, n0 + block_n)           # always a full block: same GEMM shapes
        kb, vb = kf[:, n0:n0 + block_n], vf[:, n0:n0 + block_n]
        s = bmm(qf, kb.transpose(1, 2).contiguous()) * scale
        invalid = kpos[None, None, :] >= lens
        if causal:
            invalid = invalid | (kpos[None, None, :] > qpos)
        s = s.masked_fill(invalid, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = (m - m_safe).exp()
        p = (s - m_safe.unsqueeze(-1)).exp()
        l_ = l_ * alpha + row_sum(p.reshape(-1, p.shape[-1])).reshape(l_.shape)
        acc = acc * alpha.unsqueeze(-1) + bmm(p, vb.contiguous())
        m = m_new
    out = (acc / l_.unsqueeze(-1)).reshape(B, Hkv, g, Sq, D).reshape(B, H, Sq, D)
    return out.to(q.dtype)


def check_cpu_invariance(shapes=((64, 256, 256), (64, 1024, 128)), dtype=torch.float32,
                         seed: int = 0) -> bool:
    """True when this machine's BLAS gives :func:`matmul_2d` rows independent of M (M in 1..M)."""
    g = torch.Generator().manual_seed(seed)
    for M, K, N in shapes:
        a = torch.randn(M, K, generator=g).to(dtype)
        b = torch.randn(K, N, generator=g).to(dtype)
        full = matmul_2d(a, b)
        for m in (1, 2, 3, 5, 8, 15, 17, M // 2):
            if not torch.equal(matmul_2d(a[:m], b), full[:m]):
                return False
    return True
