"""The bitwise check behind the bitwise loop's skipped recompute (trainer/old_logprobs.py): it
passes only on identical bits and names the step, sequence and token of the first difference."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.old_logprobs import (check_bitwise, engine_old_logprobs, first_bit_difference,
                                                 recompute_due)


def _rollout(lens, lp, **kw) -> Rollout:
    return Rollout.from_lists([[1, 2]] * len(lens), [[3] * n for n in lens],
                              [list(lp[a:a + n]) for a, n in zip(np.cumsum([0, *lens[:-1]]), lens)], **kw)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=5), st.data())
def test_one_ulp_anywhere_is_named_by_step_sequence_and_token(lens, data):
    n = sum(lens)
    lp = np.asarray(data.draw(st.lists(st.floats(-30, 0, width=32), min_size=n, max_size=n)), np.float32)
    r = _rollout(lens, lp)
    check_bitwise(r.rollout_logprobs.copy(), r, step=4)            # identical bits: passes
    seq = data.draw(st.integers(0, len(lens) - 1))
    tok = data.draw(st.integers(0, lens[seq] - 1))
    at = int(r.response_cu[seq]) + tok
    planted = r.rollout_logprobs.copy()
    planted[at] = np.nextafter(planted[at], np.float32(-np.inf))   # one ulp
    with pytest.raises(InputError) as e:
        check_bitwise(planted, r, step=4)
    assert (e.value.row, e.value.index, e.value.field) == (seq, tok, "rollout_logprobs")
    assert "step 4: bitwise config" in str(e.value) and f"sequence {seq} token {tok}" in str(e.value)


def test_signed_zero_differs_and_observation_tokens_are_skipped():
    r = _rollout([2], np.array([0.0, -1.0], np.float32))
    with pytest.raises(InputError, match="sequence 0 token 0"):
        check_bitwise(np.array([-0.0, -1.0], np.float32), r, step=0)     # equal as floats, not as bits
    # multi-turn: token 1 is an observation (NaN in the engine's logprobs): not compared, and
    # the update's old logprob there reads 0.0
    mt = _rollout([3], np.array([-1.0, np.nan, -2.0], np.float32),
                  loss_mask=[[True, False, True]], turns=[[0, 1, 1]])
    check_bitwise(np.array([-1.0, -7.5, -2.0], np.float32), mt, step=3)
    assert engine_old_logprobs(mt).tolist() == [-1.0, 0.0, -2.0]
    assert first_bit_difference([1.0, 2.0], [1.0, 2.0]) is None
    with pytest.raises(InputError, match="2 recomputed trainer logprobs for 3"):
        check_bitwise(np.zeros(2, np.float32), mt, step=3)


def test_recompute_schedule():
    assert [s for s in range(12) if recompute_due(s, 5)] == [0, 5, 10]
    assert all(recompute_due(s, 1) for s in range(4))
