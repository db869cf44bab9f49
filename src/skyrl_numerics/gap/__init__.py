"""The gap tool: how far the trainer's token logprobs are from the rollout engine's.

``measure(trainer_logprobs, rollout_logprobs, mask=None)`` returns a :class:`GapReport`.
Notation, per masked token t (all sums/means over the N masked tokens, in float64):

* ``Δ = d = log π_train(y_t) − log π_rollout(y_t)``  (trainer minus rollout)
* ``r = exp(d) = π_train / π_rollout``: the importance ratio of a token sampled by the rollout
  engine (so every expectation below is an estimate under the rollout policy).

Report fields (the same formulas, with tables: docs/gap.md):

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
``per_turn``           with ``turns=`` (a per-token turn index): one row per turn index present
                       among the masked tokens, the scalars above over that turn's tokens only
                       (:mod:`skyrl_numerics.gap.turns`); summary keys ``turn_<k>/<key>``
=====================  =====================================================================

Inputs (torch or numpy, any float dtype incl. bf16): padded ``[B, T]`` with optional ``mask``
(bool or 0/1, ``[B, T]``); a list/tuple of 1-D sequences (optional list of 1-D masks); or flat
1-D with ``cu_seqlens=`` (``[B+1]``, optional 1-D mask). Masked-out entries are never read for
validation. Bad data raises :class:`~skyrl_numerics.errors.InputError` naming row, field and
index: non-finite values, logprobs > ``logprob_tol`` (default 1e-6: log-softmax in fp32 can
round a probability-1 token a few ulps above 0; anything larger is not a logprob), length or
shape mismatch, empty input.

Speed: inputs of more than ``FAST_MIN_TOKENS`` tokens take the chunked single pass of
:mod:`skyrl_numerics.gap.fast` (threads, Taylor series instead of exp on all but the tail,
exact percentiles by bracketing). Its scan is compiled with numba (cached on disk) and has a
numpy fallback giving the same bits (``SKYRL_NUMERICS_NUMBA=0``, or when numba is missing).
:func:`measure_reference` is the plain full-array computation that is the spec; tests hold the
fast pass to it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from skyrl_numerics.gap.fast import fast_stats, scan_threads
from skyrl_numerics.gap.layout import Tokens, find_bad_value, normalize, position_count
from skyrl_numerics.gap.turns import turn_groups, turn_stream
from skyrl_numerics.errors import InputError

__all__ = ["GapReport", "measure", "measure_reference", "DEFAULT_TAUS", "LOGPROB_TOL"]

DEFAULT_TAUS = (1.5, 2.0, 5.0)
LOGPROB_TOL = 1e-6
FAST_MIN_TOKENS = 1 << 18

SUMMARY_KEYS = ("n_tokens", "n_seqs", "mean_abs", "max_abs", "p50_abs", "p99_abs",
                "frac_bitwise_equal", "kl_k1", "kl_k2", "kl_k3", "chi2", "ppl_ratio", "ess",
                "ratio_mean", "ratio_std", "ratio_min", "ratio_max", "ratio_p1", "ratio_p99")
# per-turn keys in summary() (``turn_<k>/<key>``, then ``turn_<k>/F_<tau>``); a per-turn row
# (``per_turn``, ``to_dict()["per_turn"]``) holds "turn" and every summary key
TURN_SUMMARY_KEYS = ("n_tokens", "mean_abs", "max_abs", "frac_bitwise_equal", "kl_k1", "kl_k2", "kl_k3")
_INT_KEYS = ("turn", "n_tokens", "n_seqs")


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
    # with measure(turns=...): one dict per turn index present, ascending: "turn", then the
    # summary() keys over that turn's tokens ("n_seqs": sequences with a token of the turn)
    per_turn: list = field(default_factory=list)

    def summary(self) -> dict:
        """Flat dict of the headline scalars: ``SUMMARY_KEYS`` then ``F_<tau>`` per τ; with
        per-turn rows, then ``turn_<k>/<key>`` for ``TURN_SUMMARY_KEYS`` and ``F_<tau>``."""
        out = {k: getattr(self, k) for k in SUMMARY_KEYS}
        out.update({_tau_key(t): f for t, f in self.extreme_frac.items()})
        for row in self.per_turn:
            keys = TURN_SUMMARY_KEYS + tuple(_tau_key(t) for t in self.extreme_frac)
            out.update({f"turn_{row['turn']}/{k}": row[k] for k in keys})
        return out

    def to_dict(self) -> dict:
        """JSON-serializable dict (non-finite floats become ``None``)."""
        s = {k: (v if isinstance(v, int) else _json_float(v)) for k, v in self.summary().items()}
        out = {
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
        if self.per_turn:
            out["per_turn"] = [{k: (int(v) if k in _INT_KEYS else _json_float(v)) for k, v in row.items()}
                               for row in self.per_turn]
        return out

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
                   dtypes=(d["dtypes"]["trainer"], d["dtypes"]["rollout"]),
                   per_turn=[{k: (int(v) if k in _INT_KEYS else f(v)) for k, v in row.items()}
                             for row in d.get("per_turn", [])])

    def __eq__(self, other):  # arrays and NaN-aware
        if not isinstance(other, GapReport):
            return NotImplemented
        for fl in fields(self):
            x, y = getattr(self, fl.name), getattr(other, fl.name)
            if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
                if not np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True):
                    return False
            elif isinstance(x, dict):
                if not _same_dict(x, y):
                    return False
            elif isinstance(x, list):
                if len(x) != len(y) or not all(_same_dict(u, v) for u, v in zip(x, y)):
                    return False
            elif not _same(x, y):
                return False
        return True


def _same_dict(x: dict, y: dict) -> bool:
    return list(x) == list(y) and all(_same(x[k], y[k]) for k in x)


def _same(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return x == y


# -- shared tail: formulas from sufficient statistics -----------------------------------------
def _exp(x: float) -> float:
    """``math.exp`` that reports ``inf`` where the result overflows (a gap above ~709 nats)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


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
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):   # (inf: reported)
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
        chi2=float(chi2), ppl_ratio=float(_exp(-st["s1"] / n)), ess=float(ess),
        ratio_mean=float(ratio_mean), ratio_std=float(ratio_std),
        ratio_min=float(_exp(st["d_min"])), ratio_max=float(_exp(st["d_max"])),
        ratio_p1=float(st["ratio_p1"]), ratio_p99=float(st["ratio_p99"]),
        extreme_frac={float(t): float(c / n) for t, c in zip(taus, st["n_extreme"])},
        position_mean_abs=st["pos_sum"] / np.maximum(pos_cnt, 1), position_count=pos_cnt,
        seq_len=lengths.copy(), seq_mean_abs=seq_mean_abs, seq_max_abs=seq_max,
        seq_log_ratio=np.where(lengths > 0, st["seq_sum_d"], 0.0).astype(np.float64), seq_geo_ratio=seq_geo,
        dtypes=tuple(tok.dtypes),
    )


