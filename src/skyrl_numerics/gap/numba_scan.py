"""The compiled scan of the gap fast pass (numba), bitwise equal to the numpy scan in
:mod:`skyrl_numerics.gap.fast`.

Imported only through :func:`skyrl_numerics.gap.fast._numba` (which catches a missing numba).
Kernels are compiled with ``cache=True`` (numba's cache: ``NUMBA_CACHE_DIR`` if set, else the
package's ``__pycache__``, else the user cache dir, e.g. ``~/.cache/numba``, for read-only
installs; without any writable place they compile per process). ``fastmath`` is off (no
reassociation, no FMA contraction): every float operation is the IEEE operation written, so the
bits do not depend on the compiler and the numpy scan reproduces them with elementwise ufuncs.
``error_model="numpy"`` only drops the division-by-zero checks (the kernels divide only
integers, by constants), which would otherwise sit in the vectorized loops.

Summation orders (both scans; see ``gap/fast.py`` for the error bounds):

* token sums of a chunk (Σz², Σg, Σu²): ``LANES`` independent lanes, lane l adding the
  chunk's elements l, l + LANES, l + 2·LANES, … in order from +0.0 (the chunk is zero-padded
  to a multiple of LANES; adding +0.0 to a lane is exact), then the lanes folded by halving
  (lane[:h] + lane[h:] until one is left). numpy: ``x.reshape(-1, LANES).sum(axis=0)`` over a
  C-contiguous buffer adds row after row per column, i.e. the same order;
* per-sequence Σ|d|, Σd: numpy's ``np.add.reduceat`` order (first element + numpy's pairwise
  sum of the rest: 8 accumulators over leaves of <= 128 elements, halves split at a multiple
  of 8), reproduced in :func:`_pw2`;
* per-position sums: token order, from 0.0 per chunk (as ``np.bincount``).
"""
from __future__ import annotations

import numpy as np
from numba import njit, uint64

LANES = 64            # lanes of the chunk-level sums (a power of two)


def _jit(fn):
    try:
        return njit(nogil=True, cache=True, error_model="numpy")(fn)
    except RuntimeError:      # no writable cache location at all: compile per process
        return njit(nogil=True, cache=False, error_model="numpy")(fn)


@_jit
def _leaf2(D, AD, lo, n):
    """numpy's pairwise leaf (n <= 128) of AD[lo:lo+n] and D[lo:lo+n]."""
    ul = uint64(lo)
    un = uint64(n)
    if n < 8:
        s0 = 0.0
        s1 = 0.0
        for j in range(ul, ul + un):
            s0 += AD[j]
            s1 += D[j]
        return s0, s1
    a0, a1, a2, a3 = AD[ul], AD[ul + uint64(1)], AD[ul + uint64(2)], AD[ul + uint64(3)]
    a4, a5, a6, a7 = AD[ul + uint64(4)], AD[ul + uint64(5)], AD[ul + uint64(6)], AD[ul + uint64(7)]
    b0, b1, b2, b3 = D[ul], D[ul + uint64(1)], D[ul + uint64(2)], D[ul + uint64(3)]
    b4, b5, b6, b7 = D[ul + uint64(4)], D[ul + uint64(5)], D[ul + uint64(6)], D[ul + uint64(7)]
    end = ul + un - un % uint64(8)
    i = ul + uint64(8)
    while i < end:
        a0 += AD[i]
        a1 += AD[i + uint64(1)]
        a2 += AD[i + uint64(2)]
        a3 += AD[i + uint64(3)]
        a4 += AD[i + uint64(4)]
        a5 += AD[i + uint64(5)]
        a6 += AD[i + uint64(6)]
        a7 += AD[i + uint64(7)]
        b0 += D[i]
        b1 += D[i + uint64(1)]
        b2 += D[i + uint64(2)]
        b3 += D[i + uint64(3)]
        b4 += D[i + uint64(4)]
        b5 += D[i + uint64(5)]
        b6 += D[i + uint64(6)]
        b7 += D[i + uint64(7)]
        i += uint64(8)
    s0 = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    s1 = ((b0 + b1) + (b2 + b3)) + ((b4 + b5) + (b6 + b7))
    for j in range(end, ul + un):
        s0 += AD[j]
        s1 += D[j]
    return s0, s1


