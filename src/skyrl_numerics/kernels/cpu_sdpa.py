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
    return out.to(query.dtype), lse


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
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _fold_groups(t: torch.Tensor, B: int, Hkv: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, Hkv·g, S, D) -> (B, Hkv, S, D) in ``dtype``: each query head's term rounded to
    ``dtype``, then summed over the g heads by :func:`cpu.reduce`. That is what the backward of
    ``repeat_kv`` (expand + reshape, then SDPA without ``enable_gqa``) computes under the mode,
    so a model gets the same gradient bits whichever of the two GQA paths it takes (transformers
    takes one with a padding mask and the other without)."""
    t = t.to(dtype).view(B, Hkv, g, *t.shape[2:])
    return cpu.reduce(t, [2], False, False)
