"""Off-policy corrections for what is left of the trainer–rollout gap.

Every function takes the trainer and rollout logprobs of the sampled tokens (padded ``[B, T]``
with an optional ``mask``, or flat 1-D with ``cu_seqlens=``; torch or numpy) and returns a
:class:`Correction`: IS ``weights`` and a keep ``mask`` in the input's layout, plus ``metrics``
of what was clipped or removed. Torch in → torch out on the same device (weights float32, or
float64 for float64 input; computed in float64, no grad); numpy in → numpy out (float64).

Notation per valid token t of sequence i: ``d_t = log π_train − log π_rollout`` and
``r_t = exp(d_t)``; ``S_i = Σ_t d_t`` (so ``Π_t r_t = exp(S_i)``), ``L_i`` the number of valid
tokens. All bounds are inclusive, all comparisons are done on logs (no overflow). Only the
differences ``d_t`` are used, so the inputs need not be <= 0 (shifted logprobs or log-ratios
against 0 work); they must be finite real arrays of the same shape (NaN, inf, complex, bool,
scalars and non-integer ``cu_seqlens`` are refused), bounds and caps numbers > 0 (a lower bound
``lo=0`` of a mask is no lower bound; ``inf`` caps and upper bounds are none).

==================  ========================================================================
``token_tis``       w_t = min(r_t, C)   (with ``floor=F``: max(min(r_t, C), F))   (truncated IS)
``sequence_tis``    w_t = min(Π r, C) = min(exp(S_i), C) on every token of sequence i (``floor=``: as above)
``geometric_mask``  keep sequence i iff lo ≤ exp(S_i / L_i) ≤ hi         (geo-mean ratio)
``product_mask``    keep sequence i iff lo ≤ exp(S_i) ≤ hi               (sequence RS)
``outlier_veto``    drop sequence i iff some token has r_t < lo or r_t > hi
``token_mask``      keep token t iff lo ≤ r_t ≤ hi                       (token RS / IcePop)
``masked_is``       MIS: w_t = min(r_t, C) and keep t iff lo ≤ r_t ≤ hi
==================  ========================================================================

How to use the result: ``loss = Σ (loss_weights · ℓ_t) / Σ mask`` where ``loss_weights =
weights · mask``. For MIS this is the decoupled form of slime PR #657 / verl #3915 (IS weights
and rejection mask kept apart so rejected tokens leave the denominator too); C defaults to hi,
where truncation is a no-op on kept tokens. ``combine`` chains corrections (weights multiply,
masks AND), e.g. token TIS + geometric mask + veto. ``order="skyrl"`` (default) runs the
parts as SkyRL does: veto → token mask → TIS → sequence mask, each re-computed on the mask
left by the previous step; ``order="skyrl_exact"`` does the same in SkyRL 0.4.0's own arithmetic
(float32 ratios ``exp(clamp(d, −20, 20))``, bounds compared on ratios), bitwise equal to its
``compute_off_policy_correction``; ``order="verl"`` computes every part on the original mask
(verl's rollout correction) and then multiplies / ANDs; ``order="trl"`` does the same in TRL
1.16's arithmetic (``correction_trl.py``). ``combine(..., denominator="valid")`` is TRL's loss
denominator: rejected tokens get weight 0 and stay in ``mask``, so ``Σ mask`` still counts them. Clipped weights are exactly C (``min(r, C)``
in float64; a float32 output is never rounded above C).

Metrics (floats): ``n_tokens`` / ``n_seqs`` (valid tokens, sequences with ≥ 1 valid token),
``frac_tokens_masked`` (valid tokens removed), ``frac_seqs_masked`` (sequences left with no
kept token), ``frac_tokens_clipped`` (valid tokens whose weight was truncated below r, or raised to a floor),
``frac_seqs_clipped`` (sequence TIS), ``mean_weight`` (over kept tokens; NaN if none),
``mean_ratio`` (mean r over valid tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from skyrl_numerics.gap.layout import FIELDS, is_torch
from skyrl_numerics.correction_skyrl import SKYRL_PARTS
from skyrl_numerics.correction_trl import TRL_PARTS
from skyrl_numerics.errors import InputError

__all__ = ["Correction", "token_tis", "sequence_tis", "geometric_mask", "product_mask",
           "outlier_veto", "token_mask", "masked_is", "combine"]


@dataclass
class Correction:
    """IS ``weights`` (0 outside the input mask), keep ``mask`` (bool), and ``metrics``."""

    name: str
    weights: object
    mask: object
    metrics: dict
    _state: tuple = field(default=None, repr=False, compare=False)  # padded (batch, w, keep)
    _recipe: object = field(default=None, repr=False, compare=False)  # batch -> (w, keep, clipped, extra)
    _params: dict = field(default=None, repr=False, compare=False)  # ratio-space lo / hi / cap (skyrl_exact)

    @property
    def loss_weights(self):
        """``weights * mask``: multiply the per-token loss by this, divide by ``mask.sum()``."""
        return self.weights * self.mask


# -- layout -----------------------------------------------------------------------------------
class _Batch:
    """Padded float64 ``d`` [B, T] + ``valid`` [B, T] (torch), and the way back to the input layout."""

    def __init__(self, trainer, rollout, mask, cu_seqlens):
        import torch

        self.numpy = not is_torch(trainer)
        a, b = self._tensor(trainer, FIELDS[0], True), self._tensor(rollout, FIELDS[1], True)
        self.out_dtype = torch.float64 if (self.numpy or a.dtype == torch.float64) else torch.float32
        if a.dim() not in (1, 2):
            raise InputError(f"expected 1-D (flat) or 2-D [B, T] (padded), got shape {tuple(a.shape)}",
                             field=FIELDS[0])
        if b.shape != a.shape:
            raise InputError(f"shape {tuple(b.shape)}, expected {tuple(a.shape)} (same as trainer_logprobs)",
                             field=FIELDS[1])
        if a.numel() == 0:
            raise InputError("empty input: no tokens", field=FIELDS[0])
        b = b.to(a.device)
        self.inputs = (a, b)
        self.cu = None
        if a.dim() == 1:
            n = a.numel()
            if cu_seqlens is None:
                cu = torch.tensor([0, n], device=a.device)
            else:
                cu = self._tensor(cu_seqlens, "cu_seqlens").to(a.device)
                if cu.dtype.is_floating_point or cu.dtype == torch.bool:
                    raise InputError(f"expected integers, got {cu.dtype}", field="cu_seqlens")
                cu = cu.long()
                ok = (cu.dim() == 1 and cu.numel() >= 2 and int(cu[0]) == 0 and int(cu[-1]) == n
                      and bool((cu[1:] >= cu[:-1]).all()))
                if not ok:
                    raise InputError(f"expected non-decreasing [0, ..., {n}] of shape [B+1]", field="cu_seqlens")
            self.cu = cu
        elif cu_seqlens is not None:
            raise InputError("cu_seqlens is for flat 1-D input; padded [B, T] input uses mask", field="cu_seqlens")
        if mask is None:
            valid = torch.ones(a.shape, dtype=torch.bool, device=a.device)
        else:
            m = self._tensor(mask, "mask").to(a.device)
            if m.shape != a.shape:
                raise InputError(f"shape {tuple(m.shape)}, expected {tuple(a.shape)} (same as trainer_logprobs)",
                                 field="mask")
            if m.dtype != torch.bool:
                bad = (m != 0) & (m != 1)
                if bool(bad.any()):
                    self._raise_at(bad, "mask", "is not 0/1 or bool", values=m)
            valid = m.bool()
        if a.dim() == 1:
            n, cu = a.numel(), self.cu
            lengths = cu[1:] - cu[:-1]
            bsz, t = lengths.numel(), int(lengths.max())
            self.seg = torch.repeat_interleave(torch.arange(bsz, device=a.device), lengths)
            self.pos = torch.arange(n, device=a.device) - cu[:-1][self.seg]
            self._check_finite(a, b, valid)
            d = torch.zeros(bsz, t, dtype=torch.float64, device=a.device)
            v = torch.zeros(bsz, t, dtype=torch.bool, device=a.device)
            d[self.seg, self.pos] = torch.where(valid, a.double() - b.double(), 0.0)
            v[self.seg, self.pos] = valid
        else:
            self._check_finite(a, b, valid)
            d = torch.where(valid, a.double() - b.double(), torch.zeros((), dtype=torch.float64, device=a.device))
            v = valid
        self.d, self.valid = d, v

    @staticmethod
    def _tensor(x, fld, logprobs: bool = False):
        """A tensor of real numbers (logprobs: not bool either); 0-d is refused, not widened."""
        import torch

        if is_torch(x):
            t = x.detach()
            if t.is_complex() or (logprobs and t.dtype == torch.bool):
                raise InputError(f"dtype {t.dtype} is not a real number type", field=fld)
        else:
            arr = np.asarray(x)
            if arr.dtype.kind not in ("fiu" if logprobs else "fiub"):
                raise InputError(f"dtype {arr.dtype} is not a real number type", field=fld)
            t = torch.from_numpy(np.ascontiguousarray(arr).reshape(arr.shape))
        if t.dim() == 0:
            raise InputError("expected an array of values, got a scalar", field=fld)
        return t

    def _raise_at(self, bad, fld, what, values=None):
        import torch

        k = int(torch.nonzero(bad.reshape(-1))[0])
        if bad.dim() == 2:
            row, idx = divmod(k, bad.shape[1])
        elif self.cu is not None:
            row = int(torch.searchsorted(self.cu, torch.tensor(k, device=self.cu.device), right=True)) - 1
            idx = k - int(self.cu[row])
        else:
            row, idx = 0, k
        v = "" if values is None else f" {float(values.reshape(-1)[k])!r}"
        raise InputError(f"value{v}: {what}", row=row, field=fld, index=idx)

    def _check_finite(self, a, b, valid):
        import torch

        for x, fld in ((a, FIELDS[0]), (b, FIELDS[1])):
            bad = ~torch.isfinite(x) & valid
            if bool(bad.any()):
                self._raise_at(bad, fld, "not finite", values=x)

    def restrict(self, keep) -> "_Batch":
        """The same batch with ``valid`` narrowed to ``keep`` (d zeroed elsewhere)."""
        import copy

        import torch

        b = copy.copy(self)
        b.valid = keep & self.valid
        b.d = torch.where(b.valid, self.d, torch.zeros((), dtype=self.d.dtype, device=self.d.device))
        return b

    def padded_inputs(self):
        """Trainer and rollout logprobs as padded ``[B, T]`` tensors in their own dtypes (integers
        as float64), 0 where not valid (so a masked NaN cannot reach a sum)."""
        import torch

        out = []
        for x in self.inputs:
            x = x if x.is_floating_point() else x.double()
            if self.cu is not None:
                y = x.new_zeros(self.d.shape)
                y[self.seg, self.pos] = x
                x = y
            out.append(torch.where(self.valid, x, torch.zeros((), dtype=x.dtype, device=x.device)))
        return tuple(out)

    def out(self, x):
        """Padded [B, T] tensor -> the input's layout and kind."""
        if self.cu is not None:
            x = x[self.seg, self.pos]
        if x.dtype == self.d.dtype:
            x = x.to(self.out_dtype)
        return x.cpu().numpy() if self.numpy else x


