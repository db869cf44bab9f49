"""The PPO step every trainer shares (FSDP: ``fsdp/trainer.py``, megatron: ``megatron/trainer.py``,
the invariant trainer: ``invariant/train.py``): :func:`ppo_update`. Each trainer supplies only
its micro-batches, its differentiable forward and its reductions; the core does, in order:

1. advantages: GRPO / RLOO per sequence from the rewards, broadcast to the response tokens;
2. ``log π_old`` per response token (:func:`old_logprobs`): given by the caller, else recomputed
   when an off-policy correction needs it, else ``None`` (the step's own detached logprobs);
3. the correction per micro-batch (:func:`correct_micro_batches`): weights and keep mask, and the
   correction's metrics as token-weighted sums; a multi-turn rollout's observation tokens
   (``loss_mask`` False: the environment's, not sampled) are outside the keep mask, so they
   leave the loss, its denominator, the correction and every metric;
4. the loss denominator (:func:`kept_totals`): kept tokens (``token_mean``) or sequences with at
   least one kept token (``seq_mean_token_mean``), summed over micro-batches and ranks;
5. per micro-batch: forward, the clipped surrogate (:func:`..losses.ppo_clip_loss`), backward;
   the metrics carried as token-weighted sums, reduced over ranks;
6. the trainer's ``update()`` (clip, optimizer step; returns the gradient norm and step number).

Metrics: loss, clipfrac_low / clipfrac_high / clipfrac, ratio_mean, ratio_max, entropy, ppo_kl
(means over kept tokens), n_tokens, grad_norm, adv_mean, reward_mean, step, and
``correction/<name>`` for the correction's metrics (means over its tokens).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable

import numpy as np
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout


def old_logprobs_for(rollout: Rollout, given, needed: bool, compute: Callable[[], np.ndarray] | None):
    """``given`` (one value per response token, checked) as float32, else ``compute()`` when
    ``needed``, else ``None``."""
    if given is not None:
        old = torch.as_tensor(np.asarray(given, dtype=np.float32).reshape(-1))
        if old.numel() != rollout.num_response_tokens:
            raise InputError(f"expected {rollout.num_response_tokens} old logprobs, got {old.numel()}",
                             field="old_logprobs")
        return old
    return torch.from_numpy(compute()) if needed else None


def correct_micro_batches(mbs, correction, old_all, rollout_lp, model_mask=None):
    """``(per_mb, metric_sums, n_tokens)``: per micro-batch ``(mb, token_index, weights, keep)``
    (``None, None`` without a correction or model mask), the correction's finite metrics as sums
    weighted by its ``n_tokens``, and the total of those token counts. ``model_mask`` (bool per
    response token, multi-turn): only those tokens are corrected and kept."""
    per_mb, sums, n_total = [], {}, 0.0
    for mb in mbs:
        ti = torch.from_numpy(mb.token_index)
        w = keep = None
        m = None if model_mask is None else model_mask[ti]
        if m is not None:
            keep = m
        if correction is not None:
            c = correction(old_all[ti], rollout_lp[ti], m, cu_seqlens=torch.from_numpy(mb.cu_seqlens))
            w, keep = torch.as_tensor(c.weights).float(), torch.as_tensor(c.mask).bool()
            if m is not None:
                keep = keep & m
            n = float(c.metrics.get("n_tokens", len(ti)))
            for k, v in c.metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v) and k not in ("n_tokens", "n_seqs"):
                    sums[k] = sums.get(k, 0.0) + v * n
            n_total += n
        per_mb.append((mb, ti, w, keep))
    return per_mb, sums, n_total


def kept_totals(per_mb) -> tuple[float, float]:
    """``(kept tokens, sequences with a kept token)`` over the micro-batches of
    :func:`correct_micro_batches`."""
    kept_tok = sum(float(len(ti)) if keep is None else float(keep.sum()) for _, ti, _, keep in per_mb)
    kept_seq = 0.0
    for mb, _ti, _, keep in per_mb:
        lens = np.diff(mb.cu_seqlens)
        if keep is None:
            kept_seq += float((lens > 0).sum())
        else:
            seg = np.repeat(np.arange(len(lens)), lens)
            kept_seq += float(len(np.unique(seg[keep.numpy()])))
    return kept_tok, kept_seq


def _identity(t):
    return t


def ppo_update(rollout: Rollout, rewards, cfg, *, micro_batches: Iterable, forward: Callable,
               update: Callable[[], tuple[float, int]], correction=None, old_logprobs=None,
               recompute_old: Callable[[], np.ndarray] | None = None, reduce_sum: Callable = _identity,
               reduce_max: Callable[[float], float] = float, loss_scale: float = 1.0,
               before_micro_batch: Callable[[int, bool], None] | None = None,
               context=contextlib.nullcontext) -> dict:
    """One PPO/GRPO update (module doc). ``cfg``: ``advantage``, ``std_normalize``, ``adv_eps``,
    ``eps_low``, ``eps_high``, ``dual_clip``, ``aggregation`` (a ``TrainerConfig``).
    ``micro_batches``: objects with ``token_index`` (flat response-token indices) and
    ``cu_seqlens``; ``forward(mb) -> (logprobs, entropy)`` with grad; ``update()`` after the
    backward passes -> ``(grad_norm, step)``. ``reduce_sum`` sums a float64 tensor over ranks,
    ``reduce_max`` a float; ``loss_scale`` multiplies each micro-batch's loss before backward
    (FSDP: the world size, as its gradient averages over ranks); ``before_micro_batch(j, last)``
    runs before micro-batch ``j``'s forward."""
    from .losses import compute_advantages, masked_mean, ppo_clip_loss, token_advantages

    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if rewards.shape != (len(rollout),):
        raise InputError(f"expected {len(rollout)} rewards (one per sequence), got shape {rewards.shape}",
                         field="rewards")
    kw = {"std_normalize": cfg.std_normalize, "eps": cfg.adv_eps} if cfg.advantage == "grpo" else {}
    seq_adv = compute_advantages(cfg.advantage, torch.from_numpy(rewards), rollout.group_ids, **kw)
    adv = token_advantages(seq_adv.float(), rollout.response_cu)
    rollout_lp = torch.from_numpy(rollout.rollout_logprobs)
    old_all = old_logprobs_for(rollout, old_logprobs, correction is not None, recompute_old)
    model_mask = torch.from_numpy(rollout.loss_mask) if rollout.is_multi_turn else None
    per_mb, corr_metrics, n_corr = correct_micro_batches(list(micro_batches), correction, old_all,
                                                         rollout_lp, model_mask)
    kept_tok, kept_seq = kept_totals(per_mb)
    totals = reduce_sum(torch.tensor([kept_tok, kept_seq], dtype=torch.float64))
    denom = float(totals[0] if cfg.aggregation == "token_mean" else totals[1])

    stats = torch.zeros(7, dtype=torch.float64)  # loss, low, high, ratio, ent, ppo_kl, n
    ratio_max = -math.inf
    last = len(per_mb) - 1
    with context():
        for j, (mb, ti, w, keep) in enumerate(per_mb):
            if before_micro_batch is not None:
                before_micro_batch(j, j == last)
            lp, ent = forward(mb)
            dev = lp.device
            old = lp.detach() if old_all is None else old_all[ti].to(dev)
            keep_d = None if keep is None else keep.to(dev)
            pl = ppo_clip_loss(lp, old, adv[ti].to(dev), mask=keep_d, weights=None if w is None else w.to(dev),
                               eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
                               aggregation=cfg.aggregation, cu_seqlens=mb.cu_seqlens, denominator=denom)
            (pl.loss * loss_scale if loss_scale != 1 else pl.loss).backward()
            m, n = pl.metrics, pl.metrics["n_tokens"]
            if n:  # metrics are means over kept tokens: carry them as sums
                ent_mean = float(masked_mean(ent.detach(), keep_d))
                stats += torch.tensor([pl.loss.item(), m["clipfrac_low"] * n, m["clipfrac_high"] * n,
                                       m["ratio_mean"] * n, ent_mean * n, m["ppo_kl"] * n, n],
                                      dtype=torch.float64)
                ratio_max = max(ratio_max, m["ratio_max"])
    stats = reduce_sum(stats)
    ratio_max = reduce_max(ratio_max)
    grad_norm, step = update()

    n = float(stats[6])
    div = (lambda x: float(x) / n) if n else (lambda x: math.nan)
    out = {"loss": float(stats[0]), "clipfrac_low": div(stats[1]), "clipfrac_high": div(stats[2]),
           "clipfrac": div(stats[1] + stats[2]), "ratio_mean": div(stats[3]), "ratio_max": float(ratio_max),
           "entropy": div(stats[4]), "ppo_kl": div(stats[5]), "n_tokens": n, "grad_norm": float(grad_norm),
           "adv_mean": float(seq_adv.mean()), "reward_mean": float(rewards.mean()), "step": step}
    if corr_metrics or correction is not None:
        keys = sorted(corr_metrics)
        vec = reduce_sum(torch.tensor([corr_metrics[k] for k in keys] + [n_corr], dtype=torch.float64))
        tot = float(vec[-1])
        out.update({f"correction/{k}": float(v) / tot if tot else math.nan for k, v in zip(keys, vec[:-1])})
    return out
