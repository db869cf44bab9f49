"""Per-turn rows of the gap report (multi-turn trajectories, issue 28).

``measure(..., turns=...)`` takes a per-token turn index in the layout of the logprobs (padded
``[B, T]``, a list of 1-D sequences, or flat with ``cu_seqlens``); only the masked tokens are read
(observation tokens are outside the mask and never count). The measured tokens are grouped by turn
index in one stable sort (a radix sort for indices below 2^16), keeping their sequence order, and
each group goes through the same statistics pass as the whole batch (the fast scan above
``FAST_MIN_TOKENS`` tokens, else the reference): a turn's row is the report's formulas over that
turn's tokens only.

Private to :mod:`skyrl_numerics.gap`.
"""
from __future__ import annotations

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.gap.layout import Tokens, is_ragged, mask_array, to_numpy


def _ints(x, row=None) -> np.ndarray:
    arr, name = to_numpy(x, "turns", row, kinds="iu")
    if arr.dtype.kind not in "iu":
        raise InputError(f"dtype {name} is not an integer type (turn indices are integers >= 0)",
                         row=row, field="turns")
    return arr


def turn_stream(turns, trainer, mask, tok: Tokens) -> np.ndarray:
    """The turn index of every measured token, in :class:`Tokens` order (int64 [tok.n])."""
    if is_ragged(trainer):
        if not isinstance(turns, (list, tuple)) or len(turns) != len(trainer):
            raise InputError(f"expected a list of {len(trainer)} 1-D turn-index arrays for ragged input",
                             field="turns")
        parts = []
        for i, (t, x) in enumerate(zip(turns, trainer)):
            t = _ints(t, i)
            n = len(x)
            if t.shape != (n,):
                raise InputError(f"shape {tuple(t.shape)}, expected ({n},) (as trainer_logprobs)", row=i,
                                 field="turns")
            parts.append(t[mask_array(mask[i], (n,), row=i)] if mask is not None else t)
        tt = np.concatenate(parts).astype(np.int64, copy=False)
    else:
        t = _ints(turns)
        want = _shape_of(trainer)
        if tuple(t.shape) != want:
            raise InputError(f"shape {tuple(t.shape)}, expected {want} (same as trainer_logprobs)", field="turns")
        if mask is not None:
            t = t[mask_array(mask, want)]
        tt = t.reshape(-1).astype(np.int64, copy=False)
    if tt.size and tt.min() < 0:
        k = int(np.argmax(tt < 0))
        row, idx = tok.locate(k)
        raise InputError(f"turn index {int(tt[k])} < 0", row=row, field="turns", index=idx)
    return tt


def _shape_of(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(np.asarray(x))


def turn_groups(tok: Tokens, tt: np.ndarray):
    """Yield ``(turn, sub)`` per turn index present, ascending: ``sub`` is a :class:`Tokens` of
    that turn's tokens (sequence order kept; ``lengths`` = the turn's tokens in each sequence)."""
    if tt.size == 0:
        return
    tmax = int(tt.max())
    if tmax < (1 << 16):
        keys = tt.astype(np.uint16)
        values = np.arange(tmax + 1)
        counts = np.bincount(tt, minlength=tmax + 1)
    else:
        values, keys, counts = np.unique(tt, return_inverse=True, return_counts=True)
    present = np.flatnonzero(counts)
    a, b = tok.flat()
    if present.size == 1:                 # one turn: every token, no gather
        yield int(values[present[0]]), tok
        return
    order = np.argsort(keys, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)])
    for g in present.tolist():
        idx = order[starts[g]:starts[g + 1]]
        rows = np.searchsorted(tok.cu, idx, side="right") - 1
        lengths = np.bincount(rows, minlength=tok.n_seqs).astype(np.int64)
        yield int(values[g]), Tokens(a.take(idx), b.take(idx), lengths, dtypes=tok.dtypes)
