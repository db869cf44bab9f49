"""Turn the layouts users hand us (padded+mask, ragged lists, flat+cu_seqlens; torch or numpy)
into one canonical token stream, and validate it.

Canonical form (:class:`Tokens`): the masked tokens of every sequence, in sequence order,
addressed by ``cu`` (``int64 [B+1]``, ``cu[i]:cu[i+1]`` are sequence ``i``'s tokens). The data
itself stays in the user's arrays where possible (no copy for flat input or unmasked padded
input); :meth:`Tokens.chunks` yields cache-sized pieces of whole sequences.

Private to :mod:`skyrl_numerics.gap` and :mod:`skyrl_numerics.correction`.
"""
from __future__ import annotations

import numpy as np

from skyrl_numerics.errors import InputError

FIELDS = ("trainer_logprobs", "rollout_logprobs")


def is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def to_numpy(x, field: str, row: int | None = None, kinds: str = "fiu") -> tuple[np.ndarray, str]:
    """Array view of ``x`` (torch tensor, numpy array, list of numbers) and its dtype name.

    torch bfloat16 (which numpy lacks) becomes float32: the conversion is exact, so equality
    and every metric are unchanged. Tensors on an accelerator are copied to the host.
    """
    if is_torch(x):
        import torch

        t = x.detach()
        name = str(t.dtype).replace("torch.", "")
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        if t.is_complex() or (t.dtype == torch.bool and "b" not in kinds):
            raise InputError(f"dtype {name} is not a real number type", row=row, field=field)
        return t.numpy(), name
    arr = np.asarray(x)
    name = arr.dtype.name
    if name == "bfloat16":  # ml_dtypes
        arr = arr.astype(np.float32)
    elif arr.dtype.kind not in kinds:
        raise InputError(f"dtype {name} is not a real number type", row=row, field=field)
    return arr, name


