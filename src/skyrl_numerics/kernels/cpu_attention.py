"""Batch-invariant causal attention on CPU: one fused, fixed-order kernel (``csrc/attention.c``)
that the trainer and the vLLM engine both run, and its torch specification.

Every query row (sequence ``b``, head ``h``, query ``i`` at key position
``pos = kv_len[b] - Sq + i``; GQA: key/value head ``h // (H / Hkv)``) is computed on its own,
in binary32, with these operations in this order (``block_n`` = 64)::

    n     = pos + 1 if causal else kv_len[b]            keys lo .. n-1, in blocks [j0, j0 + block_n)
    lo    = max(0, n - window) with a sliding window, else 0   (blocks stay aligned at key 0;
                                                  a block's keys before lo are left out)
    m = -inf,  l = +0,  acc_d = +0               with an attention sink s_h: m = s_h, l = 1
    per block (its keys of lo .. n-1):
      s_j   = dot8(q, k_j) * scale
      m'    = max(m, max_j s_j)   (a NaN anywhere gives NaN);   m* = 0 if m' = ±inf else m'
      alpha = exp_s(m - m*);      p_j = exp_s(s_j - m*)
      l     = l * alpha + (((+0 + p_0) + p_1) + ... )
      acc_d = acc_d * alpha + (((+0 + p_0 v_0d) + p_1 v_1d) + ... )
      m     = m'
    out_d = acc_d / l

    dot8, exp_s: :mod:`.fixed_order` (8 lanes folded in a fixed tree; a Cody–Waite +
                 polynomial exp within an ulp of float64's)

Each operation is rounded on its own (no FMA, no reassociation): the C file is compiled with
``-ffp-contract=off -fno-fast-math`` (:mod:`.native`) and :func:`attention_spec` writes the same
operations as torch elementwise ops, so the two agree bit for bit (tested with random shapes,
lengths and values). A row's bits depend only on its query, its keys and values, ``kv_len``
and ``block_n``: not on the other rows of the batch, the padding, the number of threads, or
whether the row is computed in a prefill or a token-by-token decode over a KV cache.

An attention sink (GPT-OSS: a learned logit per query head) is a key with a zero value that
every row sees first: ``out = Σ_j e^{s_j} v_j / (e^{s_h} + Σ_j e^{s_j})``; processing it first
from ``m = -inf`` gives exactly ``m = s_h, l = exp_s(0) = 1, acc = +0``. A sliding window
``W`` keeps a row's last ``W`` keys (HF's and vLLM's ``sliding_window``: key ``j`` is seen by
the query at ``pos`` when ``pos - W < j <= pos``).

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

from .fixed_order import DTYPE_CODES as _CODES, F32 as _F32, ZERO as _ZERO, c32 as _c, dot8, exp_s
from .fixed_order import kernel_operand
from .pool import parallel

BLOCK_N = 64
MAX_BLOCK, MAX_D = 256, 1024   # the C kernel's buffers (larger calls take the spec)


def _kv_lens(kv_lens, B: int, Skv: int) -> torch.Tensor:
    if kv_lens is None:
        return torch.full((B,), Skv, dtype=torch.int64)
    return torch.as_tensor(kv_lens, dtype=torch.int64).reshape(B)


def _sinks32(sinks, H: int):
    """The sinks as the kernel reads them: ``H`` binary32 values (bf16 converted exactly)."""
    if sinks is None:
        return None
    s = torch.as_tensor(sinks).detach().reshape(-1).float().contiguous()
    if s.numel() != H:
        raise ValueError(f"sinks: expected {H} values (one per query head), got {s.numel()}")
    return s


def _window(window) -> int:
    """``window`` as the kernel reads it: 0 (none) or a positive number of keys."""
    w = 0 if window is None else int(window)
    if w < 0:
        raise ValueError(f"sliding window must be positive, got {w}")
    return w


def attention_spec(q, k, v, causal: bool = True, scale: float | None = None,
                   block_n: int = BLOCK_N, kv_lens=None, q_chunk: int = 64, sinks=None,
                   window=None) -> torch.Tensor:
    """The kernel written with torch ops (module doc): the reference the C kernel is tested
    against and the path taken when it cannot be built. All rows of a block at once; a block
    past a row's last key is an exact no-op for that row (``alpha = exp_s(0) = 1``, ``p = 0``,
    and ``l``, ``acc`` are never ``-0``, so ``x · 1 + (+0) = x``), so it may run for every row."""
    B, H, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    g = H // Hkv
    scale32 = _c(D ** -0.5 if scale is None else float(scale))
    lens = _kv_lens(kv_lens, B, Skv)
    o_dtype = q.dtype if q.dtype in _CODES else _F32
    out = torch.empty((B, H, Sq, Dv), dtype=o_dtype)
    s32, w = _sinks32(sinks, H), _window(window)
    kf = k.float().repeat_interleave(g, dim=1)        # (B, H, Skv, D)
    vf = v.float().repeat_interleave(g, dim=1)
    for i0 in range(0, Sq, q_chunk):
        i1 = min(Sq, i0 + q_chunk)
        qi = torch.arange(i0, i1)
        n = (lens[:, None] - Sq + qi[None, :] + 1).minimum(lens[:, None]) if causal \
            else lens[:, None].expand(B, i1 - i0)
        n = n[:, None, :, None]                                       # (B, 1, rows, 1)
        lo = (n - w).clamp(min=0) if w else torch.zeros_like(n)
        qf = q[:, :, i0:i1].float()
        m = torch.full((B, H, i1 - i0), float("-inf"))
        l_ = torch.zeros((B, H, i1 - i0))
        if s32 is not None:
            m = s32.view(1, H, 1).expand(B, H, i1 - i0).clone()
            l_ = torch.ones((B, H, i1 - i0))
        acc = torch.zeros((B, H, i1 - i0, Dv))
        for j0 in range(0, int(n.max()) if n.numel() else 0, block_n):
            j1 = min(j0 + block_n, Skv)
            kj = torch.arange(j0, j1).view(1, 1, 1, -1)
            valid = (kj < n) & (kj >= lo)                             # (B, 1, rows, bn)
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


def attention(q, k, v, causal: bool = True, scale: float | None = None,
              block_n: int = BLOCK_N, kv_lens=None, sinks=None, window=None) -> torch.Tensor:
    """The fused kernel when it is built (:mod:`.native`), else :func:`attention_spec`: the
    same bits. Large calls split their (sequence, KV head) pairs over the CPU kernels' thread pool
    (each row is computed by one thread: the split changes no bits). With autograd on and an
    input that requires grad, the result keeps these bits and differentiates through the
    float64 reference formula recomputed on the same inputs (:class:`_Attention`). ``sinks``
    ``(H,)`` and ``window`` (module doc): GPT-OSS's attention sinks and sliding window."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return _Attention.apply(q, k, v, causal, scale, block_n, kv_lens, sinks, window)
    return _forward(q, k, v, causal, scale, block_n, kv_lens, sinks, window)