def _metrics(batch: _Batch, w, keep, clipped) -> dict:
    import torch

    valid = batch.valid
    n_tok = int(valid.sum())
    seq_has = valid.any(dim=1)
    n_seq = int(seq_has.sum())
    n_keep = int(keep.sum())
    r = torch.exp(batch.d)
    return {
        "n_tokens": float(n_tok),
        "n_seqs": float(n_seq),
        "frac_tokens_masked": (n_tok - n_keep) / max(n_tok, 1),
        "frac_seqs_masked": int((seq_has & ~keep.any(dim=1)).sum()) / max(n_seq, 1),
        "frac_tokens_clipped": int((clipped & valid).sum()) / max(n_tok, 1),
        "mean_weight": float(w[keep].mean()) if n_keep else math.nan,
        "mean_ratio": float(r[valid].mean()) if n_tok else math.nan,
    }


def _capped(w, cap):
    """``min(w, cap)`` that never exceeds ``cap`` (``exp(min(d, ln C))`` can: ``C = 3`` gives
    3.0000000000000004 in float64)."""
    import torch

    return torch.clamp(w, max=cap)


def _finish(name, batch: _Batch, w, keep, clipped, extra=None, *, cap=None, recipe=None,
            params=None) -> Correction:
    """Build the Correction from padded weights, keep mask and clipped mask."""
    import torch

    valid = batch.valid
    keep = keep & valid
    w = torch.where(valid, w, torch.zeros((), dtype=torch.float64, device=valid.device))
    metrics = _metrics(batch, w, keep, clipped)
    metrics.update(extra or {})
    out_w = batch.out(w)
    if cap is not None:
        out_w = _below_cap(out_w, cap)
    return Correction(name, out_w, batch.out(keep), metrics, _state=(batch, w, keep), _recipe=recipe,
                      _params=params)


