"""The fast pass of :func:`skyrl_numerics.gap.measure`: one chunked scan, same statistics as
the full-array reference (which is the spec; tests hold this to it).

* Chunks are cache-sized runs of whole sequences (sequences longer than a chunk are cut into
  pieces that carry their position offset), so the ~25 float64 passes per chunk stay in cache.
  Runs of chunks can go to threads (numpy releases the GIL in its loops).
* e^d is evaluated only on the "tail" |d| > T (T ≤ 0.0125, about the 98th percentile of |d|):
  the rest enter Σ(e^d − 1), Σ(e^d − 1 − d), Σ(e^d − 1)² through power sums Σd^k, k ≤ K, with
  K ∈ {4, 5, 6} the smallest order whose truncation bound 2·T^(K−1)/(K+1)! is < 1e-13.
* Percentiles are exact: a 64K-token sample places T and a bracket around the median of |d|;
  the scan keeps only the tail and the bracket; ``np.partition`` runs on those. When a bracket
  misses, a ratio would overflow, or std(r) would lose more than 3 digits to cancellation, the
  pass returns ``None`` and the caller runs the reference.
* Two implementations of the scan, bitwise equal: numpy (the default) and an optional numba
  loop (``SKYRL_NUMERICS_NUMBA=1``; ``numba`` is not a dependency) that reproduces numpy's
  pairwise summation order, so every sum comes out the same to the last bit.
"""
from __future__ import annotations

import math
import os

import numpy as np

from skyrl_numerics._gap_layout import Tokens, find_bad_value, position_count
from skyrl_numerics.errors import InputError

_CHUNK = 1 << 17          # tokens per piece: the float64 buffers stay in L3; fewer Python steps
_TAYLOR_MAX = 0.0125      # |d| above this: exact expm1; below: Taylor series to d^K
_TAYLOR_ERR = 1e-13       # K is the smallest order whose truncation bound 2 T^(K-1)/(K+1)! is below this
_SAMPLE = 1 << 16         # tokens sampled (in 128 runs of 512) to place the percentile brackets
_DOT = 8192               # dot-product block
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


def _power_sums(d, d2, d4, tmp, p, K) -> None:
    """p[3..K] += Σ d³ … d^K: each product formed elementwise (d2·d, d2·d2, d4·d, d4·d2), then
    summed by numpy's pairwise ``sum`` (which the compiled kernel reproduces bit for bit; a BLAS
    dot would sum in an order of its own)."""
    pairs = [(3, d2, d), (4, d2, d2), (5, d4, d), (6, d4, d2)][:K - 2]
    for i, x, y in pairs:
        np.multiply(x, y, out=tmp)
        p[i] += float(tmp.sum())


