"""The fast pass of :func:`skyrl_numerics.gap.measure`: one chunked scan, same statistics as
the full-array reference (which is the spec; tests hold this to it).

* Chunks are cache-sized runs of whole sequences (sequences longer than a chunk are cut into
  pieces that carry their position offset). Runs of chunks go to threads (numpy and the
  compiled kernels release the GIL).
* e^d is evaluated only on the "tail" |d| > T (T ≤ 0.0125, about the 98th percentile of |d|).
  On the rest, with z = d (and z = 0 on the tail), g = e^z − 1 − z comes per token from the
  Taylor series to z^K by Horner, g = z²·(c2 + z·(c3 + … + z·c_K)), c_k = 1/k!, K ∈ {4, 5, 6}
  the smallest order whose truncation bound 2·T^(K−1)/(K+1)! is < 1e-13 (relative, per token:
  the first omitted term over z²/2, with margin); u = z + g. The pass sums z², g and u²
  (Σ(r − 1 − d), Σ(r − 1)² on those tokens; Σ(r − 1) = Σd + Σ(r − 1 − d)).
* Percentiles are exact: a 64K-token sample places T and a bracket around the median of |d|;
  the scan keeps only the tail and the bracket; ``np.partition`` runs on those. When a bracket
  misses, a ratio would overflow, or std(r) would lose more than 3 digits to cancellation, the
  pass returns ``None`` and the caller runs the reference.
* Two implementations of the scan, bitwise equal on every statistic: the compiled kernels of
  :mod:`skyrl_numerics.gap.numba_scan` (the default when numba imports; ``SKYRL_NUMERICS_NUMBA=0``
  turns them off) and numpy (the fallback). Both do the same IEEE operations in the same order.

Summation order and error bounds (u = 2^-53; all sums float64):

* token sums Σz², Σg, Σu² of a chunk of k tokens: ``LANES`` = 64 lanes, lane l adds elements
  l, l + 64, l + 128, … sequentially from +0.0 (the chunk zero-padded to a multiple of 64: the
  ragged end goes to lanes 0, 1, …), then the 64 lanes are folded by halving
  (``x[:h] + x[h:]``, 6 levels). numpy: ``buf.reshape(-1, 64).sum(axis=0)`` on the padded
  C-contiguous buffer (adds row after row per column), then the same fold. The chunks'
  results are combined with ``math.fsum`` (correctly rounded: independent of threads and of
  run order). Every term is ≥ 0, so each chunk sum has relative error ≤ γ_{m+5}
  (γ_j = j·u/(1 − j·u), m = ⌈k/64⌉ ≤ 2048 rows for 128K-token chunks): ≤ 2.3e-13 worst case
  (typically ~√m·u ≈ 5e-15), plus u for the fsum, plus the per-token errors: Horner and the
  products round ≤ 6 times, each term within ~7u, and the truncation below 1e-13 relative.
  Tests hold these sums to 1e-12 relative against ``math.fsum`` of ``expm1``.
* per-sequence Σ|d| and Σd: ``np.add.reduceat`` order (first element + numpy's pairwise sum
  of the rest), error ≤ γ_{~log2(L/128) + 19}·Σ|x| for a sequence of L tokens; totals
  (mean |d|, Σd) are numpy's pairwise ``sum`` of those. max |d| is exact.
* per-position sums: token order per chunk from 0.0 (``np.bincount`` order), then added to
  the run's array chunk after chunk; the runs' arrays are added in run order.
"""
from __future__ import annotations

import math
import os

import numpy as np

from skyrl_numerics.gap.layout import Tokens, find_bad_value, position_count
from skyrl_numerics.errors import InputError

_CHUNK = 1 << 17          # tokens per piece: the float64 buffers stay in L3; fewer Python steps
_TAYLOR_MAX = 0.0125      # |d| above this: exact expm1; below: Taylor series to d^K (Horner)
_TAYLOR_ERR = 1e-13       # K is the smallest order whose truncation bound 2 T^(K-1)/(K+1)! is below this
_SAMPLE = 1 << 16         # tokens sampled (in 128 runs of 512) to place the percentile brackets
LANES = 64                # lanes of the chunk token sums (= numba_scan.LANES)
_COEF = tuple(1.0 / math.factorial(k) for k in range(2, 8))   # c2 .. c7 of the Horner series
_RUN = 4                  # chunks per run: the unit of work of a thread (results do not depend
                          # on the number of threads: runs are combined in run order)