def _below_cap(x, cap):
    """A float32 output whose rounding went above ``cap`` steps one ulp down (weights ≤ C exactly)."""
    import torch

    if isinstance(x, np.ndarray) or x.dtype == torch.float64:
        return x
    over = x.double() > cap
    if bool(over.any()):
        x = torch.where(over, torch.nextafter(x, torch.zeros((), dtype=x.dtype, device=x.device)), x)
    return x


def _log_bound(x, default=None):
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise InputError(f"bound {x!r} is not a number", field="bounds")
    if not (x > 0):
        raise InputError(f"bound {x!r} must be > 0", field="bounds")
    return math.log(x)


def _cap(cap) -> float:
    """A truncation cap C: a number > 0 (``inf``: no truncation)."""
    if cap is None:
        raise InputError("cap is required (a number > 0)", field="bounds")
    _log_bound(cap)
    return float(cap)


def _bounds(lo, hi):
    """(ln lo, ln hi); ``lo=None`` means 1/hi (verl's reciprocal default)."""
    if hi is None:
        raise InputError("upper bound is required", field="bounds")
    lhi = _log_bound(hi)
    llo = -lhi if lo is None else -math.inf if _is_zero(lo) else _log_bound(lo)
    if llo > lhi:
        raise InputError(f"lower bound {lo!r} > upper bound {hi!r}", field="bounds")
    return llo, lhi