def _scan(tok: Tokens, plan, T, med_lo, med_hi, use_med, out, offsets, maxlen, tol,  # noqa: C901
          kernels=None) -> dict:
    """One pass over the row ranges in ``plan``. Per-sequence results go straight into
    ``out`` (disjoint rows per caller); token totals come back as a dict. Row i's tokens sit at
    response positions ``offsets[i]...`` (non-zero for the later pieces of a split sequence).
    ``kernels``: the compiled kernels (same results bit for bit), else numpy."""
    cu, lengths = tok.cu, tok.lengths
    seq_sum_abs, seq_max_abs, seq_sum_d = out
    big = max(int(cu[r1] - cu[r0]) for r0, r1 in plan)
    D, AD = np.empty(big), np.empty(big)
    pos_sum = np.zeros(maxlen)
    ok = True
    nnz = below = 0
    p = [0.0] * 7                         # p[k] = Σ d^k over tokens with |d| <= T
    K = _taylor_order(T)
    tails, meds = [], []
    if kernels is not None:
        scan_chunk, compact = kernels["scan_chunk"], kernels["compact"]
        TL, MD, part = np.empty(big), np.empty(big), np.empty(maxlen)
        psum = np.zeros(7)
        # numpy compares x <= tol in x's dtype (tol is a weak Python float): the same here
        tol_a, tol_b = float(tok.a.dtype.type(tol)), float(tok.b.dtype.type(tol))
        if tok.mask2d is not None:
            CA, CB = np.empty(big + 1, tok.a.dtype), np.empty(big + 1, tok.b.dtype)   # +1: compact writes ahead
    else:
        D2, D4, TMP = np.empty(big), np.empty(big), np.empty(big)
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
        if kernels is not None:
            if tok.mask2d is None:
                ca, cb = tok.a[cu[r0]:cu[r1]], tok.b[cu[r0]:cu[r1]]
            else:
                k = compact(tok.a, tok.b, tok.mask2d, r0, r1, CA, CB)
                ca, cb = CA[:k], CB[:k]
            rws = np.arange(r0, r1) if isinstance(rows, slice) else rows
            c_ok, c_nnz, c_below, nt, nm = scan_chunk(
                ca, cb, starts, lens, offs, rws, tol_a, tol_b, T, med_lo, med_hi, use_med, K,
                D, AD, TL, MD, part, pos_sum, seq_sum_abs, seq_max_abs, seq_sum_d, psum)
            ok &= bool(c_ok)
            nnz += int(c_nnz)
            below += int(c_below)
            if nt:
                tails.append(TL[:nt].copy())
            if nm:
                meds.append(MD[:nm].copy())
            continue
        ca, cb = tok.chunk(r0, r1)
        k = ca.size
        d, ad, d2, d4, tmp, tb, tb2 = D[:k], AD[:k], D2[:k], D4[:k], TMP[:k], TB[:k], TB2[:k]
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
            pos_sum[o0:o0 + L] += ad.reshape(-1, L).sum(axis=0)
        elif k >= _LONG * lens.size:      # long sequences on average: add each as a slice
            lo, hi = int(offs.min()), int((offs + lens).max())
            part = np.zeros(hi - lo)
            for s0, L, o in zip(starts.tolist(), lens.tolist(), offs.tolist()):
                part[o - lo:o - lo + L] += ad[s0:s0 + L]
            pos_sum[lo:hi] += part
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
            below += int(np.count_nonzero(tb))
            np.less_equal(ad, med_hi, out=tb2)
            np.logical_xor(tb, tb2, out=tb2)
            if tb2.any():
                meds.append(ad.take(np.flatnonzero(tb2)))
        np.greater(ad, T, out=tb)
        if tb.any():
            idx = np.flatnonzero(tb)
            tails.append(d.take(idx))
            d[idx] = 0.0
        p[1] += float(d.sum())
        np.multiply(d, d, out=d2)
        p[2] += float(d2.sum())
        if K > 4:
            np.multiply(d2, d2, out=d4)
        _power_sums(d, d2, d4, tmp, p, K)
    if kernels is not None:
        p = [float(v) for v in psum]
    return dict(p=p, nnz=nnz, below=below, ok=ok, tails=tails, meds=meds, pos_sum=pos_sum)


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
    if kernel == "numpy" or (kernel == "auto" and os.environ.get("SKYRL_NUMERICS_NUMBA", "0") != "1"):
        return None
    nb = _numba()
    if nb is None:
        if kernel == "numba":
            raise ImportError("kernel='numba' needs numba (pip install numba), or SKYRL_NUMERICS_NUMBA is 0")
        return None
    suits = all(x.dtype in (np.float32, np.float64) and x.flags.c_contiguous for x in (tok.a, tok.b))
    if not suits:
        if kernel == "numba":
            raise ValueError("kernel='numba' takes C-contiguous float32/float64 arrays")
        return None
    return nb