_LONG = 2048              # mean sequence length from which per-position sums are added by slices
                          # (one ~1-3 µs Python step per sequence, vs ~2 ns/token for bincount)


# numpy's quantile(method="linear"), bit for bit
def _q_index(n: int, q: float) -> tuple[int, int, float]:
    h = (n - 1) * np.float64(q)
    lo = int(math.floor(h))
    return lo, min(lo + 1, n - 1), float(h - lo)


def _lerp(a: float, b: float, t: float) -> float:
    diff = b - a
    return float(b - diff * (1 - t)) if t >= 0.5 else float(a + diff * t)


def _margin(q: float, s: int) -> float:
    """Bracket half-width around quantile q for a sample of s: 5 standard errors (+2/s)."""
    return 5.0 * math.sqrt(q * (1 - q) / s) + 2.0 / s


def _brackets(tok: Tokens, taus):
    """From a sample: the tail threshold T and the median bracket [med_lo, med_hi] of |d|."""
    sa, sb = tok.sample(_SAMPLE)
    sd = sa - sb
    sd = sd[np.isfinite(sd)]
    if sd.size == 0:
        return None
    s_abs, ss = np.abs(sd), sd.size

    def quantiles(x, qs):           # nearest-rank: only brackets, need not be exact
        ks = [min(max(int(round(q * (x.size - 1))), 0), x.size - 1) for q in qs]
        srt = np.sort(x)            # (numpy's SIMD sort: faster than a partition at 4 ranks)
        return [float(srt[k]) for k in ks]

    m99, m50 = _margin(0.99, ss), _margin(0.5, ss)
    a99, a99_hi, med_lo, med_hi = quantiles(s_abs, [0.99 - m99, 0.99 + m99, 0.5 - m50, 0.5 + m50])
    d1_lo, d1, d99, d99_hi = quantiles(sd, [0.01 - m99, 0.01 + m99, 0.99 - m99, 0.99 + m99])
    # every token beyond the p99 of |d|, beyond the p99 of d and below the p1 of d is "tail"
    T = min(_TAYLOR_MAX, a99, max(0.0, d99), max(0.0, -d1), *(math.log(t) for t in taus))
    guess = {"abs99": (a99, a99_hi), "d1": (d1_lo, d1), "d99": (d99, d99_hi)}
    return T, med_lo, med_hi, (med_hi > 0.0 and med_lo <= T), guess


def _select(x: np.ndarray, ks, guess=None, nb=None) -> dict:
    """{k: k-th smallest of x} for sorted ranks ks, exactly. With the compiled kernels ``nb``
    and a ``guess`` [lo, hi] of where the values lie (from the sample), one pass keeps the
    elements inside it and counts those below, and only those are partitioned; if a rank falls
    outside, all of x is. Two adjacent ranks take one partition and a min."""
    off = 0
    if nb is not None and guess is not None and x.size > 4096:
        buf = np.empty(x.size)
        below, c = nb.narrow(x, guess[0], guess[1], buf)
        if below <= ks[0] and ks[-1] < below + c:
            x, off = buf[:c], below
    ks_ = [k - off for k in ks]
    if len(ks_) == 2 and ks_[1] == ks_[0] + 1:
        part = np.partition(x, ks_[0])
        return {ks[0]: float(part[ks_[0]]), ks[1]: float(part[ks_[1]:].min())}
    part = np.sort(x) if len(ks_) > 1 else np.partition(x, ks_)   # (a partition at several ranks is slower)
    return {k: float(part[k_]) for k, k_ in zip(ks, ks_)}


