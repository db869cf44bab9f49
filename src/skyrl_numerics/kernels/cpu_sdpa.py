"""``scaled_dot_product_attention`` on CPU for :func:`batch_invariant_mode`: the op torch's SDPA
takes on CPU (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward), written
with the CPU path's invariant pieces.

Why: the stock CPU flash kernel tiles keys and queries by the (padded) sequence length and
runs its exp and sums through vector bodies with scalar tails, so a sequence's rows inside a
right-padded batch get other bits than the same sequence alone (measured: 4 of 7 rows on AVX2;
on AVX-512 from 16 keys on). Here, per ``(b, h)``, in binary32 (``g = H / Hkv`` query heads per
key/value head; ``scale`` defaults to ``E ** -0.5``)::

    s    = bmm(q, kᵀ) · scale        + mask  (bool: -inf where False; float: added)
                                             (is_causal: -inf for key j > query i)
    m    = max_j s,   m* = 0 if m = ±inf else m
    p    = exp(s - m*),   l = row_sum(p)       (cpu.row_sum: pairwise, fixed positions)
    out  = bmm(p, v) / l   (0 where l = 0: a fully masked row)
    lse  = m* + log l      (0 where l = 0, as the stock kernel)

    backward (dO given):  p = exp(s - lse)
    dv = bmm(pᵀ, dO),  dp = bmm(dO, vᵀ),  δ = row_sum(dO · out)
    ds = p · (dp - δ),  dq = bmm(ds, k) · scale,  dk = bmm(dsᵀ, q) · scale
    (GQA: dk, dv of the g query heads of a KV head rounded to the input dtype, then summed as
    ``cpu.reduce`` sums them: the bits of the ``repeat_kv`` + SDPA path)

``cpu.bmm`` gives rows independent of the batch and of zero padding of K, ``row_sum`` sums
independent of trailing zeros, and exp/log compute an element the same in ATen's vector body
and tail (tested per ISA). A padded key has p = 0 exactly and a padded query (whose output the
loss never reads) has dO = 0, hence ds = 0: every real row's forward and its contributions to
dq, dk, dv are the bits it gets alone. Dropout is refused (it cannot be invariant).

Under CPU autocast the mode also replaces SDPA at the ``AutocastCPU`` key (:func:`autocast_sdpa`):
``enable_gqa`` becomes :func:`repeat_kv` before the cast, as transformers' other GQA path.
"""
from __future__ import annotations

import torch

from . import cpu

F32 = torch.float32


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., M, K) @ (..., K, N) over any leading dims, in fp32, by :func:`cpu.bmm`."""
    lead = a.shape[:-2]
    out = cpu.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=F32)
    return out.view(*lead, a.shape[-2], b.shape[-1])


def _scores(q, k, is_causal: bool, attn_mask, scale):
    """(qf, kf, s): fp32 operands (K/V heads repeated for GQA) and the masked scores."""
    B, H, L, E = q.shape
    g = H // k.shape[1]
    qf = q.to(F32)
    kf = k.to(F32).repeat_interleave(g, dim=1) if g > 1 else k.to(F32)
    sc = torch.tensor(E ** -0.5 if scale is None else float(scale), dtype=F32)
    s = _bmm(qf, kf.transpose(-1, -2)) * sc
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(F32)
    if is_causal:
        S = k.shape[2]
        keep = torch.ones(L, S, dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return qf, kf, s, sc


def _check(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError(f"batch-invariant SDPA: dropout_p={dropout_p} (dropout cannot be "
                                  "batch-invariant; use 0 in the trainer)")


def flash_attention_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                            scale=None):
    """aten::_scaled_dot_product_flash_attention_for_cpu -> (output, logsumexp (B, H, L) fp32)."""
    _check(dropout_p)
    g = query.shape[1] // key.shape[1]
    _, _, s, _ = _scores(query, key, is_causal, attn_mask, scale)
    vf = value.to(F32).repeat_interleave(g, dim=1) if g > 1 else value.to(F32)
    m = s.amax(-1, keepdim=True)
    ms = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = (s - ms).exp()
    l_ = cpu.row_sum(p).unsqueeze(-1)
    empty = l_ == 0
    out = torch.where(empty, torch.zeros(()), _bmm(p, vf) / torch.where(empty, torch.ones(()), l_))
    lse = torch.where(empty, torch.zeros(()), ms + l_.log()).squeeze(-1)
    B, H, L, _ = query.shape
    res = torch.empty_like(query) if value.shape[-1] == query.shape[-1] else \
        torch.empty_permuted((*query.shape[:3], value.shape[-1]), (0, 2, 1, 3), dtype=query.dtype)
    return res.copy_(out), torch.empty((B, L, H), dtype=F32).transpose(1, 2).copy_(lse)


def flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                     is_causal, *, attn_mask=None, scale=None):
    """aten::_scaled_dot_product_flash_attention_for_cpu_backward -> (dq, dk, dv)."""
    _check(dropout_p)
    B, H, L, E = query.shape
    Hkv = key.shape[1]
    g = H // Hkv
    qf, kf, s, sc = _scores(query, key, is_causal, attn_mask, scale)
    vf = value.to(F32).repeat_interleave(g, dim=1) if g > 1 else value.to(F32)
    p = (s - logsumexp.to(F32).unsqueeze(-1)).exp()
    go = grad_out.to(F32)
    dv = _bmm(p.transpose(-1, -2), go)
    dp = _bmm(go, vf.transpose(-1, -2))
    delta = cpu.row_sum(go * out.to(F32)).unsqueeze(-1)
    ds = p * (dp - delta)
    dq = _bmm(ds, kf) * sc
    dk = _bmm(ds.transpose(-1, -2), qf) * sc
    if g > 1:
        dk, dv = _fold_groups(dk, B, Hkv, g, key.dtype), _fold_groups(dv, B, Hkv, g, value.dtype)
    return _like_stock(dq, query), _like_stock(dk, key), _like_stock(dv, value)


def _like_stock(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``x``'s dtype, laid out as the stock backward (and its meta) lays it out:
    ``(B, L, H, D)`` in memory, seen as ``(B, H, L, D)``."""
    return torch.empty_permuted(x.shape, (0, 2, 1, 3), dtype=x.dtype).copy_(grad)


