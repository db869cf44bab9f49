"""TRL 1.16's vLLM importance-sampling arithmetic, operation by operation, in the input's dtype
(``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._generate_and_score_completions``): what
``skyrl_numerics.correction.combine(order="trl")`` runs, bitwise equal to TRL's
``importance_sampling_ratio`` on the valid tokens (tests/integrations/test_trl_correction.py).

TRL, per batch ``[B, T]`` (a: the trainer's logprobs, b: vLLM's, m: the loss mask)::

    d = nan_to_num((a - b) * m)                   # input dtype (float32)
    token modes:    r = exp(d)                    # [B, T]
    sequence modes: r = exp(d.sum(-1, keepdim))   # [B, 1], over the padded row
    *_truncate:     r = clamp(r, min=clip_min, max=clip_max)
    *_mask:         r = r.masked_fill((r < clip_min) | (r > clip_max), 0)

Each part maps ``(a, b, m, params)`` -> ``(weights, keep)``, broadcastable to ``[B, T]``; the
ratios are compared with the bounds as Python numbers, as TRL compares them. (NaN logprobs, which
TRL maps to ratio 1, never get here: the corrections refuse non-finite valid tokens.)
"""
from __future__ import annotations


def trl_token_ratio(a, b, m):
    """``exp((a - b) * m)`` in the input's dtype."""
    import torch

    return torch.exp((a - b) * m)


def trl_sequence_ratio(a, b, m):
    """``exp(Σ_t (a - b) * m)`` per row, ``[B, 1]``, in the input's dtype."""
    import torch

    return torch.exp(((a - b) * m).sum(dim=-1, keepdim=True))


def _inside(r, lo, hi):
    """``not (r < lo or r > hi)``, a missing bound open (TRL: ``-inf`` / ``inf``)."""
    import torch

    out = ~(r < lo) if lo is not None else torch.ones_like(r, dtype=torch.bool)
    return out & ~(r > hi) if hi is not None else out


def _clamp(r, p):
    import torch

    return torch.clamp(r, min=p.get("floor"), max=p["cap"])


def _trl_token_tis(a, b, m, p):
    return _clamp(trl_token_ratio(a, b, m), p), _inside(a, None, None)     # (keeps every token)


def _trl_sequence_tis(a, b, m, p):
    return _clamp(trl_sequence_ratio(a, b, m), p), _inside(a, None, None)


def _trl_token_mask(a, b, m, p):
    import torch

    return torch.ones_like(a), _inside(trl_token_ratio(a, b, m), p["lo"], p["hi"])


def _trl_masked_is(a, b, m, p):
    r = trl_token_ratio(a, b, m)
    return _clamp(r, {"cap": p["cap"]}), _inside(r, p["lo"], p["hi"])


def _trl_product_mask(a, b, m, p):
    import torch

    return torch.ones_like(a), _inside(trl_sequence_ratio(a, b, m), p["lo"], p["hi"])


TRL_PARTS = {"token_tis": _trl_token_tis, "sequence_tis": _trl_sequence_tis, "token_mask": _trl_token_mask,
             "masked_is": _trl_masked_is, "product_mask": _trl_product_mask}