class _Attention(torch.autograd.Function):
    """Forward: the kernel. Backward: autograd of the float64 reference attention of each
    sequence over its own ``kv_lens[b]`` keys (the gradient needs no invariance)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_n, kv_lens, sinks=None, window=None):
        ctx.save_for_backward(q, k, v, sinks)
        ctx.causal, ctx.scale, ctx.window = causal, scale, window
        ctx.lens = None if kv_lens is None else _kv_lens(kv_lens, q.shape[0], k.shape[2])
        with torch.no_grad():
            return _forward(q, k, v, causal, scale, block_n, kv_lens, sinks, window)

    @staticmethod
    def backward(ctx, g):
        from .reference import attention as ref_attention

        q, k, v, sinks = ctx.saved_tensors
        gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        gs = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float64)
        lens = ctx.lens.tolist() if ctx.lens is not None else [k.shape[2]] * q.shape[0]
        with torch.enable_grad():
            for b, n in enumerate(lens):
                qq, kk, vv = (t[b:b + 1, :, :m].detach().double().requires_grad_(True)
                              for t, m in ((q, q.shape[2]), (k, n), (v, n)))
                ss = None if sinks is None else sinks.detach().double().requires_grad_(True)
                out = ref_attention(qq, kk, vv, ctx.causal, ctx.scale, sinks=ss, window=ctx.window)
                grads = torch.autograd.grad(out, [t for t in (qq, kk, vv, ss) if t is not None],
                                            g[b:b + 1].double())
                gq[b:b + 1] = grads[0].to(q.dtype)
                gk[b:b + 1, :, :n] = grads[1].to(k.dtype)
                gv[b:b + 1, :, :n] = grads[2].to(v.dtype)
                if gs is not None:
                    gs += grads[3]
        return (gq, gk, gv, None, None, None, None,
                None if gs is None else gs.to(sinks.dtype), None)


def _forward(q, k, v, causal, scale, block_n, kv_lens, sinks=None, window=None) -> torch.Tensor:
    B, H, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if 0 in (B, H, Sq, Dv):
        return torch.zeros((B, H, Sq, Dv), dtype=q.dtype)
    lib = native.lib()
    if lib is None or block_n > MAX_BLOCK or max(D, Dv) > MAX_D:
        return attention_spec(q, k, v, causal, scale, block_n, kv_lens, sinks=sinks,
                              window=window)
    s32, w = _sinks32(sinks, H), _window(window)
    lens = _kv_lens(kv_lens, B, Skv).contiguous()
    qo, ko, vo = kernel_operand(q), kernel_operand(k), kernel_operand(v)
    o_dtype = q.dtype if q.dtype in _CODES else _F32
    out = torch.empty((B, H, Sq, Dv), dtype=o_dtype)
    sc = D ** -0.5 if scale is None else float(scale)
    # (the scale is rounded to binary32 once, as the spec's scale tensor)
    args = []
    for t in (qo, ko, vo):
        args += [t.data_ptr(), _CODES[t.dtype], t.stride(0), t.stride(1), t.stride(2)]

    def run(lo: int, hi: int) -> None:
        rc = lib.skyrl_attention_fwd(*args, None, 0, 0, out.data_ptr(), _CODES[o_dtype], lens.data_ptr(),
                                     B, H, Hkv, Sq, D, Dv,
                                     int(bool(causal)), sc, int(block_n), lo, hi,
                                     None if s32 is None else s32.data_ptr(), w)
        if rc != 0:
            raise RuntimeError(f"skyrl_attention_fwd refused its sizes (rc {rc})")

    parallel(run, B * Hkv, B * H * Sq * (Skv if not causal else (Skv + 1) / 2) * (D + Dv))
    return out if out.dtype == q.dtype else out.to(q.dtype)


def paged_attention(q, k_pool, v_pool, rows, kv_lens, scale: float | None = None,
                    block_n: int = BLOCK_N, sinks=None, window=None) -> torch.Tensor:
    """Causal attention reading keys and values straight from a paged cache: ``k_pool (S, Hkv,
    D)`` and ``v_pool (S, Hkv, Dv)`` are views of the cache's slots (any strides with a
    contiguous last dim), ``rows (B, L)`` int64 the slot of each sequence's keys in order and
    ``kv_lens (B,)`` how many of them count (the rest of a row of ``rows`` is never read; a
    counted slot outside the pools is a ``ValueError``).
    Bit for bit :func:`attention` over ``k_pool[rows]`` / ``v_pool[rows]`` (tested); without
    the C library it runs exactly that. No autograd (the engine's decode). ``sinks``,
    ``window``: as :func:`attention`."""
    B, H, Sq, D = q.shape
    Hkv, Dv = k_pool.shape[1], v_pool.shape[-1]
    L = rows.shape[1]
    lib = native.lib()
    if lib is None or block_n > MAX_BLOCK or max(D, Dv) > MAX_D or 0 in (B, H, Sq, Dv):
        def gathered(pool):
            return pool.index_select(0, rows.reshape(-1)).view(B, L, Hkv, -1).transpose(1, 2)
        return _forward(q, gathered(k_pool), gathered(v_pool), True, scale, block_n, kv_lens,
                        sinks, window)
    s32, w = _sinks32(sinks, H), _window(window)
    lens = _kv_lens(kv_lens, B, L).contiguous()
    rows = rows.contiguous()
    qo, ko, vo = kernel_operand(q), kernel_operand(k_pool), kernel_operand(v_pool)
    o_dtype = q.dtype if q.dtype in _CODES else _F32
    out = torch.empty((B, H, Sq, Dv), dtype=o_dtype)
    sc = D ** -0.5 if scale is None else float(scale)
    args = [qo.data_ptr(), _CODES[qo.dtype], qo.stride(0), qo.stride(1), qo.stride(2)]
    for t in (ko, vo):        # (b stride unused: rows give each key's slot)
        args += [t.data_ptr(), _CODES[t.dtype], 0, t.stride(1), t.stride(0)]
    pool_rows = min(k_pool.shape[0], v_pool.shape[0])

    def run(lo: int, hi: int) -> None:
        rc = lib.skyrl_attention_fwd(*args, rows.data_ptr(), rows.stride(0), pool_rows,
                                     out.data_ptr(), _CODES[o_dtype], lens.data_ptr(), B, H, Hkv,
                                     Sq, D, Dv, 1, sc, int(block_n), lo, hi,
                                     None if s32 is None else s32.data_ptr(), w)
        if rc == -3:
            raise ValueError(f"paged_attention: a slot of rows (within kv_lens) is outside the "
                             f"pools' {pool_rows} rows")
        if rc != 0:
            raise RuntimeError(f"skyrl_attention_fwd refused its sizes (rc {rc})")

    parallel(run, B * Hkv, B * H * Sq * L * (D + Dv))
    return out if out.dtype == q.dtype else out.to(q.dtype)