@_jit
def _pw2(D, AD, lo, n, stk, fstk):
    """numpy's pairwise sum (``np.add.reduce`` of float64) of AD[lo:lo+n] and D[lo:lo+n]:
    the recursion (split at n//2 rounded down to a multiple of 8 while n > 128) walked with an
    explicit stack: ``stk`` (int64 [64, 3]) holds each frame's lo, n and state, ``fstk``
    (float64 [64, 2]) its left half's two sums."""
    if n <= 128:
        return _leaf2(D, AD, lo, n)
    # iterative post-order: each frame (lo, n) either is a leaf or combines two halves
    top = 0
    stk[0, 0] = lo
    stk[0, 1] = n
    stk[0, 2] = 0
    res_a = 0.0
    res_b = 0.0
    while top >= 0:
        flo, fn, state = stk[top, 0], stk[top, 1], stk[top, 2]
        if fn <= 128:
            res_a, res_b = _leaf2(D, AD, flo, fn)
            top -= 1
            continue
        n2 = fn // 2
        n2 -= n2 % 8
        if state == 0:                    # descend left
            stk[top, 2] = 1
            top += 1
            stk[top, 0] = flo
            stk[top, 1] = n2
            stk[top, 2] = 0
        elif state == 1:                  # left done (in res): descend right
            fstk[top, 0] = res_a
            fstk[top, 1] = res_b
            stk[top, 2] = 2
            top += 1
            stk[top, 0] = flo + n2
            stk[top, 1] = fn - n2
            stk[top, 2] = 0
        else:                             # right done: combine
            res_a = fstk[top, 0] + res_a
            res_b = fstk[top, 1] + res_b
            top -= 1
    return res_a, res_b


@_jit
def _fold(x):
    """Lanes folded by halving, in place: x[i] = x[i] + x[i + h] (as ``fast._fold``)."""
    h = x.size
    while h > 1:
        h //= 2
        for i in range(h):
            x[i] = x[i] + x[i + h]
    return x[0]


