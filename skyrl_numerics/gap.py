"""The gap tool: how far the trainer's token logprobs are from the rollout engine's.

``measure(trainer_logprobs, rollout_logprobs, mask=None)`` returns a :class:`GapReport`.
Notation, per masked token t (all sums/means over the N masked tokens, in float64):

* ``Δ = d = log π_train(y_t) − log π_rollout(y_t)``  (trainer minus rollout)
* ``r = exp(d) = π_train / π_rollout``: the importance ratio of a token sampled by the rollout
  engine (so every expectation below is an estimate under the rollout policy).

Report fields (README-ready copy with the same formulas: docs/gap.md):

=====================  =====================================================================
``mean_abs``           mean |d|
``max_abs``            max |d|
``p50_abs/p99_abs``    50th / 99th percentile of |d| (numpy ``method="linear"``)
``frac_bitwise_equal`` share of tokens whose two logprobs are exactly equal (value ``==`` in the
                       input dtypes; ±0 compare equal; bf16 is compared after its exact upcast)
``kl_k1``              mean(−d)          Schulman's k1 estimate of KL(π_rollout ‖ π_train)
``kl_k2``              mean(d²/2)        k2 (biased, low variance)
``kl_k3``              mean(r − 1 − d)   k3 (unbiased, ≥ 0 per token)
``chi2``               mean(r²) − 1      estimate of Pearson χ²(π_train ‖ π_rollout)
                       = E_rollout[r²] − 1 (verl's ``chi2_token``; can be < 0 in a sample)
``ppl_ratio``          PPL_train / PPL_rollout = exp(mean(−log π_train)) / exp(mean(−log π_rollout))
                       = exp(mean(−d)) = exp(k1), token level
``ess``                (Σr)² / (N·Σr²) ∈ (0, 1]: effective sample size of the importance
                       weights as a share of N (1 = no gap)
``ratio_*``            mean, std (population, ddof=0), min, max, p1, p99 of r
``extreme_frac[τ]``    F(τ) = share of tokens with max(r, 1/r) > τ, i.e. |d| > ln τ
``position_*``         mean |d| at response position p (p-th masked token of its sequence)
                       and the number of tokens at p
``seq_*``              per sequence: length, mean |d|, max |d|, log ratio Σd (= log Π r),
                       geometric-mean ratio exp(mean d). NaN for sequences with no tokens.
=====================  =====================================================================

Inputs (torch or numpy, any float dtype incl. bf16): padded ``[B, T]`` with optional ``mask``
(bool or 0/1, ``[B, T]``); a list/tuple of 1-D sequences (optional list of 1-D masks); or flat
1-D with ``cu_seqlens=`` (``[B+1]``, optional 1-D mask). Masked-out entries are never read for
validation. Bad data raises :class:`~skyrl_numerics.errors.InputError` naming row, field and
index: non-finite values, logprobs > ``logprob_tol`` (default 1e-6: log-softmax in fp32 can
round a probability-1 token a few ulps above 0; anything larger is not a logprob), length or
shape mismatch, empty input.

Speed: inputs of more than ``FAST_MIN_TOKENS`` tokens take a chunked single pass
(cache-sized pieces of whole sequences; exp only on the few tokens with |d| > T, T ≤ 0.0125 —
the rest use a Taylor series of e^d of order 4–6 chosen from T so the truncation error is below
1e-13 relative; exact percentiles by bracketing
from a sample and partitioning only the bracket). :func:`measure_reference` is the plain
full-array computation that is the spec; tests hold the fast pass to it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

import numpy as np

from skyrl_numerics._gap_layout import Tokens, find_bad_value, normalize
from skyrl_numerics.errors import InputError

__all__ = ["GapReport", "measure", "measure_reference", "DEFAULT_TAUS", "LOGPROB_TOL"]

DEFAULT_TAUS = (1.5, 2.0, 5.0)
LOGPROB_TOL = 1e-6
FAST_MIN_TOKENS = 1 << 18
_CHUNK = 1 << 16          # tokens per piece: a few float64 buffers fit in L2
_TAYLOR_MAX = 0.0125      # |d| above this: exact expm1; below: Taylor series to d^K
_TAYLOR_ERR = 1e-13       # K is the smallest order whose truncation bound 2 T^(K-1)/(K+1)! is below this
_SAMPLE = 1 << 16         # tokens sampled (in 128 runs of 512) to place the percentile brackets
_DOT = 8192               # dot-product block
_LONG = 2048              # chunks of sequences at least this long add per-position sums by slices

SUMMARY_KEYS = ("n_tokens", "n_seqs", "mean_abs", "max_abs", "p50_abs", "p99_abs",
                "frac_bitwise_equal", "kl_k1", "kl_k2", "kl_k3", "chi2", "ppl_ratio", "ess",
                "ratio_mean", "ratio_std", "ratio_min", "ratio_max", "ratio_p1", "ratio_p99")


def _tau_key(tau: float) -> str:
    return f"F_{tau:g}"


def _json_float(x):
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass
class GapReport:
    """Result of :func:`measure`. Scalars are Python floats, curves numpy arrays."""

    n_tokens: int
    n_seqs: int
    mean_abs: float
    max_abs: float
    p50_abs: float
    p99_abs: float
    frac_bitwise_equal: float
    kl_k1: float
    kl_k2: float
    kl_k3: float
    chi2: float
    ppl_ratio: float
    ess: float
    ratio_mean: float
    ratio_std: float
    ratio_min: float
    ratio_max: float
    ratio_p1: float
    ratio_p99: float
    extreme_frac: dict = field(default_factory=dict)          # {tau: F(tau)}
    position_mean_abs: np.ndarray = field(default_factory=lambda: np.zeros(0))
    position_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    seq_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    seq_mean_abs: np.ndarray = field(default_factory=lambda: np.zeros(0))
    seq_max_abs: np.ndarray = field(default_factory=lambda: np.zeros(0))
    seq_log_ratio: np.ndarray = field(default_factory=lambda: np.zeros(0))
    seq_geo_ratio: np.ndarray = field(default_factory=lambda: np.zeros(0))
    dtypes: tuple = ("", "")

    def summary(self) -> dict:
        """Flat dict of the headline scalars: ``SUMMARY_KEYS`` then ``F_<tau>`` per τ."""
        out = {k: getattr(self, k) for k in SUMMARY_KEYS}
        out.update({_tau_key(t): f for t, f in self.extreme_frac.items()})
        return out

    def to_dict(self) -> dict:
        """JSON-serializable dict (non-finite floats become ``None``)."""
        s = {k: (v if isinstance(v, int) else _json_float(v)) for k, v in self.summary().items()}
        return {
            "summary": s,
            "taus": [float(t) for t in self.extreme_frac],
            "dtypes": {"trainer": self.dtypes[0], "rollout": self.dtypes[1]},
            "per_position": {"mean_abs": [_json_float(x) for x in self.position_mean_abs],
                             "count": [int(x) for x in self.position_count]},
            "per_sequence": {
                "len": [int(x) for x in self.seq_len],
                "mean_abs": [_json_float(x) for x in self.seq_mean_abs],
                "max_abs": [_json_float(x) for x in self.seq_max_abs],
                "log_ratio": [_json_float(x) for x in self.seq_log_ratio],
                "geo_ratio": [_json_float(x) for x in self.seq_geo_ratio],
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> "GapReport":
        """Inverse of :meth:`to_dict` (``None`` reads back as NaN)."""
        s = d["summary"]

        def f(x):
            return float("nan") if x is None else float(x)

        def arr(xs, dtype=np.float64):
            return np.array([np.nan if x is None else x for x in xs], dtype=dtype)

        kw = {k: (int(s[k]) if k in ("n_tokens", "n_seqs") else f(s[k])) for k in SUMMARY_KEYS}
        taus = [float(t) for t in d["taus"]]
        pp, ps = d["per_position"], d["per_sequence"]
        return cls(**kw, extreme_frac={t: f(s[_tau_key(t)]) for t in taus},
                   position_mean_abs=arr(pp["mean_abs"]), position_count=arr(pp["count"], np.int64),
                   seq_len=arr(ps["len"], np.int64), seq_mean_abs=arr(ps["mean_abs"]),
                   seq_max_abs=arr(ps["max_abs"]), seq_log_ratio=arr(ps["log_ratio"]),
                   seq_geo_ratio=arr(ps["geo_ratio"]),
                   dtypes=(d["dtypes"]["trainer"], d["dtypes"]["rollout"]))

    def __eq__(self, other):  # arrays and NaN-aware
        if not isinstance(other, GapReport):
            return NotImplemented
        for fl in fields(self):
            x, y = getattr(self, fl.name), getattr(other, fl.name)
            if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
                if not np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True):
                    return False
            elif isinstance(x, dict):
                if list(x) != list(y) or not all(_same(x[k], y[k]) for k in x):
                    return False
            elif not _same(x, y):
                return False
        return True


def _same(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return x == y


# -- percentiles (numpy's "linear" method, bit for bit) ----------------------------------------
def _q_index(n: int, q: float) -> tuple[int, int, float]:
    h = (n - 1) * np.float64(q)
    lo = int(math.floor(h))
    return lo, min(lo + 1, n - 1), float(h - lo)


def _lerp(a: float, b: float, t: float) -> float:
    diff = b - a
    return float(b - diff * (1 - t)) if t >= 0.5 else float(a + diff * t)


# -- shared tail: formulas from sufficient statistics -----------------------------------------
def _finish(st: dict, tok: Tokens, taus) -> GapReport:
    n = st["n"]
    u1, u2 = st["u1"], st["u2"]
    ratio_mean = 1.0 + u1 / n
    chi2 = st.get("chi2")
    if chi2 is None:
        chi2 = (2.0 * u1 + u2) / n                   # mean((1+u)^2) - 1
    ess = st.get("ess")
    if ess is None:
        ess = ratio_mean * ratio_mean / (1.0 + chi2)   # (Σr)² / (N Σr²)
    ratio_std = st.get("ratio_std")
    if ratio_std is None:
        ratio_std = math.sqrt(max(u2 / n - (u1 / n) ** 2, 0.0))
    lengths = tok.lengths
    with np.errstate(invalid="ignore", divide="ignore"):
        seq_mean_abs = np.where(lengths > 0, st["seq_sum_abs"] / lengths, np.nan)
        seq_geo = np.where(lengths > 0, np.exp(st["seq_sum_d"] / np.maximum(lengths, 1)), np.nan)
    seq_max = np.where(lengths > 0, st["seq_max_abs"], np.nan)
    pos_cnt = st["pos_cnt"]
    return GapReport(
        n_tokens=int(n), n_seqs=int(tok.n_seqs),
        mean_abs=float(st["sum_abs"] / n), max_abs=float(st["max_abs"]),
        p50_abs=float(st["p50_abs"]), p99_abs=float(st["p99_abs"]),
        frac_bitwise_equal=float(st["n_eq"] / n),
        kl_k1=float(-st["s1"] / n), kl_k2=float(st["s2"] / (2 * n)), kl_k3=float(st["k3"] / n),
        chi2=float(chi2), ppl_ratio=float(math.exp(-st["s1"] / n)), ess=float(ess),
        ratio_mean=float(ratio_mean), ratio_std=float(ratio_std),
        ratio_min=float(math.exp(st["d_min"])), ratio_max=float(math.exp(st["d_max"])),
        ratio_p1=float(st["ratio_p1"]), ratio_p99=float(st["ratio_p99"]),
        extreme_frac={float(t): float(c / n) for t, c in zip(taus, st["n_extreme"])},
        position_mean_abs=st["pos_sum"] / np.maximum(pos_cnt, 1), position_count=pos_cnt,
        seq_len=lengths.copy(), seq_mean_abs=seq_mean_abs, seq_max_abs=seq_max,
        seq_log_ratio=np.where(lengths > 0, st["seq_sum_d"], 0.0).astype(np.float64), seq_geo_ratio=seq_geo,
        dtypes=tuple(tok.dtypes),
    )


def _position_count(lengths: np.ndarray) -> np.ndarray:
    """count[p] = number of sequences with more than p tokens."""
    maxlen = int(lengths.max()) if lengths.size else 0
    hist = np.bincount(lengths, minlength=maxlen + 1)
    return (lengths.size - np.cumsum(hist))[:maxlen].astype(np.int64)


def _check_taus(taus) -> tuple:
    taus = tuple(float(t) for t in taus)
    for i, t in enumerate(taus):
        if not (t >= 1.0 and math.isfinite(t)):
            raise InputError(f"tau {t!r}, expected a finite value >= 1", field="taus", index=i)
    return taus


def _validate_flat(tok: Tokens, a: np.ndarray, b: np.ndarray, tol: float) -> None:
    for x in (a, b):
        if not (np.isfinite(x).all() and (x.size == 0 or x.max() <= tol)):
            find_bad_value(tok, tol)


# -- the reference: plain full-array numpy, the spec ------------------------------------------
def _reference_stats(tok: Tokens, taus, tol: float) -> dict:
    a, b = tok.flat()
    _validate_flat(tok, a, b, tol)
    d = a.astype(np.float64) - b.astype(np.float64)
    if not np.isfinite(d).all():
        raise InputError("difference trainer - rollout overflows float64", field="rollout_logprobs")
    n = d.size
    absd = np.abs(d)
    u = np.expm1(d)                       # r - 1, exact for small d
    r = np.exp(d)
    lengths, cu = tok.lengths, tok.cu
    ne = lengths > 0
    st_idx = cu[:-1][ne]
    seq_sum_abs = np.zeros(tok.n_seqs)
    seq_max_abs = np.zeros(tok.n_seqs)
    seq_sum_d = np.zeros(tok.n_seqs)
    seq_sum_abs[ne] = np.add.reduceat(absd, st_idx)
    seq_max_abs[ne] = np.maximum.reduceat(absd, st_idx)
    seq_sum_d[ne] = np.add.reduceat(d, st_idx)
    pos = np.arange(n) - np.repeat(cu[:-1], lengths)
    pos_cnt = _position_count(lengths)
    # ESS = (Σr)²/(N Σr²), shifted by max d so it cannot overflow
    w = np.exp(d - d.max())
    with np.errstate(over="ignore", invalid="ignore"):   # r, r² may overflow: report inf
        chi2_terms = np.expm1(2 * d)
        u2 = (u * u).sum()
        ratio_std = float(np.std(r))
    return {
        "n": n, "sum_abs": absd.sum(), "max_abs": absd.max(),
        "p50_abs": np.quantile(absd, 0.5), "p99_abs": np.quantile(absd, 0.99),
        "ratio_p1": np.quantile(r, 0.01), "ratio_p99": np.quantile(r, 0.99),
        "n_eq": int(np.count_nonzero(a == b)),
        "s1": d.sum(), "s2": (d * d).sum(), "k3": (u - d).sum(),
        "u1": u.sum(), "u2": u2, "chi2": chi2_terms.mean(),
        "ess": w.sum() ** 2 / (n * (w * w).sum()), "ratio_std": ratio_std,
        "d_min": d.min(), "d_max": d.max(),
        "n_extreme": [int(np.count_nonzero(absd > math.log(t))) for t in taus],
        "pos_sum": np.bincount(pos, weights=absd, minlength=pos_cnt.size), "pos_cnt": pos_cnt,
        "seq_sum_abs": seq_sum_abs, "seq_max_abs": seq_max_abs, "seq_sum_d": seq_sum_d,
    }


# -- the fast pass ----------------------------------------------------------------------------
def _margin(q: float, s: int) -> float:
    """Bracket half-width around quantile q for a sample of s: 5 standard errors (+2/s)."""
    return 5.0 * math.sqrt(q * (1 - q) / s) + 2.0 / s


def _brackets(tok: Tokens, taus):
    """From a sample: the tail threshold T and the median bracket [med_lo, med_hi] of |d|."""
    sa, sb = tok.sample(_SAMPLE)
    sd = sa - sb
    sd = sd[np.isfinite(sd)]
    if sd.size < 64:
        return None
    s_abs, ss = np.abs(sd), sd.size

    def quantiles(x, qs):           # nearest-rank, one partition: only brackets, need not be exact
        ks = [min(max(int(round(q * (x.size - 1))), 0), x.size - 1) for q in qs]
        part = np.partition(x, ks)
        return [float(part[k]) for k in ks]

    m99, m50 = _margin(0.99, ss), _margin(0.5, ss)
    a99, med_lo, med_hi = quantiles(s_abs, [0.99 - m99, 0.5 - m50, 0.5 + m50])
    d1, d99 = quantiles(sd, [0.01 + m99, 0.99 - m99])
    # every token beyond the p99 of |d|, beyond the p99 of d and below the p1 of d is "tail"
    T = min(_TAYLOR_MAX, a99, max(0.0, d99), max(0.0, -d1), *(math.log(t) for t in taus))
    return T, med_lo, med_hi, (med_hi > 0.0 and med_lo <= T)


def _taylor_order(T: float) -> int:
    """Smallest K in 4..6 with relative truncation error 2·T^(K−1)/(K+1)! < ``_TAYLOR_ERR`` for
    Σ(e^d − 1 − d) (the term that needs most care: it starts at d²/2) over |d| <= T."""
    for K in (4, 5):
        if 2.0 * T ** (K - 1) / math.factorial(K + 1) < _TAYLOR_ERR:
            return K
    return 6


def _power_sums(d, d2, d4, p, K) -> None:
    """p[3..K] += Σ d³ … d^K as dot products in blocks of ``_DOT``.

    Each block is a separate BLAS ddot short enough for OpenBLAS to run it on the calling
    thread (it spawns threads above 10,000 elements, which stalls badly on a busy machine).
    """
    pairs = [(3, d2, d), (4, d2, d2), (5, d4, d), (6, d4, d2)][:K - 2]
    k = d.size
    m = k // _DOT * _DOT
    if m and hasattr(np, "vecdot"):
        for i, x, y in pairs:
            p[i] += float(np.vecdot(x[:m].reshape(-1, _DOT), y[:m].reshape(-1, _DOT)).sum())
    else:
        m = 0
    for s0 in range(m, k, _DOT):
        s1 = s0 + _DOT
        for i, x, y in pairs:
            p[i] += float(np.dot(x[s0:s1], y[s0:s1]))


def _scan(tok: Tokens, plan, T, med_lo, med_hi, use_med, out, offsets, maxlen) -> dict:  # noqa: C901
    """One pass over the row ranges in ``plan``. Per-sequence results go straight into
    ``out`` (disjoint rows per caller); token totals come back as a dict. Row i's tokens sit at
    response positions ``offsets[i]...`` (non-zero for the later pieces of a split sequence)."""
    cu, lengths = tok.cu, tok.lengths
    seq_sum_abs, seq_max_abs, seq_sum_d = out
    big = max(int(cu[r1] - cu[r0]) for r0, r1 in plan)
    D, AD, D2, D4 = (np.empty(big) for _ in range(4))
    TB, TB2 = np.empty(big, bool), np.empty(big, bool)
    POS = np.empty(big, np.int64)
    pos_sum = np.zeros(maxlen)
    mx_a = mx_b = -math.inf
    nnz = below = 0
    p = [0.0] * 7                         # p[k] = Σ d^k over tokens with |d| <= T
    K = _taylor_order(T)
    tails, meds = [], []
    for r0, r1 in plan:
        ca, cb = tok.chunk(r0, r1)
        k = ca.size
        d, ad, d2, d4, tb, tb2 = D[:k], AD[:k], D2[:k], D4[:k], TB[:k], TB2[:k]
        np.subtract(ca, cb, out=d, dtype=np.float64)
        np.abs(d, out=ad)
        mx_a, mx_b = max(mx_a, ca.max()), max(mx_b, cb.max())
        np.greater(ad, 0.0, out=tb)
        nnz += np.count_nonzero(tb)
        lens = lengths[r0:r1]
        starts = cu[r0:r1] - cu[r0]
        offs = offsets[r0:r1]
        rows = slice(r0, r1)
        if lens.min() == 0:
            nz = lens > 0
            lens, starts, offs, rows = lens[nz], starts[nz], offs[nz], np.arange(r0, r1)[nz]
        seq_sum_abs[rows] = np.add.reduceat(ad, starts)
        seq_max_abs[rows] = np.maximum.reduceat(ad, starts)
        seq_sum_d[rows] = np.add.reduceat(d, starts)
        o0 = int(offs[0])
        if lens.min() == lens.max() and offs.min() == offs.max():
            L = int(lens[0])
            pos_sum[o0:o0 + L] += ad.reshape(-1, L).sum(axis=0)
        elif lens.min() >= _LONG:         # few long sequences: add each as a slice
            for s0, L, o in zip(starts.tolist(), lens.tolist(), offs.tolist()):
                pos_sum[o:o + L] += ad[s0:s0 + L]
        else:                             # position in sequence: cumsum of 1s, reset at starts
            pos = POS[:k]
            pos.fill(1)
            pos[starts[1:]] = offs[1:] - (offs[:-1] + lens[:-1] - 1)
            pos[0] = o0
            np.cumsum(pos, out=pos)
            part = np.bincount(pos, weights=ad)
            pos_sum[:part.size] += part
        if use_med:
            np.less(ad, med_lo, out=tb)
            below += np.count_nonzero(tb)
            np.less_equal(ad, med_hi, out=tb2)
            np.logical_xor(tb, tb2, out=tb2)
            if tb2.any():
                meds.append(ad.take(np.flatnonzero(tb2)))
        np.greater(ad, T, out=tb)
        if tb.any():
            idx = np.flatnonzero(tb)
            tails.append(d.take(idx))
            d[idx] = 0.0
        p[1] += d.sum()
        np.multiply(d, d, out=d2)
        p[2] += d2.sum()
        if K > 4:
            np.multiply(d2, d2, out=d4)
        _power_sums(d, d2, d4, p, K)
    return dict(p=p, nnz=nnz, below=below, mx_a=mx_a, mx_b=mx_b, tails=tails, meds=meds, pos_sum=pos_sum)


def _split_long(tok: Tokens, chunk: int):
    """Flat input with sequences longer than ``chunk``: a view whose rows are pieces of at most
    ``chunk`` tokens (so buffers stay cache-sized), the position offset of each piece, and the
    index of the first piece of every non-empty sequence. Otherwise ``(tok, zeros, None)``."""
    lengths = tok.lengths
    if tok.mask2d is not None or lengths.max() <= chunk:
        return tok, np.zeros(tok.n_seqs, np.int64), None
    ne = lengths[lengths > 0]
    npieces = -(-ne // chunk)
    first = np.concatenate([[0], np.cumsum(npieces)[:-1]])
    piece = np.arange(int(npieces.sum())) - np.repeat(first, npieces)     # piece index within its seq
    offsets = piece * chunk
    plen = np.minimum(np.repeat(ne, npieces) - offsets, chunk)
    return Tokens(tok.a, tok.b, plen, dtypes=tok.dtypes), offsets.astype(np.int64), first


def _threads(n_tokens: int, threads: int | None) -> int:
    if threads is not None:
        return max(1, int(threads))
    return max(1, min(os.cpu_count() or 1, 8, n_tokens // (4 * _CHUNK)))


def _fast_stats(tok: Tokens, taus, tol: float, chunk: int = _CHUNK, threads: int | None = 1):
    """Same dict as :func:`_reference_stats` in one chunked pass; ``None`` if a percentile
    bracket missed or a ratio overflows (the caller then runs the reference).

    ``threads`` > 1 splits the chunks into that many contiguous runs scanned in parallel (numpy
    releases the GIL in its loops); partial results are combined in run order.
    """
    n = tok.n
    br = _brackets(tok, taus)
    if br is None:
        return None
    T, med_lo, med_hi, use_med = br
    vtok, offsets, first = _split_long(tok, chunk)
    plan = vtok.plan(chunk)
    seq_sum_abs = np.zeros(vtok.n_seqs)
    seq_max_abs = np.zeros(vtok.n_seqs)
    seq_sum_d = np.zeros(vtok.n_seqs)
    out = (seq_sum_abs, seq_max_abs, seq_sum_d)
    maxlen = int(tok.lengths.max())
    nt = min(threads, len(plan))
    if nt <= 1:
        parts = [_scan(vtok, plan, T, med_lo, med_hi, use_med, out, offsets, maxlen)]
    else:
        from concurrent.futures import ThreadPoolExecutor

        runs = [plan[i * len(plan) // nt:(i + 1) * len(plan) // nt] for i in range(nt)]
        with ThreadPoolExecutor(nt) as ex:
            parts = list(ex.map(lambda run: _scan(vtok, run, T, med_lo, med_hi, use_med, out, offsets, maxlen),
                                runs))
    if first is not None:                 # pieces of split sequences back into whole sequences
        ne = tok.lengths > 0
        real = [np.zeros(tok.n_seqs) for _ in range(3)]
        real[0][ne] = np.add.reduceat(seq_sum_abs, first)
        real[1][ne] = np.maximum.reduceat(seq_max_abs, first)
        real[2][ne] = np.add.reduceat(seq_sum_d, first)
        seq_sum_abs, seq_max_abs, seq_sum_d = real
    pos_cnt = _position_count(tok.lengths)
    pos_sum = parts[0]["pos_sum"]
    for q in parts[1:]:
        pos_sum = pos_sum + q["pos_sum"]
    p = [math.fsum(q["p"][i] for q in parts) if len(parts) > 1 else parts[0]["p"][i] for i in range(7)]
    nnz = sum(q["nnz"] for q in parts)
    below = sum(q["below"] for q in parts)
    mx_a, mx_b = max(q["mx_a"] for q in parts), max(q["mx_b"] for q in parts)
    tails = [t for q in parts for t in q["tails"]]
    meds = [m for q in parts for m in q["meds"]]

    sum_abs = float(seq_sum_abs.sum())
    if not (mx_a <= tol and mx_b <= tol and math.isfinite(sum_abs)):
        find_bad_value(tok, tol)
        raise InputError("difference trainer - rollout overflows float64", field="rollout_logprobs")
    tv = np.concatenate(tails) if tails else np.zeros(0)
    if tv.size and tv.max() > 300.0:      # r or r² would overflow: let the reference handle it
        return None
    ut = np.expm1(tv)
    # Taylor: u = e^d - 1 = Σ_{k>=1} d^k/k!,  u - d = Σ_{k>=2},  u² = Σ_{k>=2} (2^k - 2) d^k / k!
    f = [1.0, 1.0, 2.0, 6.0, 24.0, 120.0, 720.0]
    k3_small = sum(p[k] / f[k] for k in range(2, 7))            # p[k] = 0 above the order used
    u2_small = sum(p[k] * (2.0 ** k - 2.0) / f[k] for k in range(2, 7))
    n_tail = tv.size

    # exact order statistics
    n_zero = n - nnz
    atv = np.abs(tv)
    neg, pos_t = tv[tv < 0], tv[tv > 0]
    # min/max of d: in the tails when there are any on that side; else every |d| <= T
    if neg.size:
        d_min = float(neg.min())
    elif T == 0.0 or n_zero == n:
        d_min = 0.0 if n_zero else float(pos_t.min())
    else:
        return None
    if pos_t.size:
        d_max = float(pos_t.max())
    elif T == 0.0 or n_zero == n:
        d_max = 0.0 if n_zero else float(neg.max())
    else:
        return None
    mv = np.concatenate(meds) if meds else np.zeros(0)

    def stat_abs(ranks):
        out, need_t, need_m = {}, [], []
        for k in ranks:
            if k < n_zero:
                out[k] = 0.0
            elif k >= n - n_tail:
                need_t.append(k - (n - n_tail))
            elif use_med and below <= k < below + mv.size:
                need_m.append(k - below)
            else:
                return None
        if need_t:
            part = np.partition(atv, need_t)
            out.update({k + (n - n_tail): float(part[k]) for k in need_t})
        if need_m:
            part = np.partition(mv, need_m)
            out.update({k + below: float(part[k]) for k in need_m})
        return out

    def stat_d(ranks):
        out, need_n, need_p = {}, [], []
        for k in ranks:
            if k < neg.size:
                need_n.append(k)
            elif k >= n - pos_t.size:
                need_p.append(k - (n - pos_t.size))
            elif T == 0.0:
                out[k] = 0.0
            else:
                return None
        if need_n:
            part = np.partition(neg, need_n)
            out.update({k: float(part[k]) for k in need_n})
        if need_p:
            part = np.partition(pos_t, need_p)
            out.update({k + (n - pos_t.size): float(part[k]) for k in need_p})
        return out

    u1 = p[1] + k3_small + float(ut.sum())
    u2 = u2_small + float((ut * ut).sum())      # (not np.dot: long BLAS dots spawn threads)
    # std(r)² = E[u²] - E[u]² cancels when the ratios sit far from 1 relative to their spread
    # (a systematic bias): past a 1000x loss of digits let the reference do it (two-pass std).
    if (u1 / n) ** 2 > (1 - 1e-3) * (u2 / n):
        return None
    qa = [_q_index(n, 0.5), _q_index(n, 0.99)]
    qd = [_q_index(n, 0.01), _q_index(n, 0.99)]
    sa_ = stat_abs(sorted({i for lo, hi, _ in qa for i in (lo, hi)}))
    sd_ = stat_d(sorted({i for lo, hi, _ in qd for i in (lo, hi)}))
    if sa_ is None or sd_ is None:
        return None
    p50, p99 = (_lerp(sa_[lo], sa_[hi], g) for lo, hi, g in qa)
    r1_, r99 = (_lerp(math.exp(sd_[lo]), math.exp(sd_[hi]), g) for lo, hi, g in qd)
    return {
        "n": n, "sum_abs": sum_abs, "max_abs": max(d_max, -d_min),
        "p50_abs": p50, "p99_abs": p99, "ratio_p1": r1_, "ratio_p99": r99,
        "n_eq": n_zero, "s1": float(seq_sum_d.sum()), "s2": p[2] + float((tv * tv).sum()),
        "k3": k3_small + float((ut - tv).sum()),
        "u1": u1, "u2": u2,
        "d_min": d_min, "d_max": d_max,
        "n_extreme": [int(np.count_nonzero(atv > math.log(t))) for t in taus],
        "pos_sum": pos_sum, "pos_cnt": pos_cnt,
        "seq_sum_abs": seq_sum_abs, "seq_max_abs": seq_max_abs, "seq_sum_d": seq_sum_d,
    }


# -- public -----------------------------------------------------------------------------------
def measure(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, taus=DEFAULT_TAUS,
            logprob_tol: float = LOGPROB_TOL, threads: int | None = None, _path: str = "auto") -> GapReport:
    """Measure the trainer–rollout logprob gap over the masked tokens. See the module doc.

    ``threads``: CPU threads for the fast pass (default: up to 8, one per 256K tokens, at most
    ``os.cpu_count()``). ``_path`` (testing): ``"auto"`` (fast pass above ``FAST_MIN_TOKENS``
    tokens), ``"fast"``, ``"reference"``.
    """
    taus = _check_taus(taus)
    tok = normalize(trainer_logprobs, rollout_logprobs, mask, cu_seqlens)
    st = None
    if _path == "fast" or (_path == "auto" and tok.n > FAST_MIN_TOKENS):
        st = _fast_stats(tok, taus, logprob_tol, threads=_threads(tok.n, threads))
    if st is None:
        st = _reference_stats(tok, taus, logprob_tol)
    return _finish(st, tok, taus)


def measure_reference(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None,
                      taus=DEFAULT_TAUS, logprob_tol: float = LOGPROB_TOL, threads=None) -> GapReport:
    """:func:`measure` through the plain full-array path (the spec the fast pass is tested against)."""
    return measure(trainer_logprobs, rollout_logprobs, mask, cu_seqlens=cu_seqlens, taus=taus,
                   logprob_tol=logprob_tol, _path="reference")
