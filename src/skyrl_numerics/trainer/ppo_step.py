"""The bookkeeping both trainers' PPO step share (FSDP: ``fsdp/trainer.py``, megatron:
``megatron/trainer.py``), so the two compute the same loss terms from the same rollout:

1. ``log π_old`` per response token (:func:`old_logprobs`): given by the caller, else recomputed
   when an off-policy correction needs it, else ``None`` (the step's own detached logprobs);
2. the correction per micro-batch (:func:`correct_micro_batches`): weights and keep mask, and the
   correction's metrics as token-weighted sums;
3. the loss denominator (:func:`kept_totals`): kept tokens and sequences with at least one kept
   token, summed over micro-batches (each trainer all-reduces them as it needs).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout


def old_logprobs(rollout: Rollout, given, needed: bool, compute: Callable[[], np.ndarray]):
    """``given`` (one value per response token, checked) as float32, else ``compute()`` when
    ``needed``, else ``None``."""
    if given is not None:
        old = torch.as_tensor(np.asarray(given, dtype=np.float32).reshape(-1))
        if old.numel() != rollout.num_response_tokens:
            raise InputError(f"expected {rollout.num_response_tokens} old logprobs, got {old.numel()}",
                             field="old_logprobs")
        return old
    return torch.from_numpy(compute()) if needed else None


def correct_micro_batches(mbs, correction, old_all, rollout_lp):
    """``(per_mb, metric_sums, n_tokens)``: per micro-batch ``(mb, token_index, weights, keep)``
    (``None, None`` without a correction), the correction's finite metrics as sums weighted by
    its ``n_tokens``, and the total of those token counts."""
    per_mb, sums, n_total = [], {}, 0.0
    for mb in mbs:
        ti = torch.from_numpy(mb.token_index)
        w = keep = None
        if correction is not None:
            c = correction(old_all[ti], rollout_lp[ti], cu_seqlens=torch.from_numpy(mb.cu_seqlens))
            w, keep = torch.as_tensor(c.weights).float(), torch.as_tensor(c.mask).bool()
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