def is_ragged(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and not np.isscalar(x[0])


def mask_array(m, shape, row=None) -> np.ndarray:
    arr, _ = to_numpy(m, "mask", row, kinds="fiub")
    if arr.shape != tuple(shape):
        raise InputError(f"shape {tuple(arr.shape)}, expected {tuple(shape)} (same as trainer_logprobs)",
                         row=row, field="mask")
    if arr.dtype != bool:
        bad = (arr != 0) & (arr != 1)
        if bad.any():
            at = np.argwhere(bad)[0]
            r, i = (row, int(at[0])) if arr.ndim == 1 else (int(at[0]), int(at[1]))
            raise InputError(f"value {arr[tuple(at)].item()!r}, expected 0/1 or bool", row=r, field="mask", index=i)
        arr = arr.astype(bool)
    return arr


class Tokens:
    """Validated-shape token stream. Values are checked later (in one pass) by the caller.

    Attributes: ``a``/``b`` the trainer/rollout data (1-D flat, or 2-D padded when ``mask2d`` is
    set), ``lengths`` (int64 [B], masked tokens per sequence), ``cu`` (int64 [B+1]), ``n``
    (total tokens), ``dtypes`` (names of the input dtypes).
    """

    def __init__(self, a, b, lengths, *, mask2d=None, locate=None, dtypes=("", "")):
        self.a, self.b, self.mask2d = a, b, mask2d
        self.lengths = lengths.astype(np.int64, copy=False)
        self.cu = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(self.lengths, out=self.cu[1:])
        self.n = int(self.cu[-1])
        self.n_seqs = len(lengths)
        self._locate = locate
        self.dtypes = dtypes

    # -- access -------------------------------------------------------------------------------
    def locate(self, k: int) -> tuple[int, int]:
        """(row, index in the user's layout) of canonical token ``k``."""
        row = int(np.searchsorted(self.cu, k, side="right") - 1)
        j = int(k - self.cu[row])
        return (row, j) if self._locate is None else self._locate(row, j)

    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """All tokens as two 1-D arrays (copies only for padded+mask input)."""
        if self.mask2d is None:
            return self.a, self.b
        return self.a[self.mask2d], self.b[self.mask2d]

    def plan(self, chunk: int) -> list[tuple[int, int]]:
        """Row ranges [r0, r1) of whole sequences, each about ``chunk`` tokens (>= 1 token)."""
        cu = self.cu
        if self.n == 0:
            return []
        targets = np.arange(chunk, self.n, chunk)
        cuts = np.searchsorted(cu, targets, side="left")
        cuts = np.unique(np.concatenate([[0], cuts, [self.n_seqs]]))
        return [(int(r0), int(r1)) for r0, r1 in zip(cuts[:-1], cuts[1:]) if cu[r1] > cu[r0]]

    def chunk(self, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of rows [r0, r1) as 1-D arrays in the input dtype."""
        if self.mask2d is None:
            s, e = self.cu[r0], self.cu[r1]
            return self.a[s:e], self.b[s:e]
        idx = np.flatnonzero(self.mask2d[r0:r1])
        return self.a[r0:r1].reshape(-1).take(idx), self.b[r0:r1].reshape(-1).take(idx)

    def sample(self, size: int, seed: int = 0, runs: int = 128) -> tuple[np.ndarray, np.ndarray]:
        """About ``size`` tokens as float64: ``runs`` runs of consecutive tokens at random places
        (cache-friendly; the runs are spread over the whole batch)."""
        rng = np.random.default_rng(seed)
        if self.n <= size:
            a, b = self.flat()
            return a.astype(np.float64), b.astype(np.float64)
        if self.mask2d is None:
            run = max(1, size // runs)
            starts = np.sort(rng.integers(0, self.n - run + 1, runs))
            idx = (starts[:, None] + np.arange(run)[None, :]).reshape(-1)
            return self.a.take(idx).astype(np.float64), self.b.take(idx).astype(np.float64)
        # padded + mask: a window of masked tokens from each of `runs` rows drawn by length
        # (all rows at once: the masked columns of the drawn rows, row-major, from np.nonzero)
        run = max(1, size // runs)
        rows = np.searchsorted(self.cu, rng.integers(0, self.n, runs), side="right") - 1
        lens = self.lengths[rows]
        s0 = rng.integers(0, np.maximum(lens - run, 0) + 1)
        take = np.minimum(lens, run)
        m = self.mask2d[rows]
        W = m.shape[1]
        t0 = m.argmax(axis=1)                                  # first masked column
        last = W - 1 - m[:, ::-1].argmax(axis=1)
        one_run = last - t0 + 1 == lens                        # (the usual left/right padding)
        base = np.concatenate([[0], np.cumsum(take)[:-1]])
        col = np.repeat(t0 + s0 - base, take) + np.arange(int(take.sum()))
        rowrep = np.repeat(np.arange(rows.size), take)
        for i in np.flatnonzero(~one_run).tolist():            # rows with holes: through nonzero
            col[base[i]:base[i] + take[i]] = np.flatnonzero(m[i])[s0[i]:s0[i] + take[i]]
        flat = rows[rowrep] * W + col
        return (self.a.reshape(-1).take(flat).astype(np.float64),
                self.b.reshape(-1).take(flat).astype(np.float64))


def position_count(lengths: np.ndarray) -> np.ndarray:
    """count[p] = number of sequences with more than p tokens."""
    maxlen = int(lengths.max()) if lengths.size else 0
    hist = np.bincount(lengths, minlength=maxlen + 1)
    return (lengths.size - np.cumsum(hist))[:maxlen].astype(np.int64)


def _row_counts(m: np.ndarray) -> np.ndarray:
    """True values per row of a 2-D bool mask: popcounts of 8 mask bytes at a time when the rows
    allow it (~4x faster than ``m.sum(axis=1)``), else that."""
    if hasattr(np, "bitwise_count") and m.flags.c_contiguous and m.shape[1] % 8 == 0 and m.shape[1]:
        return np.bitwise_count(m.view(np.uint64)).sum(axis=1, dtype=np.int64)
    return m.sum(axis=1)


def _check_cu(cu, n: int) -> np.ndarray:
    arr, _ = to_numpy(cu, "cu_seqlens")
    if arr.ndim != 1 or arr.size < 2 or arr.dtype.kind not in "iu":
        raise InputError(f"expected a 1-D integer array [B+1], got shape {tuple(arr.shape)} dtype {arr.dtype}",
                         field="cu_seqlens")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise InputError(f"value {int(arr[i])} does not fit int64", field="cu_seqlens", index=i)
    arr = arr.astype(np.int64)
    if arr[0] != 0:
        raise InputError(f"value {arr[0]}, expected 0", field="cu_seqlens", index=0)
    dif = np.diff(arr)
    if (dif < 0).any():
        i = int(np.argmax(dif < 0)) + 1
        raise InputError(f"value {arr[i]} < previous {arr[i - 1]}, expected non-decreasing",
                         field="cu_seqlens", index=i)
    if arr[-1] != n:
        raise InputError(f"last value {arr[-1]}, expected {n} (number of tokens)",
                         field="cu_seqlens", index=arr.size - 1)
    return arr


def normalize(trainer, rollout, mask=None, cu_seqlens=None) -> Tokens:
    """Check shapes/layout of the inputs and build a :class:`Tokens` (values unchecked)."""
    ra, rb = is_ragged(trainer), is_ragged(rollout)
    if ra != rb:
        raise InputError("layout mismatch: one input is a list of sequences, the other an array",
                         field=FIELDS[1])
    if ra:
        return _normalize_ragged(trainer, rollout, mask, cu_seqlens)
    a, na = to_numpy(trainer, FIELDS[0])
    b, nb = to_numpy(rollout, FIELDS[1])
    if a.ndim not in (1, 2):
        raise InputError(f"expected 1-D (flat) or 2-D [B, T] (padded), got shape {tuple(a.shape)}",
                         field=FIELDS[0])
    if b.shape != a.shape:
        raise InputError(f"shape {tuple(b.shape)}, expected {tuple(a.shape)} (same as trainer_logprobs)",
                         field=FIELDS[1])
    if a.size == 0:
        raise InputError("empty input: no tokens to measure", field=FIELDS[0])
    dtypes = (na, nb)
    if a.ndim == 2:
        if cu_seqlens is not None:
            raise InputError("cu_seqlens is for flat 1-D input; padded [B, T] input uses mask", field="cu_seqlens")
        bsz, t = a.shape
        if mask is None:
            return Tokens(a.reshape(-1), b.reshape(-1), np.full(bsz, t), dtypes=dtypes)
        m = mask_array(mask, a.shape)
        lengths = _row_counts(m)
        if lengths.sum() == 0:
            raise InputError("empty input: mask selects no tokens", field="mask")
        if lengths.sum() == a.size:
            return Tokens(a.reshape(-1), b.reshape(-1), lengths, dtypes=dtypes)

        def locate(row, j, m=m):
            return row, int(np.flatnonzero(m[row])[j])

        return Tokens(np.ascontiguousarray(a), np.ascontiguousarray(b), lengths, mask2d=m, locate=locate,
                      dtypes=dtypes)
    # flat 1-D
    cu = _check_cu(cu_seqlens, a.size) if cu_seqlens is not None else np.array([0, a.size], np.int64)
    if mask is None:
        return Tokens(a, b, np.diff(cu), dtypes=dtypes)
    m = mask_array(mask, a.shape)
    keep = np.flatnonzero(m)
    if keep.size == 0:
        raise InputError("empty input: mask selects no tokens", field="mask")
    cm = np.concatenate([[0], np.cumsum(m, dtype=np.int64)])
    lengths = cm[cu[1:]] - cm[cu[:-1]]

    def locate(row, j, keep=keep, cu=cu, lengths=lengths):
        k = int(keep[int(np.sum(lengths[:row])) + j])
        return row, k - int(cu[row])

    return Tokens(a[m], b[m], lengths, locate=locate, dtypes=dtypes)


def _normalize_ragged(trainer, rollout, mask, cu_seqlens) -> Tokens:
    if cu_seqlens is not None:
        raise InputError("cu_seqlens is for flat 1-D input, not for a list of sequences", field="cu_seqlens")
    if len(rollout) != len(trainer):
        raise InputError(f"{len(rollout)} sequences, expected {len(trainer)} (as trainer_logprobs)",
                         field=FIELDS[1])
    if mask is not None and (not isinstance(mask, (list, tuple)) or len(mask) != len(trainer)):
        raise InputError(f"expected a list of {len(trainer)} 1-D masks for ragged input", field="mask")
    aa, bb, keeps = [], [], []
    dtypes = None
    for i, (x, y) in enumerate(zip(trainer, rollout)):
        xa, xn = to_numpy(x, FIELDS[0], i)
        ya, yn = to_numpy(y, FIELDS[1], i)
        dtypes = dtypes or (xn, yn)
        if xa.ndim != 1:
            raise InputError(f"expected a 1-D sequence, got shape {tuple(xa.shape)}", row=i, field=FIELDS[0])
        if ya.shape != xa.shape:
            raise InputError(f"length {ya.size if ya.ndim == 1 else tuple(ya.shape)}, expected {xa.size} "
                             "(as trainer_logprobs)", row=i, field=FIELDS[1])
        if mask is not None:
            m = mask_array(mask[i], xa.shape, row=i)
            keeps.append(np.flatnonzero(m))
            xa, ya = xa[m], ya[m]
        aa.append(xa)
        bb.append(ya)
    lengths = np.array([x.size for x in aa], np.int64)
    if lengths.sum() == 0:
        raise InputError("empty input: no tokens to measure", field=FIELDS[0] if mask is None else "mask")
    locate = None
    if mask is not None:
        def locate(row, j, keeps=keeps):
            return row, int(keeps[row][j])
    return Tokens(np.concatenate(aa), np.concatenate(bb), lengths, locate=locate, dtypes=dtypes)


def find_bad_value(tok: Tokens, tol: float, chunk: int = 1 << 16) -> None:
    """Raise :class:`InputError` at the first non-finite or positive (> ``tol``) logprob."""
    for r0, r1 in tok.plan(chunk):
        ca, cb = tok.chunk(r0, r1)
        for arr, field in ((ca, FIELDS[0]), (cb, FIELDS[1])):
            bad = ~np.isfinite(arr) | (arr > tol)
            if bad.any():
                j = int(np.argmax(bad))
                k = int(tok.cu[r0]) + j
                row, idx = tok.locate(k)
                v = arr[j]
                what = "not finite" if not np.isfinite(v) else f"positive logprob (> {tol:g})"
                raise InputError(f"value {float(v)!r} is {what}", row=row, field=field, index=idx)
