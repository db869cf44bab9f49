"""The copy task the trained tiny models learn: its continuation, batches and the loop's reward."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skyrl_numerics import copy_task
from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout

prompts = st.lists(st.integers(2, 511), min_size=copy_task.PERIOD, max_size=20)


@given(prompts, st.integers(1, 24))
def test_continuation_repeats_the_last_period_tokens(prompt, n):
    got = copy_task.continuation(prompt, n)
    assert len(got) == n
    assert all(got[i] == prompt[len(prompt) - copy_task.PERIOD + i % copy_task.PERIOD] for i in range(n))


def test_a_prompt_shorter_than_the_period_is_refused():
    with pytest.raises(InputError, match="shorter than the period"):
        copy_task.continuation([5, 6], 3)


@given(st.integers(0, 2**32 - 1))
def test_batch_continuations_follow_their_prefix(seed):
    b = copy_task.make_batch(np.random.default_rng(seed), 6, 24, 512)
    assert b.tokens.shape == b.loss_mask.shape == (6, 24)
    assert b.tokens.min() >= 2 and b.tokens.max() < 512
    for row, mask in zip(b.tokens, b.loss_mask):
        L = int(np.argmax(mask))          # the prefix ends where the scored tokens start
        assert copy_task.PERIOD <= L <= 16 and mask[L:].all() and not mask[:L].any()
        assert (row[L:] == copy_task.continuation(row[:L], 24 - L)).all()


@given(prompts, st.integers(1, 16), st.data())
def test_reward_is_the_share_of_target_tokens(prompt, n, data):
    target = copy_task.continuation(prompt, n)
    wrong = data.draw(st.sets(st.integers(0, n - 1)))
    resp = [int(t) if i not in wrong else int(t) + 1 for i, t in enumerate(target)]
    ro = Rollout.from_lists([prompt, prompt], [resp, target.tolist()], [[-1.0] * n] * 2)
    np.testing.assert_allclose(copy_task.reward(ro), [1 - len(wrong) / n, 1.0])
