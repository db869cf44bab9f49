"""Batch-invariant causal attention on CPU: one fused, fixed-order kernel (``csrc/attention.c``)
that the trainer and the vLLM engine both run, and its torch specification.

Every query row (sequence ``b``, head ``h``, query ``i`` at key position
``pos = kv_len[b] - Sq + i``; GQA: key/value head ``h // (H / Hkv)``) is computed on its own,
in binary32, with these operations in this order (``block_n`` = 64)::

    n     = pos + 1 if causal else kv_len[b]            keys 0 .. n-1, in blocks [j0, j0 + block_n)
    m = -inf,  l = +0,  acc_d = +0
    per block:
      s_j   = dot8(q, k_j) * scale
      m'    = max(m, max_j s_j)   (a NaN anywhere gives NaN);   m* = 0 if m' = ±inf else m'
      alpha = exp_s(m - m*);      p_j = exp_s(s_j - m*)
      l     = l * alpha + (((+0 + p_0) + p_1) + ... )
      acc_d = acc_d * alpha + (((+0 + p_0 v_0d) + p_1 v_1d) + ... )
      m     = m'
    out_d = acc_d / l

    dot8(q, k): a_c = ((+0 + q_c k_c) + q_{c+8} k_{c+8}) + ...  for lanes c = 0..7,
                then ((a_0 + a_4) + (a_2 + a_6)) + ((a_1 + a_5) + (a_3 + a_7))
    exp_s(x):   0 for x <= -87 (and -inf), +inf for x > 88, NaN for NaN; else
                n = (x·log2e + 1.5·2^23) - 1.5·2^23          (nearest integer, ties to even)
                r = (x - n·0.693359375) - n·(-2.12194440e-4)  (Cody–Waite)
                exp_s = (((P(r)·r^2 + r) + 1) · 2^n,  P = Cephes' degree-5 Horner polynomial
                (|relative error| < 2 ulp against exp in float64; tested)

Each operation is rounded on its own (no FMA, no reassociation): the C file is compiled with
``-ffp-contract=off -fno-fast-math`` (:mod:`.native`) and :func:`attention_spec` writes the same
operations as torch elementwise ops, so the two agree bit for bit (tested with random shapes,
lengths and values). A row's bits depend only on its query, its keys and values, ``kv_len``
and ``block_n``: not on the other rows of the batch, the padding, the number of threads, or
whether the row is computed in a prefill or a token-by-token decode over a KV cache.

Inputs: ``q (B, H, Sq, D)``, ``k (B, Hkv, Skv, D)``, ``v (B, Hkv, Skv, Dv)`` (``Dv`` may be
smaller than ``D``: MLA's latent values are the first ``Dv`` values of its key rows; each
output column is its own sum, so ``v[..., :Dv]`` gives exactly those columns of the
full-width attention), any strides with a contiguous last dim, float32 or bfloat16 read as they
are (other float dtypes converted to float32 first, exactly); ``kv_lens (B,)``: sequence b has
its first ``kv_lens[b]`` keys (the rest is padding, never read), its queries at the end of
those. Output ``(B, H, Sq, Dv)`` in ``q.dtype`` (rounded once from binary32).
"""
from __future__ import annotations

import torch

from . import native

BLOCK_N = 64
MAX_BLOCK, MAX_D = 256, 1024   # the C kernel's buffers (larger calls take the spec)
PAR_MIN_WORK = 1 << 21     # multiply-adds below which a call stays on the calling thread

_F32 = torch.float32


def _c(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=_F32)


_LOG2E, _MAGIC = _c(1.44269502162933349609375), _c(12582912.0)
_LN2_HI, _LN2_LO = _c(0.693359375), _c(-2.12194440e-4)
_POLY = [_c(v) for v in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                         1.6666665459e-1, 5.0000001201e-1)]
_ONE, _ZERO = _c(1.0), _c(0.0)


def exp_s(x: torch.Tensor) -> torch.Tensor:
    """The kernel's exp (module doc), elementwise on a float32 tensor."""
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
    p = p + _ONE
    two_n = ((n.to(torch.int32) + 127) << 23).view(_F32)
    out = p * two_n
    out = torch.where(x > -87.0, out, _ZERO)
    out = torch.where(x > 88.0, torch.full_like(out, float("inf")), out)
    return torch.where(torch.isnan(x), x, out)