def _subsample_guess(x: np.ndarray, ks):
    """[lo, hi] likely to hold the values of ranks ks of x, from every (n/8192)-th element."""
    if x.size <= 16384:
        return None
    sub = x[::x.size // 8192]
    m = _margin(0.5, sub.size)
    qs = [ks[0] / (x.size - 1) - m, ks[-1] / (x.size - 1) + m]
    idx = [min(max(int(round(q * (sub.size - 1))), 0), sub.size - 1) for q in qs]
    srt = np.sort(sub)
    return float(srt[idx[0]]), float(srt[idx[1]])


def _taylor_order(T: float) -> int:
    """Smallest K in 4..6 with relative truncation error 2·T^(K−1)/(K+1)! < ``_TAYLOR_ERR`` for
    Σ(e^d − 1 − d) (the term that needs most care: it starts at d²/2) over |d| <= T."""
    for K in (4, 5):
        if 2.0 * T ** (K - 1) / math.factorial(K + 1) < _TAYLOR_ERR:
            return K
    return 6


def _fold(lanes: np.ndarray) -> float:
    """Lanes folded by halving: ``x[:h] + x[h:]`` until one value is left (both scans)."""
    x = lanes
    while x.size > 1:
        h = x.size // 2
        x = x[:h] + x[h:]
    return float(x[0])


def _horner(z, out, K) -> None:
    """out = P(z) = (…(c_K·z + c_{K−1})·z + … + c3)·z + c2, elementwise, the operations the
    compiled kernel does (it runs the degree-7 form with c_{K+1..7} = 0, which changes no bit:
    0·z = ±0, ±0 + 0 = +0, and ±0·z + c = c)."""
    np.multiply(z, _COEF[K - 2], out=out)
    for i in range(K - 3, -1, -1):
        np.add(out, _COEF[i], out=out)
        if i:
            np.multiply(out, z, out=out)


def _scan(tok: Tokens, plan, T, med_lo, med_hi, use_med, K, out, offsets, maxlen, tol,  # noqa: C901
          kernels=None) -> dict:
    """One pass over the row ranges in ``plan``. Per-sequence results go straight into
    ``out`` (disjoint rows per caller); token totals come back as a dict (``sums``: one
    (Σz², Σg, Σu²) per chunk, folded from its lanes). Row i's tokens sit at response
    positions ``offsets[i]...`` (non-zero for the later pieces of a split sequence).
    ``kernels``: the compiled kernels (same results bit for bit), else numpy."""
    cu, lengths = tok.cu, tok.lengths
    seq_sum_abs, seq_max_abs, seq_sum_d = out
    pr = np.array(plan, np.int64)
    big = int((cu[pr[:, 1]] - cu[pr[:, 0]]).max())
    bigl = -(-big // LANES) * LANES       # buffers padded to whole rows of lanes
    rr = np.arange(pr[0, 0], pr[-1, 1])
    lens_run = lengths[rr]
    plo = int(offsets[rr][lens_run > 0].min())        # positions this run touches: [plo, phi)
    phi = int((offsets[rr] + lens_run).max())
    pos_sum = np.zeros(phi - plo)
    if not use_med:                       # no token is below -1 or in [-1, -2]
        med_lo, med_hi = -1.0, -2.0
    if kernels is not None:
        return _scan_numba(tok, plan, T, med_lo, med_hi, K, big, pos_sum, plo, maxlen, out, offsets, tol, kernels)
    D, AD = np.empty(bigl), np.empty(bigl)
    ok = True
    nnz = below = 0
    sums = []
    tails, meds = [], []
    Z2, G, U = np.empty(bigl), np.empty(bigl), np.empty(bigl)
    TB, TB2 = np.empty(big, bool), np.empty(big, bool)
    POS = np.empty(big, np.int64)
    for r0, r1 in plan:
        lens = lengths[r0:r1]
        starts = cu[r0:r1] - cu[r0]
        offs = offsets[r0:r1]
        rows = slice(r0, r1)
        if lens.min() == 0:
            nz = lens > 0
            lens, starts, offs, rows = lens[nz], starts[nz], offs[nz], np.arange(r0, r1)[nz]
        ca, cb = tok.chunk(r0, r1)
        k = ca.size
        kl = -(-k // LANES) * LANES
        d, ad, tb, tb2 = D[:k], AD[:k], TB[:k], TB2[:k]
        np.subtract(ca, cb, out=d, dtype=np.float64)
        np.abs(d, out=ad)
        ok &= bool(ca.max() <= tol) and bool(cb.max() <= tol)
        nnz += int(np.count_nonzero(np.greater(ad, 0.0, out=tb)))
        seq_sum_abs[rows] = np.add.reduceat(ad, starts)
        seq_max_abs[rows] = np.maximum.reduceat(ad, starts)
        seq_sum_d[rows] = np.add.reduceat(d, starts)
        o0 = int(offs[0])
        # per-position sums: each chunk's sums start from 0 in token order, then are added to
        # pos_sum (the compiled kernel does the same)
        if lens.min() == lens.max() and offs.min() == offs.max():
            L = int(lens[0])
            pos_sum[o0 - plo:o0 - plo + L] += ad.reshape(-1, L).sum(axis=0)
        elif k >= _LONG * lens.size:      # long sequences on average: add each as a slice
            lo, hi = int(offs.min()), int((offs + lens).max())
            part = np.zeros(hi - lo)
            for s0, L, o in zip(starts.tolist(), lens.tolist(), offs.tolist()):
                part[o - lo:o - lo + L] += ad[s0:s0 + L]
            pos_sum[lo - plo:hi - plo] += part
        else:                             # position in sequence: cumsum of 1s, reset at starts
            pos = POS[:k]
            pos.fill(1)
            pos[starts[1:]] = offs[1:] - (offs[:-1] + lens[:-1] - 1)
            pos[0] = o0
            np.cumsum(pos, out=pos)
            part = np.bincount(pos, weights=ad)
            pos_sum[:part.size - plo] += part[plo:]
        np.less(ad, med_lo, out=tb)
        below += int(np.count_nonzero(tb))
        np.greater_equal(ad, med_lo, out=tb)
        np.less_equal(ad, med_hi, out=tb2)
        np.logical_and(tb, tb2, out=tb2)
        if tb2.any():
            meds.append(ad.take(np.flatnonzero(tb2)))
        np.greater(ad, T, out=tb)
        if tb.any():
            idx = np.flatnonzero(tb)
            tails.append(d.take(idx))
            d[idx] = 0.0
        D[k:kl] = 0.0                     # z: d with the tail zeroed, padded to whole rows
        z, z2, g, u = D[:kl], Z2[:kl], G[:kl], U[:kl]
        np.multiply(z, z, out=z2)
        _horner(z, g, K)
        np.multiply(z2, g, out=g)
        np.add(z, g, out=u)
        np.multiply(u, u, out=u)
        sums.append(tuple(_fold(x.reshape(-1, LANES).sum(axis=0)) for x in (z2, g, u)))
    return dict(sums=sums, nnz=nnz, below=below, ok=ok, tails=tails, meds=meds, pos_sum=pos_sum, plo=plo)


def _scan_numba(tok: Tokens, plan, T, med_lo, med_hi, K, big, pos_sum, plo, maxlen, out, offsets, tol, nb) -> dict:
    """:func:`_scan` through the compiled kernels: one call for the whole run of chunks."""
    cu = tok.cu
    seq_sum_abs, seq_max_abs, seq_sum_d = out
    cuts = np.array([r0 for r0, _ in plan] + [plan[-1][1]], np.int64)
    ntok = int(cu[plan[-1][1]] - cu[plan[0][0]])
    D, AD, part = np.empty(big), np.empty(big), np.empty(maxlen)
    tails, meds = np.empty(ntok), np.empty(ntok)    # pages are touched only as far as used
    csums = np.empty((len(plan), 3))
    coef = np.array(_COEF[:K - 1] + (0.0,) * (7 - K))
    # numpy compares x <= tol in x's dtype (tol is a weak Python float): the same here
    tol_a, tol_b = float(tok.a.dtype.type(tol)), float(tok.b.dtype.type(tol))
    common = (cu, tok.lengths, offsets, cuts, tol_a, tol_b, T, med_lo, med_hi, coef, D, AD)
    rest = (tails, meds, part, pos_sum, plo, seq_sum_abs, seq_max_abs, seq_sum_d, csums)
    if tok.mask2d is None:
        bad, nnz, below, nt, nm = nb.scan_flat(tok.a, tok.b, *common, *rest)
    else:
        CA, CB = np.empty(big + 1, tok.a.dtype), np.empty(big + 1, tok.b.dtype)
        m8 = tok.mask2d.view(np.uint8)
        m64 = (m8.reshape(-1).view(np.uint64) if m8.flags.c_contiguous and m8.size % 8 == 0
               else np.zeros(0, np.uint64))
        bad, nnz, below, nt, nm = nb.scan_padded(tok.a, tok.b, m8, m64, *common, CA, CB, *rest)
    return dict(sums=[tuple(c) for c in csums.tolist()], nnz=int(nnz), below=int(below), ok=bad == 0,
                tails=[tails[:nt].copy()], meds=[meds[:nm].copy()], pos_sum=pos_sum, plo=plo)


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


def _pick_kernel(tok: Tokens, kernel: str):
    if kernel not in ("auto", "numba", "numpy"):
        raise ValueError(f"kernel {kernel!r}: expected 'auto', 'numba' or 'numpy'")
    if kernel == "numpy" or (kernel == "auto" and os.environ.get("SKYRL_NUMERICS_NUMBA", "1") == "0"):
        return None
    nb = _numba()
    if nb is None:
        if kernel == "numba":
            raise ImportError("kernel='numba' needs numba (pip install numba)")
        return None
    suits = all(x.dtype in (np.float32, np.float64) and x.flags.c_contiguous for x in (tok.a, tok.b))
    if not suits:
        if kernel == "numba":
            raise ValueError("kernel='numba' takes C-contiguous float32/float64 arrays")
        return None
    return nb


def scan_threads(n_tokens: int, threads: int | None) -> int:
    if threads is not None:
        return max(1, int(threads))
    return max(1, min(os.cpu_count() or 1, 8, n_tokens // (4 * _CHUNK)))


def fast_stats(tok: Tokens, taus, tol: float, chunk: int = _CHUNK, threads: int | None = 1,
                kernel: str = "auto"):
    """Same dict as :func:`_reference_stats` in one chunked pass; ``None`` if a percentile
    bracket missed or a ratio overflows (the caller then runs the reference).

    ``threads`` > 1 splits the chunks into that many contiguous runs scanned in parallel (numpy
    and the compiled kernels release the GIL); per-chunk token sums are combined with
    ``math.fsum`` (correctly rounded, so in any order), per-position sums in run order.

    ``kernel``: ``"numba"`` (the compiled kernels; an error if numba is missing), ``"numpy"``,
    or ``"auto"``: numba unless ``SKYRL_NUMERICS_NUMBA=0`` is set, when numba imports and the
    arrays suit it (C-contiguous float32/float64), else numpy. Both give the same dict bit for
    bit.
    """
    n = tok.n
    br = _brackets(tok, taus)
    if br is None:
        return None
    T, med_lo, med_hi, use_med, guess = br
    vtok, offsets, first = _split_long(tok, chunk)
    plan = vtok.plan(chunk)
    seq_sum_abs = np.zeros(vtok.n_seqs)
    seq_max_abs = np.zeros(vtok.n_seqs)
    seq_sum_d = np.zeros(vtok.n_seqs)
    out = (seq_sum_abs, seq_max_abs, seq_sum_d)
    maxlen = int(tok.lengths.max())
    kernels = _pick_kernel(vtok, kernel)
    K = _taylor_order(T)
    runs = [plan[i:i + _RUN] for i in range(0, len(plan), _RUN)]
    nt = min(threads, len(runs))
    if nt <= 1:
        parts = [_scan(vtok, run, T, med_lo, med_hi, use_med, K, out, offsets, maxlen, tol, kernels) for run in runs]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(nt) as ex:   # runs handed out as threads free up (map keeps the order)
            parts = list(ex.map(lambda run: _scan(vtok, run, T, med_lo, med_hi, use_med, K, out, offsets,
                                                  maxlen, tol, kernels), runs))
    if first is not None:                 # pieces of split sequences back into whole sequences
        ne = tok.lengths > 0
        real = [np.zeros(tok.n_seqs) for _ in range(3)]
        real[0][ne] = np.add.reduceat(seq_sum_abs, first)
        real[1][ne] = np.maximum.reduceat(seq_max_abs, first)
        real[2][ne] = np.add.reduceat(seq_sum_d, first)
        seq_sum_abs, seq_max_abs, seq_sum_d = real
    pos_cnt = position_count(tok.lengths)
    pos_sum = np.zeros(maxlen)
    for q in parts:                       # in run order
        pos_sum[q["plo"]:q["plo"] + q["pos_sum"].size] += q["pos_sum"]
    chunk_sums = [c for q in parts for c in q["sums"]]
    z2_small, k3_small, u2_small = (math.fsum(c[i] for c in chunk_sums) for i in range(3))
    nnz = sum(q["nnz"] for q in parts)
    below = sum(q["below"] for q in parts)
    ok = all(q["ok"] for q in parts)
    tails = [t for q in parts for t in q["tails"]]
    meds = [m for q in parts for m in q["meds"]]

    sum_abs = float(seq_sum_abs.sum())
    if not (ok and math.isfinite(sum_abs)):
        find_bad_value(tok, tol)
        raise InputError("difference trainer - rollout overflows float64", field="rollout_logprobs")
    tv = np.concatenate(tails) if tails else np.zeros(0)
    if tv.size and tv.max() > 300.0:      # r or r² would overflow: let the reference handle it
        return None
    ut = np.expm1(tv)
    n_tail = tv.size

    # exact order statistics (tails: |d| > T >= 0, so no zeros; negatives sort first)
    n_zero = n - nnz
    atv = np.abs(tv)
    n_neg = int(np.count_nonzero(tv < 0))
    n_pos = n_tail - n_neg
    # min/max of d: in the tails when there are any on that side; else every |d| <= T
    if n_neg:
        d_min = float(tv.min())
    elif T == 0.0 or n_zero == n:
        d_min = 0.0 if n_zero else float(tv.min())
    else:
        return None
    if n_pos:
        d_max = float(tv.max())
    elif T == 0.0 or n_zero == n:
        d_max = 0.0 if n_zero else float(tv.max())
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
            out.update({k + (n - n_tail): v for k, v in _select(atv, need_t, guess["abs99"], kernels).items()})
        if need_m:
            g = _subsample_guess(mv, need_m) if kernels is not None else None
            out.update({k + below: v for k, v in _select(mv, need_m, g, kernels).items()})
        return out

    def stat_d(ranks):                    # rank k of d: rank k (negative) or k - (n - n_tail) in tv
        out, need_n, need_p = {}, [], []
        for k in ranks:
            if k < n_neg:
                need_n.append(k)
            elif k >= n - n_pos:
                need_p.append(k - (n - n_tail))
            elif T == 0.0:
                out[k] = 0.0
            else:
                return None
        if need_n:
            out.update(_select(tv, need_n, guess["d1"], kernels))
        if need_p:
            out.update({k + (n - n_tail): v for k, v in _select(tv, need_p, guess["d99"], kernels).items()})
        return out

    s1 = float(seq_sum_d.sum())
    k3 = k3_small + float((ut - tv).sum())
    u1 = s1 + k3                                # Σ(r - 1) = Σd + Σ(r - 1 - d)
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
    # r = e^d through numpy's exp ufunc (as the reference does over the whole array): libm's
    # math.exp can differ from numpy's SIMD exp in the last ulp
    ks = sorted(sd_)
    ex = dict(zip(ks, np.exp(np.array([sd_[k] for k in ks], np.float64)).tolist()))
    r1_, r99 = (_lerp(ex[lo], ex[hi], g) for lo, hi, g in qd)
    return {
        "n": n, "sum_abs": sum_abs, "max_abs": max(d_max, -d_min),
        "p50_abs": p50, "p99_abs": p99, "ratio_p1": r1_, "ratio_p99": r99,
        "n_eq": n_zero, "s1": s1, "s2": z2_small + float((tv * tv).sum()), "k3": k3,
        "u1": u1, "u2": u2,
        "d_min": d_min, "d_max": d_max,
        "n_extreme": [int(np.count_nonzero(atv > math.log(t))) for t in taus],
        "pos_sum": pos_sum, "pos_cnt": pos_cnt,
        "seq_sum_abs": seq_sum_abs, "seq_max_abs": seq_max_abs, "seq_sum_d": seq_sum_d,
    }


# -- the compiled kernels (numba) ---------------------------------------------------------------
_NB = None            # None: not tried yet; False: unavailable; else the module of kernels


def _numba():
    """The compiled kernels (:mod:`skyrl_numerics.gap.numba_scan`; compiled on first use, then
    loaded from numba's on-disk cache), or ``None`` when numba does not import."""
    global _NB
    if _NB is None:
        try:
            from skyrl_numerics.gap import numba_scan
        except Exception:                 # noqa: BLE001 (missing or broken numba: the numpy scan)
            _NB = False
        else:
            if numba_scan.LANES != LANES:
                raise AssertionError("numba_scan.LANES != fast.LANES")
            _NB = numba_scan
    return _NB or None