def _is_zero(x) -> bool:
    """A lower bound of 0 (a number, not ``False``): no lower bound, ``ln 0 = -inf``."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and x == 0


def _floor(floor, cap: float):
    """A lower clip F of a truncation (``None``: none): a number > 0 and ≤ C."""
    if floor is None:
        return None
    _log_bound(floor)
    if floor > cap:
        raise InputError(f"floor {floor!r} > cap {cap!r}", field="bounds")
    return float(floor)


def _clip(w, cap: float, floor):
    """``max(min(w, C), F)`` (``torch.clamp``'s order) and the clipped mask (w outside [F, C])."""
    import torch

    out = torch.clamp(w, min=floor, max=cap)
    return out, (w > cap) if floor is None else (w > cap) | (w < floor)


def _ratio_bounds(lo, hi) -> dict:
    """The bounds as ratios, ``lo=None`` -> ``1/hi`` (checked by :func:`_bounds` first)."""
    return {"lo": 1.0 / hi if lo is None else lo, "hi": hi}


def _seq_sum(batch):
    return batch.d.sum(dim=1)      # padding is 0 in d


# -- corrections ------------------------------------------------------------------------------
# Each method is a function of the batch (its d and its valid mask), so combine(order="skyrl") can
# re-run it on the mask left by the previous step. Stages give SkyRL's order.
_STAGE = {"outlier_veto": 0, "token_mask": 1, "masked_is": 1, "token_tis": 2, "sequence_tis": 2,
          "geometric_mask": 3, "product_mask": 3}


def _run(name, b, compute, cap=None, params=None) -> Correction:
    w, keep, clipped, extra = compute(b)
    return _finish(name, b, w, keep, clipped, extra, cap=cap, recipe=compute, params=params)


def _ones(b):
    import torch

    return torch.ones_like(b.d)


def token_tis(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, cap: float = 2.0,
              floor: float | None = None) -> Correction:
    """Token truncated IS: ``w_t = min(r_t, C)`` (never above C); nothing masked. (SkyRL ML4 recipe: C = 2.)
    ``floor=F`` (≤ C) clips from below too, ``w_t = max(min(r_t, C), F)`` (TRL's ``clip_min``)."""
    import torch

    b = _Batch(trainer_logprobs, rollout_logprobs, mask, cu_seqlens)
    c = _cap(cap)
    f = _floor(floor, c)

    def compute(b):
        w, clipped = _clip(torch.exp(b.d), c, f)
        return w, b.valid, clipped, {}
    return _run("token_tis", b, compute, cap=c, params={"cap": c, "floor": f})


def sequence_tis(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, cap: float = 5.0,
                 floor: float | None = None) -> Correction:
    """Sequence truncated IS: ``w_i = min(Π_t r_t, C) = min(exp(S_i), C)`` on all tokens of i;
    ``floor=F`` (≤ C): ``max(min(exp(S_i), C), F)`` (TRL's ``clip_min``)."""
    b = _Batch(trainer_logprobs, rollout_logprobs, mask, cu_seqlens)
    c = _cap(cap)
    f = _floor(floor, c)

    def compute(b):
        import torch

        with torch.no_grad():
            ps = torch.exp(_seq_sum(b))            # may be inf: min(inf, C) = C
        has = b.valid.any(dim=1)
        ws, clipped_seq = _clip(ps, c, f)
        clipped_seq = clipped_seq & has
        w = ws[:, None].expand_as(b.d)
        n_seq = max(int(has.sum()), 1)
        return w, b.valid, clipped_seq[:, None].expand_as(b.d), {"frac_seqs_clipped": int(clipped_seq.sum()) / n_seq}
    return _run("sequence_tis", b, compute, cap=c, params={"cap": c, "floor": f})


def geometric_mask(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, lo: float | None = None,
                   hi: float = 1.001) -> Correction:
    """Drop sequence i unless ``lo ≤ exp(S_i / L_i) ≤ hi`` (``lo`` defaults to 1/hi). Weights 1."""
    import torch

    b = _Batch(trainer_logprobs, rollout_logprobs, mask, cu_seqlens)
    llo, lhi = _bounds(lo, hi)

    def compute(b):
        n = b.valid.sum(dim=1)
        g = _seq_sum(b) / n.clamp(min=1)
        keep = ((g >= llo) & (g <= lhi))[:, None].expand_as(b.d)
        return _ones(b), keep, torch.zeros_like(b.valid), {}
    return _run("geometric_mask", b, compute, params=_ratio_bounds(lo, hi))


def product_mask(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, lo: float | None = None,
                 hi: float = 2.0) -> Correction:
    """Drop sequence i unless ``lo ≤ Π_t r_t ≤ hi`` (``lo`` defaults to 1/hi). Weights 1."""
    import torch

    b = _Batch(trainer_logprobs, rollout_logprobs, mask, cu_seqlens)
    llo, lhi = _bounds(lo, hi)

    def compute(b):
        s = _seq_sum(b)
        keep = ((s >= llo) & (s <= lhi))[:, None].expand_as(b.d)
        return _ones(b), keep, torch.zeros_like(b.valid), {}
    return _run("product_mask", b, compute, params=_ratio_bounds(lo, hi))


def outlier_veto(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, lo: float | None = 1e-4,
                 hi: float | None = None) -> Correction:
    """Drop the whole sequence if any valid token has ``r_t < lo`` or ``r_t > hi``.

    verl/slime's veto is the lower side only (default ``lo = 1e-4``); ``hi`` (off by default)
    adds the upper side. Weights 1.
    """
    import torch

    b = _Batch(trainer_logprobs, rollout_logprobs, mask, cu_seqlens)
    llo = _log_bound(lo, -math.inf)
    lhi = _log_bound(hi, math.inf)
    if llo > lhi:
        raise InputError(f"lower bound {lo!r} > upper bound {hi!r}", field="bounds")

    def compute(b):
        bad = ((b.d < llo) | (b.d > lhi)) & b.valid
        keep = (~bad.any(dim=1))[:, None].expand_as(b.d)
        return _ones(b), keep, torch.zeros_like(b.valid), \
            {"frac_tokens_outlier": int(bad.sum()) / max(int(b.valid.sum()), 1)}
    return _run("outlier_veto", b, compute, params={"lo": lo, "hi": hi})


def token_mask(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, lo: float | None = None,
               hi: float = 2.0) -> Correction:
    """Drop token t unless ``lo ≤ r_t ≤ hi`` (``lo`` defaults to 1/hi). Weights 1."""
    import torch

    b = _Batch(trainer_logprobs, rollout_logprobs, mask, cu_seqlens)
    llo, lhi = _bounds(lo, hi)

    def compute(b):
        keep = (b.d >= llo) & (b.d <= lhi)
        return _ones(b), keep, torch.zeros_like(b.valid), {}
    return _run("token_mask", b, compute, params=_ratio_bounds(lo, hi))


def masked_is(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, lo: float | None = None,
              hi: float = 2.0, cap: float | None = None) -> Correction:
    """Masked IS (MIS): ``w_t = min(r_t, C)`` (C defaults to hi) and keep t iff ``lo ≤ r_t ≤ hi``.

    Follows slime's MIS after PR #657 (design of verl #3915): the weight keeps the ratio, the
    rejection lives in the mask, so a rejected token leaves both numerator and denominator.
    """
    import torch

    b = _Batch(trainer_logprobs, rollout_logprobs, mask, cu_seqlens)
    llo, lhi = _bounds(lo, hi)
    if cap is not None:
        _log_bound(cap)
    c = float(hi if cap is None else cap)

    def compute(b):
        r = torch.exp(b.d)
        keep = (b.d >= llo) & (b.d <= lhi)
        return _capped(r, c), keep, (r > c) & keep, {}
    return _run("masked_is", b, compute, cap=c, params={**_ratio_bounds(lo, hi), "cap": c})


ORDERS = ("skyrl", "verl", "skyrl_exact", "trl")
DENOMINATORS = ("kept", "valid")


def combine(*corrections: Correction, order: str = "skyrl", denominator: str = "kept") -> Correction:
    """Chain corrections computed on the same batch: weights multiply, masks AND.

    ``order="skyrl"`` (default): SkyRL's pipeline. The parts run in the order veto
    (``outlier_veto``) → token mask (``token_mask``, ``masked_is``) → TIS (``token_tis``,
    ``sequence_tis``) → sequence mask (``geometric_mask``, ``product_mask``), parts of one stage
    in argument order, and each part is re-computed on the mask left by the previous ones: a
    sequence's S_i, L_i (sequence TIS, geometric/product masks) sum over its tokens that are
    still kept. Weights are 0 on tokens an earlier step removed.

    ``order="skyrl_exact"``: the same pipeline in SkyRL 0.4.0's own arithmetic
    (``compute_off_policy_correction``), bitwise: ``d = a − b`` and the sums ``Σ d·m`` in the
    input's dtype (m: the float32 loss mask so far), every ratio ``exp(clamp(float32(x), −20, 20))``
    cast back to the input's dtype — so ``|log r|`` above 20 gives ``e^±20``, where the other
    orders give the true ratio — bounds compared on ratios, ``min(r, C)`` in that dtype
    (``fp32(C)`` may lie above C). ``masked_is`` is SkyRL's token mask plus token TIS.

    ``order="verl"``: verl's rollout correction. Every part is computed on the original mask
    (as passed), then weights multiply and masks AND.

    ``order="trl"``: as "verl", each part in TRL 1.16's arithmetic (``correction_trl.py``:
    ``exp((a − b)·m)`` and ``Σ (a − b)·m`` in the input's dtype, ``clamp(r, F, C)``, bounds
    compared on ratios), bitwise equal to ``GRPOTrainer``'s ``importance_sampling_ratio``; the
    parts TRL has: ``token_tis``, ``sequence_tis``, ``masked_is``, ``token_mask``, ``product_mask``.

    ``denominator="kept"`` (default): ``mask`` is the tokens kept, so ``Σ mask`` counts only them.
    ``denominator="valid"`` (TRL's loss): weights are 0 on rejected tokens and ``mask`` is the input
    mask, so ``Σ loss_weights · ℓ / Σ mask`` keeps rejected tokens in the denominator; the metrics
    still count what was rejected.

    Metrics: the combined ones (same definitions; ``frac_tokens_clipped`` is left out) plus, but
    under "skyrl_exact", each part's metrics prefixed ``<name>/`` (under "skyrl", the re-computed
    part's).
    """
    import torch

    batch = _check_combine(corrections, order)
    if denominator not in DENOMINATORS:
        raise InputError(f"denominator {denominator!r}, expected one of {DENOMINATORS}", field="denominator")
    if order == "trl":
        w, keep, parts = _combine_trl(corrections, batch)
    elif order == "verl":
        parts = list(corrections)
        _, w, keep = parts[0]._state
        for c in parts[1:]:
            w, keep = w * c._state[1], keep & c._state[2]
    elif order == "skyrl":
        w, keep, parts = _combine_skyrl(corrections, batch)
    else:
        w, keep, parts = _combine_skyrl_exact(corrections, batch)
    metrics = _metrics(batch, w, keep, torch.zeros_like(keep))
    del metrics["frac_tokens_clipped"]
    metrics.update({f"{c.name}/{k}": v for c in parts for k, v in c.metrics.items()})
    name = "+".join(c.name for c in (parts or sorted(corrections, key=_stage)))
    if denominator == "valid":
        w = torch.where(keep, w, torch.zeros((), dtype=w.dtype, device=w.device))
        return Correction(name, batch.out(w), batch.out(batch.valid), metrics, _state=(batch, w, batch.valid))
    return Correction(name, batch.out(w), batch.out(keep), metrics, _state=(batch, w, keep))


def _stage(c: Correction) -> int:
    return _STAGE.get(c.name, 2)


def _check_combine(corrections, order) -> _Batch:
    """The batch the corrections share; InputError naming the first that does not fit."""
    import torch

    if order not in ORDERS:
        raise InputError(f"order {order!r}, expected one of {ORDERS}", field="order")
    if not corrections:
        raise InputError("combine() needs at least one Correction", field="corrections")
    for i, c in enumerate(corrections):
        if not isinstance(c, Correction) or c._state is None:
            raise InputError(f"expected a Correction, got {type(c).__name__}", field="corrections", index=i)
        if order == "trl" and c.name not in TRL_PARTS:
            raise InputError(f"{c.name} has no TRL 1.16 counterpart (order='trl' runs {sorted(TRL_PARTS)})",
                             field="corrections", index=i)
        if order == "skyrl_exact" and (c._params or {}).get("floor") is not None:
            raise InputError(f"{c.name}(floor=) has no SkyRL 0.4 counterpart (order='skyrl_exact')",
                             field="corrections", index=i)
        if order not in ("verl", "trl") and c._recipe is None:
            raise InputError(f"{c.name} cannot be re-run on a new mask (order={order!r})",
                             field="corrections", index=i)
    batch = corrections[0]._state[0]
    for i, c in enumerate(corrections[1:], 1):
        b2 = c._state[0]
        if b2.d.shape != batch.d.shape or not torch.equal(b2.valid, batch.valid) or not torch.equal(b2.d, batch.d):
            raise InputError("corrections were computed on different batches", field="corrections", index=i)
    return batch


def _combine_skyrl(corrections, batch):
    """Each part re-run on the mask the previous stages left (float64, log space)."""
    import torch

    keep = batch.valid
    w = torch.where(batch.valid, 1.0, 0.0).to(torch.float64)
    parts = []
    for c in sorted(corrections, key=_stage):
        part = _run(c.name, batch.restrict(keep), c._recipe)
        parts.append(part)
        _, pw, pk = part._state
        w, keep = w * pw, keep & pk
    return w, keep, parts


def _combine_trl(corrections, batch):
    """TRL's arithmetic (``TRL_PARTS``), every part on the input mask; weights multiply, masks AND."""
    import torch

    a, b = batch.padded_inputs()
    m = batch.valid.to(a.dtype)
    w, keep = torch.ones_like(a), batch.valid
    for c in corrections:
        pw, pk = TRL_PARTS[c.name](a, b, m, c._params)
        w = w * pw.expand_as(a)
        keep = keep & pk.expand_as(keep)
    return w.to(torch.float64), keep, []


def _combine_skyrl_exact(corrections, batch):
    """SkyRL's ``compute_off_policy_correction`` on the padded inputs (``SKYRL_PARTS``)."""
    import torch

    a, b = batch.padded_inputs()
    m = batch.valid.to(torch.float32)
    w = None
    for c in sorted(corrections, key=_stage):
        pw, pk = SKYRL_PARTS[c.name](a, b, m, c._params)
        if pk is not None:
            m = m * pk
        if pw is not None:
            w = pw if w is None else w * pw
    keep = m > 0
    w = torch.ones_like(batch.d) if w is None else w.to(torch.float64)
    return torch.where(keep, w, torch.zeros((), dtype=w.dtype, device=w.device)), keep, []