def _check_tol(tol) -> float:
    """``logprob_tol``: a finite number >= 0 (a NaN would switch the positive-logprob check off)."""
    ok = not isinstance(tol, bool) and isinstance(tol, (int, float, np.integer, np.floating))
    if not (ok and math.isfinite(tol) and tol >= 0):
        raise InputError(f"logprob_tol {tol!r}, expected a finite number >= 0", field="logprob_tol")
    return float(tol)


def _check_taus(taus) -> tuple:
    try:
        taus = tuple(float(t) for t in taus)
    except (TypeError, ValueError):
        raise InputError(f"taus {taus!r}, expected finite numbers >= 1", field="taus") from None
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
    with np.errstate(over="ignore"):
        total = float(absd.sum())
    if not math.isfinite(total):           # (as the fast pass: its sums would overflow)
        raise InputError("difference trainer - rollout overflows float64", field="rollout_logprobs")
    with np.errstate(over="ignore"):      # a gap above ~709 nats: r = inf, reported as such
        u = np.expm1(d)                   # r - 1, exact for small d
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
    pos_cnt = position_count(lengths)
    # ESS = (Σr)²/(N Σr²), shifted by max d so it cannot overflow
    w = np.exp(d - d.max())
    with np.errstate(over="ignore", invalid="ignore"):   # r, r² may overflow: report inf
        chi2_terms = np.expm1(2 * d)
        u2 = (u * u).sum()
        ratio_std = float(np.std(r))
    with np.errstate(invalid="ignore"):   # (quantiles next to an infinite ratio)
        ratio_p1, ratio_p99 = np.quantile(r, 0.01), np.quantile(r, 0.99)
    return {
        "n": n, "sum_abs": absd.sum(), "max_abs": absd.max(),
        "p50_abs": np.quantile(absd, 0.5), "p99_abs": np.quantile(absd, 0.99),
        "ratio_p1": ratio_p1, "ratio_p99": ratio_p99,
        "n_eq": int(np.count_nonzero(a == b)),
        "s1": d.sum(), "s2": (d * d).sum(), "k3": (u - d).sum(),
        "u1": u.sum(), "u2": u2, "chi2": chi2_terms.mean(),
        "ess": w.sum() ** 2 / (n * (w * w).sum()), "ratio_std": ratio_std,
        "d_min": d.min(), "d_max": d.max(),
        "n_extreme": [int(np.count_nonzero(absd > math.log(t))) for t in taus],
        "pos_sum": np.bincount(pos, weights=absd, minlength=pos_cnt.size), "pos_cnt": pos_cnt,
        "seq_sum_abs": seq_sum_abs, "seq_max_abs": seq_max_abs, "seq_sum_d": seq_sum_d,
    }


