"""SkyRL 0.4.0's off-policy correction arithmetic, operation by operation, in the input's dtype
(``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py``): what
``skyrl_numerics.correction.combine(order="skyrl_exact")`` runs, bitwise equal to SkyRL's
``compute_off_policy_correction`` (tests/integrations). Each part maps ``(a, b, m, params)`` ->
``(weights or None, keep mask or None)``; ``m`` is the float32 loss mask so far."""
from __future__ import annotations

SKYRL_CLIP = 20.0


def skyrl_ratio(delta, dtype):
    """SkyRL ``safe_exp_delta``: ``exp(clamp(float32(delta), -20, 20))`` cast to ``dtype``."""
    import torch

    return torch.clamp(delta.to(torch.float32), -SKYRL_CLIP, SKYRL_CLIP).exp().to(dtype)


def _sk_token_tis(a, b, m, p):
    """``min(r_t, C)``, ``r_t = skyrl_ratio(a - b)``."""
    import torch

    return torch.clamp(skyrl_ratio(a - b, a.dtype), max=p["cap"]), None


def _sk_sequence_tis(a, b, m, p):
    """``min(skyrl_ratio(Σ_t (a - b) m), C)`` on every token of the sequence."""
    import torch

    s = ((a - b) * m).sum(dim=-1, keepdim=True)
    return torch.clamp(skyrl_ratio(s, a.dtype), max=p["cap"]).expand_as(a), None


def _sk_in_bounds(r, lo, hi):
    """``lo <= r <= hi`` with a missing bound open (compared as SkyRL does, on ratios)."""
    import torch

    ok = torch.ones_like(r, dtype=torch.bool)
    if hi is not None:
        ok = ok & ~(r > hi)
    if lo is not None:
        ok = ok & ~(r < lo)
    return ok


def _sk_outlier_veto(a, b, m, p):
    """Drop a sequence if a kept token's ratio lies outside ``[lo, hi]``."""
    ok = _sk_in_bounds(skyrl_ratio(a - b, a.dtype), p["lo"], p["hi"]) | (m == 0)
    return None, ok.all(dim=-1, keepdim=True).float()


def _sk_token_mask(a, b, m, p):
    """Keep a token iff ``lo <= r_t <= hi`` (masked tokens stay as they are)."""
    return None, (_sk_in_bounds(skyrl_ratio(a - b, a.dtype), p["lo"], p["hi"]) | (m == 0)).float()


def _sk_masked_is(a, b, m, p):
    """SkyRL's token mask ``[lo, hi]`` and token TIS with cap C."""
    return _sk_token_tis(a, b, m, p)[0], _sk_token_mask(a, b, m, p)[1]


def _sk_geometric_mask(a, b, m, p):
    """Keep a sequence iff ``lo <= skyrl_ratio(Σ (a - b) m / max(Σ m, 1)) <= hi``."""
    n = m.sum(dim=-1, keepdim=True).clamp(min=1.0)
    g = skyrl_ratio(((a - b) * m).sum(dim=-1, keepdim=True) / n, a.dtype)
    return None, _sk_in_bounds(g, p["lo"], p["hi"]).float()


def _sk_product_mask(a, b, m, p):
    """Keep a sequence iff ``lo <= skyrl_ratio(Σ (a - b) m) <= hi``."""
    g = skyrl_ratio(((a - b) * m).sum(dim=-1, keepdim=True), a.dtype)
    return None, _sk_in_bounds(g, p["lo"], p["hi"]).float()


SKYRL_PARTS = {"token_tis": _sk_token_tis, "sequence_tis": _sk_sequence_tis, "outlier_veto": _sk_outlier_veto,
                "token_mask": _sk_token_mask, "masked_is": _sk_masked_is, "geometric_mask": _sk_geometric_mask,
                "product_mask": _sk_product_mask}
