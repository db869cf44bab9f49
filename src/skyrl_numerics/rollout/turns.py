"""Multi-turn trajectories in a :class:`~skyrl_numerics.rollout.Rollout`: the checks on its two
per-token arrays and the views built on them.

The response stream of a row interleaves model tokens (sampled by the engine, trained on) and
observation tokens (environment / tool output, fed to the model, never trained on). Two arrays,
ragged like the other per-token arrays (one entry per response token, addressed by
``response_cu``), describe it:

* ``loss_mask`` bool: True on a model token, False on an observation token;
* ``turns`` int32: the turn each token belongs to.

A turn is zero or more observation tokens followed by one model segment (at least one model
token): within a row the turn index starts at 0 and steps by 0 or 1 from token to token, and
within a turn no observation token follows a model token. The model segment of turn k starts at
the turn's first model token (:func:`turn_starts`). Observation tokens after a row's last model
segment would be a turn without a model token and are refused.

Logprobs exist for model tokens only: ``rollout_logprobs`` and ``trainer_logprobs`` hold NaN
exactly at the observation tokens (``null`` in ``.jsonl``) and a finite logprob (<= 0) exactly at
the model tokens. A rollout without the two arrays (every file of ``schema_version`` 1) is
single-turn: every response token a model token of turn 0.
"""
from __future__ import annotations

import numpy as np

from skyrl_numerics.errors import InputError

TURN_FIELDS = ("loss_mask", "turns")


def bool_array(x, name: str) -> np.ndarray:
    """1-D bool array; integer arrays must hold only 0/1 (floats, and other integers, refused)."""
    from skyrl_numerics.rollout.arrays import first_index, as_numpy

    arr = as_numpy(x)
    if arr.ndim != 1:
        raise InputError(f"expected a 1-D array, got shape {arr.shape}", field=name)
    if arr.dtype == np.bool_:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":
            return np.zeros(0, np.bool_)
        raise InputError(f"dtype {arr.dtype} is not bool (a mask is bool, or integers 0/1)", field=name)
    bad = (arr != 0) & (arr != 1)
    if bad.any():
        i = first_index(bad)
        raise InputError(f"value {int(arr[i])} is not 0/1", field=name, index=i)
    return arr.astype(np.bool_)


def check_turns(cu: np.ndarray, mask: np.ndarray, turns: np.ndarray, err) -> None:
    """Raise (through ``err(msg, **where)``) at the first break of the turn structure; ``mask``
    and ``turns`` are 1-D bool / int32 arrays of ``cu[-1]`` entries (shapes checked before)."""
    n = int(cu[-1])
    if n == 0:
        return
    lens = np.diff(cu)
    ne = np.flatnonzero(lens > 0)
    first = cu[:-1][ne]

    def where(k: int, field: str) -> dict:
        row = int(np.searchsorted(cu, k, side="right") - 1)
        return dict(row=row, turn=int(turns[k]), field=field, index=int(k - cu[row]))

    bad = turns[first] != 0
    if bad.any():
        k = int(first[np.flatnonzero(bad)[0]])
        raise err(f"turn index {int(turns[k])} at the row's first response token, expected 0", **where(k, "turns"))
    # within a row (pairs k-1, k with k not a row start): steps of 0 or 1
    same_row = np.ones(n, bool)
    same_row[first] = False
    step = np.empty(n, np.int64)
    step[0] = 0
    np.subtract(turns[1:], turns[:-1], out=step[1:], dtype=np.int64)
    bad = same_row & ((step < 0) | (step > 1))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        a, b = int(turns[k - 1]), int(turns[k])
        what = "decreases" if b < a else f"jumps (turn {a + 1} would have no token)"
        raise err(f"turn index {what}: {a} -> {b}; turn indices step by 0 or 1", **where(k, "turns"))
    # within a turn: an observation token after a model token
    same_turn = same_row & (step == 0)
    bad = same_turn & ~mask & np.concatenate([[False], mask[:-1]])
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise err("observation token after the turn's model segment (a turn is observation "
                  "tokens, then model tokens)", **where(k, "loss_mask"))
    # every turn ends with a model token (so it has one): its last token is a model token
    last = np.ones(n, bool)
    last[:-1] = ~same_turn[1:]
    bad = last & ~mask
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise err(f"turn {int(turns[k])} has no model token (loss_mask false on all its tokens)",
                  **where(k, "loss_mask"))


def check_masked_logprobs(lp: np.ndarray, cu: np.ndarray, mask, turns, name: str, tol: float, err) -> None:
    """Logprob values: finite and <= ``tol`` on model tokens, NaN on observation tokens
    (every token a model token when ``mask`` is None)."""
    if mask is None:
        bad = ~np.isfinite(lp)
        kind = "not finite"
    else:
        fin = np.isfinite(lp)
        bad = mask & ~fin
        kind = "not finite (a model token has a logprob)"
        wrong_obs = ~mask & ~np.isnan(lp)
        if wrong_obs.any() and (not bad.any() or np.flatnonzero(wrong_obs)[0] < np.flatnonzero(bad)[0]):
            bad, kind = wrong_obs, "at an observation token (loss_mask false): must be NaN (null in .jsonl)"
    if not bad.any():
        with np.errstate(invalid="ignore"):
            bad = lp > tol
        kind = "positive (a logprob must be <= 0)"
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        row = int(np.searchsorted(cu, i, side="right") - 1)
        raise err(f"value {lp[i]!r} is {kind}", row=row, field=name, index=int(i - cu[row]),
                  turn=None if turns is None else int(turns[i]))


def turn_starts(cu: np.ndarray, mask, turns, i: int) -> np.ndarray:
    """Offsets, within row ``i``'s response, of each turn's first model token (int64 [turns])."""
    a, b = int(cu[i]), int(cu[i + 1])
    if b == a:
        return np.zeros(0, np.int64)
    if mask is None:
        return np.zeros(1, np.int64)
    m, t = mask[a:b], turns[a:b]
    prev_obs = np.concatenate([[True], ~m[:-1] | (t[1:] != t[:-1])])
    return np.flatnonzero(m & prev_obs).astype(np.int64)


def num_turns(cu: np.ndarray, turns) -> np.ndarray:
    """Turns per row (int64 [B]; 0 for an empty response, 1 for a single-turn rollout)."""
    lens = np.diff(cu)
    if turns is None:
        return (lens > 0).astype(np.int64)
    out = np.zeros(len(lens), np.int64)
    ne = lens > 0
    out[ne] = turns[cu[1:][ne] - 1].astype(np.int64) + 1
    return out
