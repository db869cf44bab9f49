"""Advantages, the PPO-clip policy loss, loss aggregation and KL/entropy metrics (plain torch).

Notation: sequence ``i`` has scalar reward ``R_i`` and belongs to group ``g(i)`` (the samples of one
prompt, ``n = |g|``); token ``t`` of sequence ``i`` has current logprob ``log π_θ``, old logprob
``log π_old`` (the policy that the ratio is taken against), keep mask ``m_t`` and off-policy weight
``w_t`` (both from :mod:`skyrl_numerics.correction`, detached).

Advantages (one per sequence, broadcast over its tokens with :func:`token_advantages`)::

    GRPO   A_i = (R_i - mean_g R) / (std_g R + eps)      std: unbiased (Bessel), as verl / SkyRL
           A_i =  R_i - mean_g R                          (std_normalize=False; Dr. GRPO)
           a group of one sample: mean 0, std 1  ->  A_i = R_i / (1 + eps)  (verl / SkyRL convention)
    RLOO   A_i = R_i - (1/(n-1)) Σ_{j∈g, j≠i} R_j  =  n/(n-1) · (R_i - mean_g R)
           a group of one sample: A_i = R_i (no baseline; verl convention)

PPO-clip with asymmetric clip-higher (DAPO: ε_high > ε_low keeps low-probability tokens learnable)::

    r_t   = exp(log π_θ - log π_old)
    ℓ_t   = -min(r_t A_t, clip(r_t, 1 - ε_low, 1 + ε_high) A_t)
    dual clip (optional, c > 1, A_t < 0 only):  ℓ_t = min(ℓ_t, -c A_t)

Aggregation over the batch (``D`` may be passed in: the global value across data-parallel ranks)::

    token_mean              L = Σ_t m_t w_t ℓ_t / D,  D = Σ_t m_t                (DAPO token-level)
    seq_mean_token_mean     L = (1/D) Σ_i (Σ_{t∈i} m_t w_t ℓ_t / Σ_{t∈i} m_t),  D = #{i : Σ m > 0}

Masked-out tokens leave both numerator and denominator, so a rejection mask (MIS / IcePop) removes
its tokens entirely, as :mod:`skyrl_numerics.correction` prescribes.

KL estimators of KL(π_θ ‖ π_ref) from samples of π_θ, with ``δ = log π_ref - log π_θ`` (Schulman)::

    k1 = -δ        k2 = δ² / 2        k3 = exp(δ) - 1 - δ   (unbiased, ≥ 0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from skyrl_numerics.errors import InputError

__all__ = ["grpo_advantages", "rloo_advantages", "compute_advantages", "token_advantages",
           "ppo_clip_loss", "aggregate", "kl_estimators", "masked_mean", "PolicyLoss", "AGGREGATIONS"]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


def _as_tensor(x, name: str, dtype=torch.float64) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise InputError(f"dtype {arr.dtype} is not numeric", field=name)
    return torch.as_tensor(arr, dtype=dtype)


def _groups(rewards, group_ids):
    r = _as_tensor(rewards, "rewards").detach()
    out_dtype = r.dtype if isinstance(rewards, torch.Tensor) and r.is_floating_point() else torch.float32
    if r.dim() != 1 or r.numel() == 0:
        raise InputError(f"expected a non-empty 1-D array of per-sequence rewards, got shape {tuple(r.shape)}",
                         field="rewards")
    bad = ~torch.isfinite(r)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise InputError(f"reward {float(r[i])!r} is not finite", row=i, field="rewards")
    if group_ids is None:
        g = torch.zeros(r.numel(), dtype=torch.long, device=r.device)
    else:
        g = torch.as_tensor(np.asarray(group_ids) if not isinstance(group_ids, torch.Tensor) else group_ids)
        if g.shape != r.shape:
            raise InputError(f"shape {tuple(g.shape)}, expected {tuple(r.shape)} (one per reward)",
                             field="group_ids")
        g = g.to(r.device).long()
    _, inv, counts = torch.unique(g, return_inverse=True, return_counts=True)
    r64 = r.double()
    sums = torch.zeros(counts.numel(), dtype=torch.float64, device=r.device).index_add_(0, inv, r64)
    n = counts.to(torch.float64)
    mean = sums / n
    return out_dtype, r64, inv, n, mean


def grpo_advantages(rewards, group_ids=None, *, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``(R_i - mean_g R) / (std_g R + eps)`` per sequence (unbiased std; see module doc).

    ``rewards`` [B] (torch or numpy), ``group_ids`` [B] (None: one group). Computed in float64,
    returned in the rewards' float dtype (float32 for integer/numpy input), no grad.
    """
    out_dtype, r64, inv, n, mean = _groups(rewards, group_ids)
    single = n == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    dev = r64 - mean[inv]
    ss = torch.zeros_like(n).index_add_(0, inv, dev * dev)
    std = torch.sqrt(ss / (n - 1).clamp(min=1))
    std = torch.where(single, torch.ones_like(std), std)
    adv = dev / (std[inv] + eps) if std_normalize else dev
    return adv.to(out_dtype)