def _threads(n_tokens: int, threads: int | None) -> int:
    if threads is not None:
        return max(1, int(threads))
    return max(1, min(os.cpu_count() or 1, 8, n_tokens // (4 * _CHUNK)))


def _fast_stats(tok: Tokens, taus, tol: float, chunk: int = _CHUNK, threads: int | None = 1,
                kernel: str = "auto"):
    """Same dict as :func:`_reference_stats` in one chunked pass; ``None`` if a percentile
    bracket missed or a ratio overflows (the caller then runs the reference).

    ``threads`` > 1 splits the chunks into that many contiguous runs scanned in parallel (numpy
    releases the GIL in its loops); partial results are combined in run order.

    ``kernel``: ``"numba"`` (the compiled loop; an error if numba is missing), ``"numpy"``, or
    ``"auto"``: numba when ``SKYRL_NUMERICS_NUMBA=1`` is set, numba imports and the arrays suit it
    (C-contiguous float32/float64), else numpy. Both give the same dict bit for bit. numba is
    opt-in because its one-off compilation (~10 s per process) costs more than it saves on a
    single report.
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
    kernels = _pick_kernel(vtok, kernel)
    nt = min(threads, len(plan))
    if nt <= 1:
        parts = [_scan(vtok, plan, T, med_lo, med_hi, use_med, out, offsets, maxlen, tol, kernels)]
    else:
        from concurrent.futures import ThreadPoolExecutor

        runs = [plan[i * len(plan) // nt:(i + 1) * len(plan) // nt] for i in range(nt)]
        with ThreadPoolExecutor(nt) as ex:
            parts = list(ex.map(lambda run: _scan(vtok, run, T, med_lo, med_hi, use_med, out, offsets, maxlen,
                                                  tol, kernels), runs))
    if first is not None:                 # pieces of split sequences back into whole sequences
        ne = tok.lengths > 0
        real = [np.zeros(tok.n_seqs) for _ in range(3)]
        real[0][ne] = np.add.reduceat(seq_sum_abs, first)
        real[1][ne] = np.maximum.reduceat(seq_max_abs, first)
        real[2][ne] = np.add.reduceat(seq_sum_d, first)
        seq_sum_abs, seq_max_abs, seq_sum_d = real
    pos_cnt = position_count(tok.lengths)
    pos_sum = parts[0]["pos_sum"]
    for q in parts[1:]:
        pos_sum = pos_sum + q["pos_sum"]
    p = [math.fsum(q["p"][i] for q in parts) if len(parts) > 1 else parts[0]["p"][i] for i in range(7)]
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
    # r = e^d through numpy's exp ufunc (as the reference does over the whole array): libm's
    # math.exp can differ from numpy's SIMD exp in the last ulp
    ks = sorted(sd_)
    ex = dict(zip(ks, np.exp(np.array([sd_[k] for k in ks], np.float64)).tolist()))
    r1_, r99 = (_lerp(ex[lo], ex[hi], g) for lo, hi, g in qd)
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


# -- the compiled kernel (optional: numba) ------------------------------------------------------
# The same per-chunk arithmetic as ``_scan``'s numpy code, in one loop: every sum follows numpy's
# pairwise summation (``np.add.reduce``: 8 accumulators over blocks of <= 128, halves rounded
# down to a multiple of 8; ``np.add.reduceat``: first element + pairwise rest), so the results
# are bitwise equal to the numpy path (tests/core/test_gap.py holds them to it).
_NB = None            # None: not tried yet; False: unavailable or disabled; else the kernels


def _numba():
    """The compiled kernels (built on first use: ~10 s of numba compilation per process), or
    ``None`` when numba does not import."""
    global _NB
    if _NB is None:
        try:
            _NB = _build_numba()
        except ImportError:
            _NB = False
    return _NB or None


def _gen_pw(name, args, setup, exprs, prologue=(), epilogue=()):
    """Source of a numba function ``name(*args, lo, n)`` returning a tuple with numpy's pairwise
    sum (float64 ``np.add.reduce``) of each expression over the elements [lo, lo + n): below 8
    elements a plain loop from 0.0; up to 128, eight accumulators started at the first eight
    elements, combined ((0+1)+(2+3))+((4+5)+(6+7)), then the rest one by one; above, the two
    halves split at n//2 rounded down to a multiple of 8. ``setup(j, sfx)``: statements that
    define the expression variables for element ``j`` (and may have side effects, run in element
    order); ``exprs[q](sfx)``: expression q; ``prologue``/``epilogue``: lines run on entry to and
    before the return of each leaf (to load and store running counters).
    Indices are uint64 (numba then emits no negative-index wraparound and the lanes vectorize)."""
    nq = len(exprs)
    a = ", ".join(args)
    tup = "(" + ", ".join(f"s{q}" for q in range(nq)) + ",)"
    pro = ["        " + x for x in prologue]
    epi = ["        " + x for x in epilogue]
    L = [f"def {name}({a}, lo, n):", "    ul = uint64(lo)", "    un = uint64(n)", "    if n < 8:"] + pro
    L += [f"        s{q} = 0.0" for q in range(nq)]
    L.append("        for j in range(ul, ul + un):")
    L += ["            " + st for st in setup("j", "")]
    L += [f"            s{q} += {exprs[q]('')}" for q in range(nq)]
    L += epi + [f"        return {tup}", "    if n <= 128:"] + pro
    for lane in range(8):
        L += ["        " + st for st in setup(f"ul + uint64({lane})", f"_{lane}")]
        L += [f"        r{q}_{lane} = {exprs[q](f'_{lane}')}" for q in range(nq)]
    L.append("        nb = (un - un % uint64(8) - uint64(8)) // uint64(8)")
    L.append("        for b in range(nb):")
    L.append("            i = ul + uint64(8) + uint64(8) * b")
    for lane in range(8):
        L += ["            " + st for st in setup(f"i + uint64({lane})", f"_{lane}")]
        L += [f"            r{q}_{lane} += {exprs[q](f'_{lane}')}" for q in range(nq)]
    L += [f"        s{q} = ((r{q}_0 + r{q}_1) + (r{q}_2 + r{q}_3)) + ((r{q}_4 + r{q}_5) + (r{q}_6 + r{q}_7))"
          for q in range(nq)]
    L.append("        for j in range(ul + un - un % uint64(8), ul + un):")
    L += ["            " + st for st in setup("j", "")]
    L += [f"            s{q} += {exprs[q]('')}" for q in range(nq)]
    L += epi + [f"        return {tup}", "    n2 = n // 2", "    n2 -= n2 % 8",
          f"    x = {name}({a}, lo, n2)", f"    y = {name}({a}, lo + n2, n - n2)",
          "    return (" + ", ".join(f"x[{q}] + y[{q}]" for q in range(nq)) + ",)"]
    return "\n".join(L) + "\n"


def _pow_setup(j, s):                     # d with the tail zeroed, as the numpy path leaves it
    return [f"x{s} = D[{j}]", f"x{s} = 0.0 if AD[{j}] > T else x{s}", f"x2{s} = x{s} * x{s}",
            f"x4{s} = x2{s} * x2{s}"]


_POW_EXPRS = [lambda s: f"x{s}", lambda s: f"x2{s}", lambda s: f"x2{s} * x{s}", lambda s: f"x4{s}",
              lambda s: f"x4{s} * x{s}", lambda s: f"x4{s} * x2{s}"]


def _seg_setup(j, s):
    return [f"u{s} = AD[{j}]", f"v{s} = D[{j}]"]


def _build_numba():  # noqa: C901
    import numba

    jit = numba.njit(nogil=True, cache=False, error_model="numpy")
    ns = {"uint64": numba.uint64, "float64": numba.float64}
    exec(_gen_pw("pw_pow", ["D", "AD", "T"], _pow_setup, _POW_EXPRS), ns)      # noqa: S102
    exec(_gen_pw("pw_seg", ["D", "AD"], _seg_setup, [lambda s: f"u{s}", lambda s: f"v{s}"]), ns)  # noqa: S102
    pw_pow = ns["pw_pow"] = jit(ns["pw_pow"])        # the recursive calls find the dispatcher
    pw_seg = ns["pw_seg"] = jit(ns["pw_seg"])

    @jit
    def scan_chunk(ca, cb, starts, lens, offs, rows, tol_a, tol_b, T, med_lo, med_hi, use_med, K,
                   D, AD, tails, meds, part, pos_sum, seq_sum_abs, seq_max_abs, seq_sum_d, psum):
        """One chunk; returns (ok, nnz, below, n_tails, n_meds); psum[k] += chunk Σ d^k."""
        k = ca.size
        bad = 0
        nnz = 0
        below = 0
        nt = 0
        nm = 0
        if not use_med:                   # no token is below -1 or in [-1, -2]
            med_lo, med_hi = -1.0, -2.0
        for i in range(k):                # branch-free: the tests are unpredictable
            x = np.float64(ca[i])
            y = np.float64(cb[i])
            bad += not (x <= tol_a and y <= tol_b)
            d = x - y
            ad = abs(d)
            D[i] = d
            AD[i] = ad
            nnz += ad > 0.0
            tails[nt] = d
            nt += ad > T
            lo = ad < med_lo
            below += lo
            meds[nm] = ad
            nm += (not lo) and ad <= med_hi
        sums = pw_pow(D, AD, T, 0, k)
        for j in range(1, K + 1):
            psum[j] += sums[j - 1]
        pmin = offs[0]
        pmax = offs[0]
        for j in range(starts.size):
            pmin = min(pmin, offs[j])
            pmax = max(pmax, offs[j] + lens[j])
        for p in range(pmin, pmax):
            part[p] = 0.0
        for j in range(starts.size):
            s, L, o, r = starts[j], lens[j], offs[j], rows[j]
            if L == 1:                    # np.add.reduceat: first element, then + pairwise rest
                seq_sum_abs[r] = AD[s]
                seq_sum_d[r] = D[s]
            else:
                sa, sd = pw_seg(D, AD, s + 1, L - 1)
                seq_sum_abs[r] = AD[s] + sa
                seq_sum_d[r] = D[s] + sd
            m = AD[s]                     # (NaN only with invalid input, which raises later)
            for t in range(s + 1, s + L):
                m = max(m, AD[t])
            seq_max_abs[r] = m
            for t in range(L):
                part[o + t] += AD[s + t]
        for p in range(pmin, pmax):
            pos_sum[p] += part[p]
        return bad == 0, nnz, below, nt, nm

    @jit
    def compact(a2, b2, m2, r0, r1, CA, CB):
        k = 0
        T = a2.shape[1]
        for r in range(r0, r1):
            for t in range(T):
                CA[k] = a2[r, t]
                CB[k] = b2[r, t]
                k += m2[r, t]
        return k

    return {"scan_chunk": scan_chunk, "compact": compact, "pw_pow": pw_pow, "pw_seg": pw_seg}