def _fold_groups(t: torch.Tensor, B: int, Hkv: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, Hkv·g, S, D) -> (B, Hkv, S, D) in ``dtype``: each query head's term rounded to
    ``dtype``, then summed over the g heads by :func:`cpu.reduce`. That is what the backward of
    ``repeat_kv`` (expand + reshape, then SDPA without ``enable_gqa``) computes under the mode,
    so a model gets the same gradient bits whichever of the two GQA paths it takes (transformers
    takes one with a padding mask and the other without)."""
    t = t.to(dtype).view(B, Hkv, g, *t.shape[2:])
    return cpu.reduce(t, [2], False, False)


def repeat_kv(x: torch.Tensor, g: int) -> torch.Tensor:
    """``(..., Hkv, S, D) -> (..., Hkv·g, S, D)``, KV head j serving query heads j·g ... j·g+g-1:
    transformers' ``repeat_kv`` (expand + reshape), whose backward sums the g heads' gradients
    in the dtype of ``x``."""
    shape = (*x.shape[:-2], g, *x.shape[-2:])
    return x.unsqueeze(-3).expand(shape).reshape(*x.shape[:-3], x.shape[-3] * g, *x.shape[-2:])


def _autocast(t, dtype: torch.dtype):
    """What CPU autocast's lower-precision policy does to an argument: floating tensors but
    float64 cast to ``dtype``; anything else as it is."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
        return t.to(dtype)
    return t


def autocast_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
    """aten::scaled_dot_product_attention at the ``AutocastCPU`` key: what stock autocast does
    (the arguments cast to the autocast dtype, SDPA run with autocast off), except that
    ``enable_gqa`` with fewer K/V heads becomes :func:`repeat_kv` of K and V *as given*, before
    the cast, and SDPA without ``enable_gqa``.

    Why: transformers takes ``enable_gqa`` without a padding mask and ``repeat_kv`` with one. Under
    bf16 autocast K arrives in float32 (RoPE promotes it); ``repeat_kv`` then repeats float32 K,
    autocast casts the repeated K, and the backward sums the g heads' bf16 gradients in float32,
    while ``enable_gqa`` casts K first and folds dK inside the op, rounded to bf16 (measured on a
    tiny Llama: 56 of 63 input-gradient rows differed between a sequence alone and in a padded
    batch). Repeating first gives both paths one graph, hence the same bits; the values are those
    ``enable_gqa`` reads (a repeat is exact)."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        g = query.shape[-3] // key.shape[-3]
        key, value, enable_gqa = repeat_kv(key, g), repeat_kv(value, g), False
    dt = torch.get_autocast_dtype("cpu")
    q, k, v, m = (_autocast(t, dt) for t in (query, key, value, attn_mask))
    with torch.autocast("cpu", enabled=False):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=m, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