def dot8(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The kernel's dot product over the last dim of broadcastable float32 ``q`` and ``k``."""
    prod = q * k
    D = prod.shape[-1]
    pad = -D % 8
    if pad:
        prod = torch.nn.functional.pad(prod, (0, pad))
    prod = prod.view(*prod.shape[:-1], -1, 8)
    a = torch.zeros(prod.shape[:-2] + (8,), dtype=_F32)
    for t in range(prod.shape[-2]):
        a = a + prod[..., t, :]
    b = a[..., :4] + a[..., 4:]
    c = b[..., :2] + b[..., 2:]
    return c[..., 0] + c[..., 1]


def _kv_lens(kv_lens, B: int, Skv: int) -> torch.Tensor:
    if kv_lens is None:
        return torch.full((B,), Skv, dtype=torch.int64)
    return torch.as_tensor(kv_lens, dtype=torch.int64).reshape(B)


def attention_spec(q, k, v, causal: bool = True, scale: float | None = None,
                   block_n: int = BLOCK_N, kv_lens=None, q_chunk: int = 64) -> torch.Tensor:
    """The kernel written with torch ops (module doc): the reference the C kernel is tested
    against and the path taken when it cannot be built. All rows of a block at once; a block
    past a row's last key is an exact no-op for that row (``alpha = exp_s(0) = 1``, ``p = 0``,
    and ``l``, ``acc`` are never ``-0``, so ``x · 1 + (+0) = x``), so it may run for every row."""
    B, H, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    g = H // Hkv
    scale32 = _c(D ** -0.5 if scale is None else float(scale))
    lens = _kv_lens(kv_lens, B, Skv)
    out = torch.empty((B, H, Sq, Dv), dtype=_F32)
    kf = k.float().repeat_interleave(g, dim=1)        # (B, H, Skv, D)
    vf = v.float().repeat_interleave(g, dim=1)
    for i0 in range(0, Sq, q_chunk):
        i1 = min(Sq, i0 + q_chunk)
        qi = torch.arange(i0, i1)
        n = (lens[:, None] - Sq + qi[None, :] + 1).minimum(lens[:, None]) if causal \
            else lens[:, None].expand(B, i1 - i0)
        n = n[:, None, :, None]                                       # (B, 1, rows, 1)
        qf = q[:, :, i0:i1].float()
        m = torch.full((B, H, i1 - i0), float("-inf"))
        l_ = torch.zeros((B, H, i1 - i0))
        acc = torch.zeros((B, H, i1 - i0, Dv))
        for j0 in range(0, int(n.max()) if n.numel() else 0, block_n):
            j1 = min(j0 + block_n, Skv)
            valid = torch.arange(j0, j1).view(1, 1, 1, -1) < n       # (B, 1, rows, bn)
            s = dot8(qf[:, :, :, None, :], kf[:, :, None, j0:j1, :]) * scale32
            s = torch.where(valid, s, float("-inf"))
            bm = s.amax(-1)
            mn = torch.where(bm > m, bm, m)
            mn = torch.where(torch.isnan(m) | torch.isnan(bm), float("nan"), mn)
            ms = torch.where(torch.isinf(mn), _ZERO, mn)
            alpha = exp_s(m - ms)
            p = exp_s(s - ms[..., None])
            vb = torch.where(valid[..., None], vf[:, :, None, j0:j1, :], _ZERO)
            ls = torch.zeros_like(l_)
            pv = torch.zeros_like(acc)
            for j in range(j1 - j0):
                ls = ls + p[..., j]
                pv = pv + p[..., j, None] * vb[:, :, :, j]
            l_ = l_ * alpha + ls
            acc = acc * alpha[..., None] + pv
            m = mn
        o = acc / l_[..., None]
        rows_empty = (n[:, :, :, 0] <= 0).expand(B, H, i1 - i0)
        out[:, :, i0:i1] = torch.where(rows_empty[..., None], _ZERO, o)
    return out.to(q.dtype)


_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernel reads it: float32 or bfloat16 as is, last dim contiguous."""
    if t.dtype not in _CODES:
        t = t.float()
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t


def attention(q, k, v, causal: bool = True, scale: float | None = None,
              block_n: int = BLOCK_N, kv_lens=None) -> torch.Tensor:
    """The fused kernel when it is built (:mod:`.native`), else :func:`attention_spec`: the
    same bits. Large calls split their (sequence, KV head) pairs over the CPU kernels' thread pool
    (each row is computed by one thread: the split changes no bits). With autograd on and an
    input that requires grad, the result keeps these bits and differentiates through the
    float64 reference formula recomputed on the same inputs (:class:`_Attention`)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, causal, scale, block_n, kv_lens)
    return _forward(q, k, v, causal, scale, block_n, kv_lens)