@_jit
def _chunk(ca, cb, c0, cu, lengths, offsets, r0, r1, tol_a, tol_b, T, med_lo, med_hi, coef,
           D, AD, tails, nt, meds, nm, part, pos_sum, pbase, seq_sum_abs, seq_max_abs, seq_sum_d,
           lanes, stk, fstk, mx, F, F64):
    """One chunk: rows [r0, r1), whose tokens are ca/cb (row r starts at cu[r] - c0);
    ``pos_sum[p - pbase]`` accumulates position p. Returns (bad, nnz, below, nt, nm): the
    counts, and the candidate counts after appending this chunk's tail values (d, |d| > T) to
    ``tails`` and median-bracket values (|d|) to ``meds`` (in token order). The lane sums of z²,
    g, u² (z = d on |d| <= T, else 0; g = z²·P(z), the Horner series of e^z − 1 − z;
    u = z + g) are left in ``lanes`` (float64 [3, LANES]): token j goes to lane j % LANES."""
    k = ca.size
    c2, c3, c4, c5, c6, c7 = coef[0], coef[1], coef[2], coef[3], coef[4], coef[5]
    bad = 0
    nnz = 0
    below = 0
    l2 = lanes[0]
    lg = lanes[1]
    lu = lanes[2]
    for q in range(LANES):
        l2[q] = 0.0
        lg[q] = 0.0
        lu[q] = 0.0
    m = k // LANES
    for i in range(m):                    # vectorized over the lanes: no reassociation needed
        base = i * LANES
        for q in range(LANES):
            j = base + q
            x = np.float64(ca[j])
            y = np.float64(cb[j])
            bad += not (x <= tol_a and y <= tol_b)
            d = x - y
            ad = abs(d)
            D[j] = d
            AD[j] = ad
            nnz += ad > 0.0
            below += ad < med_lo
            F[j] = np.uint8((ad > T) | (((ad >= med_lo) & (ad <= med_hi)) << 1))
            z = d if ad <= T else 0.0
            z2 = z * z
            g = z2 * (((((c7 * z + c6) * z + c5) * z + c4) * z + c3) * z + c2)
            u = z + g
            l2[q] += z2
            lg[q] += g
            lu[q] += u * u
    for j in range(m * LANES, k):         # ragged end: lanes 0 .. k - m·LANES - 1
        q = j - m * LANES
        x = np.float64(ca[j])
        y = np.float64(cb[j])
        bad += not (x <= tol_a and y <= tol_b)
        d = x - y
        ad = abs(d)
        D[j] = d
        AD[j] = ad
        nnz += ad > 0.0
        below += ad < med_lo
        F[j] = np.uint8((ad > T) | (((ad >= med_lo) & (ad <= med_hi)) << 1))
        z = d if ad <= T else 0.0
        z2 = z * z
        g = z2 * (((((c7 * z + c6) * z + c5) * z + c4) * z + c3) * z + c2)
        u = z + g
        l2[q] += z2
        lg[q] += g
        lu[q] += u * u
    # candidates for the exact percentiles (a few % of the tokens), in token order: pass 1 left
    # a flag byte per token (1: tail, 2: median bracket); words of 8 flags that are all 0 are
    # skipped, the others stored branch-free
    for j in range(k, (k + 7) // 8 * 8):
        F[j] = 0
    for w in range((k + 7) // 8):
        if F64[w] != 0:
            for j in range(8 * w, min(8 * w + 8, k)):
                f = F[j]
                tails[nt] = D[j]
                nt += f & 1
                meds[nm] = AD[j]
                nm += f >> 1
    # per sequence / per position
    pmin = offsets[r0]
    pmax = offsets[r0]
    for r in range(r0, r1):
        if lengths[r] > 0:
            pmin = min(pmin, offsets[r])
            pmax = max(pmax, offsets[r] + lengths[r])
    for p in range(pmin, pmax):
        part[p] = 0.0
    for r in range(r0, r1):
        L = lengths[r]
        if L == 0:
            continue
        s = cu[r] - c0
        o = offsets[r]
        if L == 1:                        # np.add.reduceat: first element, then + pairwise rest
            seq_sum_abs[r] = AD[s]
            seq_sum_d[r] = D[s]
        else:
            sa, sd = _pw2(D, AD, s + 1, L - 1, stk, fstk)
            seq_sum_abs[r] = AD[s] + sa
            seq_sum_d[r] = D[s] + sd
        # max |d| (exact in any order: LANES running maxima, vectorized) and per-position sums
        nb = L // LANES
        if nb:
            for q in range(LANES):
                mx[q] = AD[s + q]
                part[o + q] += AD[s + q]
            for i in range(1, nb):
                base = i * LANES
                for q in range(LANES):
                    v = AD[s + base + q]
                    part[o + base + q] += v
                    mx[q] = max(mx[q], v)
            m0 = mx[0]
            for q in range(1, LANES):
                m0 = max(m0, mx[q])
        else:
            m0 = AD[s]
        for t in range(nb * LANES, L):
            v = AD[s + t]
            part[o + t] += v
            m0 = max(m0, v)
        seq_max_abs[r] = m0
    for p in range(pmin, pmax):
        pos_sum[p - pbase] += part[p]
    return bad, nnz, below, nt, nm


@_jit
def scan_flat(a, b, cu, lengths, offsets, cuts, tol_a, tol_b, T, med_lo, med_hi, coef,
              D, AD, tails, meds, part, pos_sum, pbase, seq_sum_abs, seq_max_abs, seq_sum_d, csums):
    """A run of chunks of flat input: chunk c is rows [cuts[c], cuts[c+1]). Returns
    (bad, nnz, below, n_tails, n_meds); ``csums[c]`` = chunk c's folded (Σz², Σg, Σu²)."""
    lanes = np.empty((3, LANES))
    stk = np.empty((64, 3), np.int64)
    fstk = np.empty((64, 2))
    mx = np.empty(LANES)
    F = np.empty((D.size + 15) // 8 * 8, np.uint8)
    F64 = F.view(np.uint64)
    bad = 0
    nnz = 0
    below = 0
    nt = 0
    nm = 0
    for c in range(cuts.size - 1):
        r0, r1 = cuts[c], cuts[c + 1]
        c0, c1 = cu[r0], cu[r1]
        b_, z_, w_, nt, nm = _chunk(a[c0:c1], b[c0:c1], c0, cu, lengths, offsets, r0, r1, tol_a, tol_b,
                                    T, med_lo, med_hi, coef, D, AD, tails, nt, meds, nm, part, pos_sum, pbase,
                                    seq_sum_abs, seq_max_abs, seq_sum_d, lanes, stk, fstk, mx, F, F64)
        bad += b_
        nnz += z_
        below += w_
        for q in range(3):
            csums[c, q] = _fold(lanes[q])
    return bad, nnz, below, nt, nm


@_jit
def _all_set(m2, m64, r, t0, t1, W):
    """All mask bytes m2[r, t0:t1] are 1: 8 at a time through ``m64`` (the whole mask viewed as
    uint64, or an empty array when its size is not a multiple of 8), the ends byte by byte."""
    b0 = r * W + t0
    b1 = r * W + t1
    if m64.size == 0 or t1 - t0 < 32:
        for t in range(t0, t1):
            if m2[r, t] != 1:
                return False
        return True
    w0 = (b0 + 7) // 8
    w1 = b1 // 8
    for t in range(t0, t0 + (8 * w0 - b0)):
        if m2[r, t] != 1:
            return False
    ok = True
    for w in range(w0, w1):
        ok &= m64[w] == np.uint64(0x0101010101010101)
    for t in range(t1 - (b1 - 8 * w1), t1):
        if m2[r, t] != 1:
            return False
    return ok


@_jit
def scan_padded(a2, b2, m2, m64, cu, lengths, offsets, cuts, tol_a, tol_b, T, med_lo, med_hi, coef,
                D, AD, CA, CB, tails, meds, part, pos_sum, pbase, seq_sum_abs, seq_max_abs, seq_sum_d, csums):
    """:func:`scan_flat` for padded [B, T] input with a mask (``m2``: viewed as uint8 0/1 bytes,
    ``m64``: as uint64 when possible, see :func:`_all_set`): each chunk's masked tokens are
    first compacted, in order, into CA/CB (one element of slack)."""
    lanes = np.empty((3, LANES))
    stk = np.empty((64, 3), np.int64)
    fstk = np.empty((64, 2))
    mx = np.empty(LANES)
    F = np.empty((D.size + 15) // 8 * 8, np.uint8)
    F64 = F.view(np.uint64)
    bad = 0
    nnz = 0
    below = 0
    nt = 0
    nm = 0
    W = a2.shape[1]
    for c in range(cuts.size - 1):
        r0, r1 = cuts[c], cuts[c + 1]
        k = 0
        for r in range(r0, r1):
            L = lengths[r]
            if L == 0:
                continue
            t0 = 0
            while m2[r, t0] == 0:
                t0 += 1
            if t0 + L <= W and _all_set(m2, m64, r, t0, t0 + L, W):   # one run (left/right padding): copy it
                for t in range(L):
                    CA[k + t] = a2[r, t0 + t]
                    CB[k + t] = b2[r, t0 + t]
                k += L
            else:                         # holes: branch-free compaction of the row
                for t in range(t0, W):
                    CA[k] = a2[r, t]
                    CB[k] = b2[r, t]
                    k += m2[r, t]
        b_, z_, w_, nt, nm = _chunk(CA[:k], CB[:k], cu[r0], cu, lengths, offsets, r0, r1, tol_a, tol_b,
                                    T, med_lo, med_hi, coef, D, AD, tails, nt, meds, nm, part, pos_sum, pbase,
                                    seq_sum_abs, seq_max_abs, seq_sum_d, lanes, stk, fstk, mx, F, F64)
        bad += b_
        nnz += z_
        below += w_
        for q in range(3):
            csums[c, q] = _fold(lanes[q])
    return bad, nnz, below, nt, nm


@_jit
def narrow(x, lo, hi, out):
    """One pass for the exact percentiles: (count of x < lo, count kept), the elements of x in
    [lo, hi] copied in order to ``out``."""
    below = 0
    c = 0
    for i in range(x.size):
        v = x[i]
        below += v < lo
        out[c] = v
        c += (v >= lo) & (v <= hi)
    return below, c