def rloo_advantages(rewards, group_ids=None) -> torch.Tensor:
    """RLOO: ``R_i`` minus the mean reward of the other samples of its group (see module doc)."""
    out_dtype, r64, inv, n, mean = _groups(rewards, group_ids)
    ni = n[inv]
    adv = torch.where(ni > 1, (r64 - mean[inv]) * ni / (ni - 1).clamp(min=1), r64)
    return adv.to(out_dtype)


def compute_advantages(kind: str, rewards, group_ids=None, **kw) -> torch.Tensor:
    """``kind`` ``"grpo"`` or ``"rloo"``; keyword options go to that function."""
    if kind == "grpo":
        return grpo_advantages(rewards, group_ids, **kw)
    if kind == "rloo":
        return rloo_advantages(rewards, group_ids, **kw)
    raise InputError(f"unknown advantage estimator {kind!r}; expected 'grpo' or 'rloo'", field="advantage")


def token_advantages(seq_advantages, cu_seqlens) -> torch.Tensor:
    """Broadcast one advantage per sequence to its tokens: flat ``[cu[-1]]`` in sequence order."""
    a = _as_tensor(seq_advantages, "advantages", torch.float32)
    cu = _as_tensor(cu_seqlens, "cu_seqlens", torch.long).long().to(a.device)
    if cu.dim() != 1 or cu.numel() != a.numel() + 1:
        raise InputError(f"expected {a.numel() + 1} prefix sums for {a.numel()} sequences, got shape "
                         f"{tuple(cu.shape)}", field="cu_seqlens")
    return torch.repeat_interleave(a, cu[1:] - cu[:-1])


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (all if None); NaN when nothing is kept."""
    if mask is None:
        return x.mean() if x.numel() else x.new_tensor(math.nan)
    m = mask.to(x.dtype)
    n = m.sum()
    return (x * m).sum() / n if bool(n > 0) else x.new_tensor(math.nan)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor | None = None, weights: torch.Tensor | None = None,
              *, cu_seqlens=None, mode: str = "token_mean", denominator: float | torch.Tensor | None = None
              ) -> torch.Tensor:
    """Reduce a flat per-token loss to a scalar (formulas in the module doc).

    ``mask`` (bool/0-1) and ``weights`` (detached) are flat like ``per_token``. ``cu_seqlens`` is
    needed by ``seq_mean_token_mean``. ``denominator`` overrides ``D`` (pass the global token /
    sequence count when the batch is split over data-parallel ranks); a batch with ``D = 0``
    gives a zero loss that still depends on the graph (so backward works and yields zeros).
    """
    if mode not in AGGREGATIONS:
        raise InputError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}", field="aggregation")
    m = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
    contrib = per_token * m
    if weights is not None:
        contrib = contrib * weights.detach().to(per_token.dtype)
    if mode == "token_mean":
        d = m.sum() if denominator is None else denominator
        num = contrib.sum()
    else:
        if cu_seqlens is None:
            raise InputError("seq_mean_token_mean needs cu_seqlens", field="cu_seqlens")
        cu = _as_tensor(cu_seqlens, "cu_seqlens", torch.long).long().to(per_token.device)
        seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=per_token.device), cu[1:] - cu[:-1])
        nseq = cu.numel() - 1
        tok = torch.zeros(nseq, dtype=per_token.dtype, device=per_token.device).index_add(0, seg, m)
        s = torch.zeros(nseq, dtype=per_token.dtype, device=per_token.device).index_add(0, seg, contrib)
        has = tok > 0
        num = torch.where(has, s / tok.clamp(min=1), torch.zeros_like(s)).sum()
        d = has.sum().to(per_token.dtype) if denominator is None else denominator
    d = torch.as_tensor(d, dtype=per_token.dtype, device=per_token.device)
    return num / d if bool(d > 0) else num * 0.0


@dataclass
class PolicyLoss:
    """``loss`` (scalar, differentiable), ``per_token`` ℓ_t (flat) and ``metrics`` (floats, over kept tokens)."""

    loss: torch.Tensor
    per_token: torch.Tensor
    metrics: dict


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                  mask: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                  eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
                  aggregation: str = "token_mean", cu_seqlens=None,
                  denominator: float | torch.Tensor | None = None) -> PolicyLoss:
    """PPO-clip loss with clip-higher (``eps_high``) and optional dual clip, aggregated by ``aggregation``.

    All inputs flat ``[N]`` (token advantages: see :func:`token_advantages`). ``old_logprobs``,
    ``advantages``, ``weights`` are detached. Metrics (over kept tokens): ``pg_loss``,
    ``clipfrac_low`` (A<0 and r<1-ε_low: clipped below), ``clipfrac_high`` (A>0 and r>1+ε_high),
    ``clipfrac`` (their sum), ``ratio_mean``, ``ratio_max``, ``ppo_kl`` (k3 of π_old vs π_θ),
    ``dual_clipfrac`` when dual clip is on, ``n_tokens``.
    """
    if not (0 <= eps_low < 1) or eps_high < 0:
        raise InputError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}",
                         field="eps")
    if dual_clip is not None and not dual_clip > 1:
        raise InputError(f"dual_clip must be > 1, got {dual_clip}", field="dual_clip")
    n = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask),
                    ("weights", weights)):
        if t is not None and t.shape != n:
            raise InputError(f"shape {tuple(t.shape)}, expected {tuple(n)} (same as logprobs)", field=name)
    old = old_logprobs.detach().to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype)
    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(surr1, surr2)
    if dual_clip is not None:
        capped = torch.minimum(per_token, -dual_clip * adv)
        per_token = torch.where(adv < 0, capped, per_token)
    loss = aggregate(per_token, mask, weights, cu_seqlens=cu_seqlens, mode=aggregation, denominator=denominator)
    with torch.no_grad():
        keep = torch.ones_like(ratio, dtype=torch.bool) if mask is None else mask.bool()
        r = ratio.detach()
        low = (adv < 0) & (r < 1.0 - eps_low)
        high = (adv > 0) & (r > 1.0 + eps_high)
        k = keep.sum()
        metrics = {
            "pg_loss": float(loss.detach()),
            "clipfrac_low": float(masked_mean(low.float(), keep)),
            "clipfrac_high": float(masked_mean(high.float(), keep)),
            "ratio_mean": float(masked_mean(r, keep)),
            "ratio_max": float(r[keep].max()) if bool(k > 0) else math.nan,
            "ppo_kl": float(masked_mean(torch.expm1(-log_ratio.detach()) + log_ratio.detach(), keep)),
            "n_tokens": float(k),
        }
        metrics["clipfrac"] = metrics["clipfrac_low"] + metrics["clipfrac_high"]
        if dual_clip is not None:
            dual = (adv < 0) & (torch.maximum(-surr1, -surr2) > -dual_clip * adv)
            metrics["dual_clipfrac"] = float(masked_mean(dual.float(), keep))
    return PolicyLoss(loss, per_token, metrics)


def kl_estimators(logprobs, ref_logprobs, mask=None) -> dict:
    """Masked means of the k1, k2, k3 estimators of KL(π ‖ π_ref) from samples of π (no grad)."""
    lp = _as_tensor(logprobs, "logprobs").detach().double()
    ref = _as_tensor(ref_logprobs, "ref_logprobs").detach().double().to(lp.device)
    if ref.shape != lp.shape:
        raise InputError(f"shape {tuple(ref.shape)}, expected {tuple(lp.shape)}", field="ref_logprobs")
    m = None if mask is None else _as_tensor(mask, "mask").to(lp.device).bool()
    d = ref - lp
    return {"kl_k1": float(masked_mean(-d, m)), "kl_k2": float(masked_mean(0.5 * d * d, m)),
            "kl_k3": float(masked_mean(torch.expm1(d) - d, m))}