class _Attention(torch.autograd.Function):
    """Forward: the kernel. Backward: autograd of the float64 reference attention of each
    sequence over its own ``kv_lens[b]`` keys (the gradient needs no invariance)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_n, kv_lens):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale = causal, scale
        ctx.lens = None if kv_lens is None else _kv_lens(kv_lens, q.shape[0], k.shape[2])
        with torch.no_grad():
            return _forward(q, k, v, causal, scale, block_n, kv_lens)

    @staticmethod
    def backward(ctx, g):
        from .reference import attention as ref_attention

        q, k, v = ctx.saved_tensors
        gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lens = ctx.lens.tolist() if ctx.lens is not None else [k.shape[2]] * q.shape[0]
        with torch.enable_grad():
            for b, n in enumerate(lens):
                qq, kk, vv = (t[b:b + 1, :, :m].detach().double().requires_grad_(True)
                              for t, m in ((q, q.shape[2]), (k, n), (v, n)))
                out = ref_attention(qq, kk, vv, ctx.causal, ctx.scale)
                dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), g[b:b + 1].double())
                gq[b:b + 1] = dq.to(q.dtype)
                gk[b:b + 1, :, :n] = dk.to(k.dtype)
                gv[b:b + 1, :, :n] = dv.to(v.dtype)
        return gq, gk, gv, None, None, None, None


def _forward(q, k, v, causal, scale, block_n, kv_lens) -> torch.Tensor:
    B, H, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if 0 in (B, H, Sq, Dv):
        return torch.zeros((B, H, Sq, Dv), dtype=q.dtype)
    lib = native.lib()
    if lib is None or block_n > MAX_BLOCK or max(D, Dv) > MAX_D:
        return attention_spec(q, k, v, causal, scale, block_n, kv_lens)
    lens = _kv_lens(kv_lens, B, Skv).contiguous()
    qo, ko, vo = _operand(q), _operand(k), _operand(v)
    out = torch.empty((B, H, Sq, Dv), dtype=_F32)
    sc = D ** -0.5 if scale is None else float(scale)
    # (the scale is rounded to binary32 once, as the spec's scale tensor)
    args = []
    for t in (qo, ko, vo):
        args += [t.data_ptr(), _CODES[t.dtype], t.stride(0), t.stride(1), t.stride(2)]

    def run(lo: int, hi: int) -> None:
        rc = lib.skyrl_attention_fwd(*args, out.data_ptr(), lens.data_ptr(), B, H, Hkv, Sq, D, Dv,
                                     int(bool(causal)), sc, int(block_n), lo, hi)
        if rc != 0:
            raise RuntimeError(f"skyrl_attention_fwd refused its sizes (rc {rc})")

    pairs = B * Hkv
    threads = torch.get_num_threads()
    work = B * H * Sq * (Skv if not causal else (Skv + 1) / 2) * (D + Dv)
    if threads > 1 and pairs > 1 and work >= PAR_MIN_WORK:
        from .cpu import _pool

        parts = min(threads, pairs)
        bounds = [pairs * j // parts for j in range(parts + 1)]
        futs = [_pool(parts).submit(run, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
        for f in futs:
            f.result()
    else:
        run(0, pairs)
    return out if q.dtype == _F32 else out.to(q.dtype)