# -- public -----------------------------------------------------------------------------------
def measure(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, turns=None,
            taus=DEFAULT_TAUS, logprob_tol: float = LOGPROB_TOL, threads: int | None = None,
            _path: str = "auto", _kernel: str = "auto") -> GapReport:
    """Measure the trainer–rollout logprob gap over the masked tokens. See the module doc.

    ``turns``: a per-token turn index (integers >= 0) in the layout of the logprobs, read at the
    masked tokens only; the report then has ``per_turn`` rows (multi-turn trajectories: pass the
    rollout's ``loss_mask`` as ``mask`` so observation tokens never count).

    ``threads``: CPU threads for the fast pass (default: up to 8, one per 512K tokens, at most
    ``os.cpu_count()``). ``_path`` (testing): ``"auto"`` (fast pass above ``FAST_MIN_TOKENS``
    tokens), ``"fast"``, ``"reference"``. ``_kernel`` (testing, benchmarks): the fast pass's
    scan, ``"auto"`` (numba when it imports, unless ``SKYRL_NUMERICS_NUMBA=0``), ``"numpy"`` or
    ``"numba"``; the two give bitwise-equal reports.
    """
    taus = _check_taus(taus)
    logprob_tol = _check_tol(logprob_tol)
    tok = normalize(trainer_logprobs, rollout_logprobs, mask, cu_seqlens)
    tt = turn_stream(turns, trainer_logprobs, mask, tok) if turns is not None else None
    rep = _finish(_stats(tok, taus, logprob_tol, threads, _path, _kernel), tok, taus)
    if tt is not None:
        for k, sub in turn_groups(tok, tt):       # (values already checked by the whole pass)
            s = (rep if sub is tok else _finish(_stats(sub, taus, logprob_tol, threads, _path, _kernel),
                                                sub, taus)).summary()
            s["n_seqs"] = int(np.count_nonzero(sub.lengths))
            rep.per_turn.append({"turn": k, **s})
    return rep


def _stats(tok: Tokens, taus, tol: float, threads, path: str, kernel: str) -> dict:
    """The fast pass above ``FAST_MIN_TOKENS`` tokens (or when ``path="fast"``), else (or when it
    declines) the reference."""
    st = None
    if path == "fast" or (path == "auto" and tok.n > FAST_MIN_TOKENS):
        st = fast_stats(tok, taus, tol, threads=scan_threads(tok.n, threads), kernel=kernel)
    if st is None:
        st = _reference_stats(tok, taus, tol)
    return st


def measure_reference(trainer_logprobs, rollout_logprobs, mask=None, *, cu_seqlens=None, turns=None,
                      taus=DEFAULT_TAUS, logprob_tol: float = LOGPROB_TOL, threads=None) -> GapReport:
    """:func:`measure` through the plain full-array path (the spec the fast pass is tested against)."""
    return measure(trainer_logprobs, rollout_logprobs, mask, cu_seqlens=cu_seqlens, turns=turns, taus=taus,
                   logprob_tol=logprob_tol, _path="reference")
