"""The top-K distribution check (gap/topk.py) against an independent float64 computation."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.gap.topk import TopkCheck, TopkLogprobs


def _rows(T, V, seed):
    z = np.random.default_rng(seed).normal(size=(T, V)).astype(np.float32) * 3
    return (z - np.log(np.exp(z.astype(np.float64)).sum(1, keepdims=True))).astype(np.float32)


def _engine(q, k):
    ids = np.argsort(-q, axis=1, kind="stable")[:, :k]
    return TopkLogprobs(ids, np.take_along_axis(q, ids, axis=1))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(4, 60), st.integers(1, 4), st.integers(0, 10**6))
def test_identical_rows_are_bitwise_and_a_one_ulp_change_is_named(T, V, k, seed):
    q = _rows(T, V, seed)
    k = min(k, V)
    eng = _engine(q, k)
    c = TopkCheck(eng)
    c.add(0, q)
    s = c.summary()
    assert s["frac_bitwise"] == 1.0 and s["tv_mean"] == 0.0 and s["kl_mean"] == 0.0
    t, j = seed % T, seed % k
    q2 = q.copy()
    q2[t, eng.ids[t, j]] = np.nextafter(q2[t, eng.ids[t, j]], np.float32(0))
    c2 = TopkCheck(eng)
    c2.add(0, q2[: T // 2 + 1])      # two sequences
    if T // 2 + 1 < T:
        c2.add(T // 2 + 1, q2[T // 2 + 1:])
    s2 = c2.summary()
    assert s2["positions"] == T and s2["frac_bitwise"] == (T - 1) / T
    assert s2["first_mismatch"] == {"position": t, "token_id": int(eng.ids[t, j])}


def test_a_larger_token_outside_the_set_is_not_bitwise_and_tv_kl_match_float64():
    q = _rows(3, 10, 1)
    eng = _engine(q, 3)
    q2 = q.copy()
    outside = int(np.argsort(-q[1])[5])
    q2[1, outside] = q[1].max() + 1.0                    # now belongs in the top-3
    c = TopkCheck(eng)
    c.add(0, q2)
    s = c.summary()
    assert s["frac_bitwise"] == pytest.approx(2 / 3)
    assert s["first_mismatch"] == {"position": 1, "token_id": outside}
    # tv / kl on the engine's ids, renormalized, in float64
    e = eng.values.astype(np.float64)
    qa = np.take_along_axis(q2, eng.ids, axis=1).astype(np.float64)
    pe = np.exp(e) / np.exp(e).sum(1, keepdims=True)
    pq = np.exp(qa) / np.exp(qa).sum(1, keepdims=True)
    assert s["tv_mean"] == pytest.approx((0.5 * np.abs(pe - pq).sum(1)).mean(), abs=1e-7)
    assert s["kl_mean"] == pytest.approx((pe * np.log(pe / pq)).sum(1).mean(), abs=1e-7)


def test_from_dicts_keeps_rank_order_and_refuses_short_rows():
    t = TopkLogprobs.from_dicts([{5: -0.1, 2: -3.0, 9: -1.0}], 2)
    assert t.ids.tolist() == [[5, 9]] and t.values[0].tolist() == pytest.approx([-0.1, -1.0])
    with pytest.raises(InputError, match="1 logprobs returned for K = 2"):
        TopkLogprobs.from_dicts([{1: -0.5}], 2)
    with pytest.raises(InputError, match="same"):
        TopkLogprobs(np.zeros((2, 3), np.int32), np.zeros((2, 2), np.float32))
    with pytest.raises(InputError, match="beyond"):
        TopkCheck(TopkLogprobs(np.zeros((1, 1), np.int32), np.zeros((1, 1)))).add(0, np.zeros((2, 4)))


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 12), st.integers(0, 10**6))
def test_mask_skips_observation_rows_and_names_model_positions(T, seed):
    """Multi-turn: rows outside the mask (observation tokens: ids 0, values NaN) are never read;
    a mismatch is named at its position in the full response stream."""
    rng = np.random.default_rng(seed)
    q = _rows(T, 30, seed)
    eng = _engine(q, 4)
    mask = rng.random(T) < 0.6
    mask[rng.integers(T)] = True
    eng.ids[~mask], eng.values[~mask] = 0, np.nan
    c = TopkCheck(eng, mask=mask)
    c.add(0, q)
    s = c.summary()
    assert s["positions"] == int(mask.sum()) and s["frac_bitwise"] == 1.0 and s["tv_mean"] == 0.0
    t = int(rng.choice(np.flatnonzero(mask)))
    q2 = q.copy()
    q2[t, eng.ids[t, 0]] = np.nextafter(q2[t, eng.ids[t, 0]], np.float32(-np.inf))
    c2 = TopkCheck(eng, mask=mask)
    c2.add(0, q2)
    s2 = c2.summary()
    assert s2["frac_bitwise"] < 1.0
    assert s2["first_mismatch"] == {"position": t, "token_id": int(eng.ids[t, 0])}
