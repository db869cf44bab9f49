"""RouteTrace: per-turn deltas, continuity errors, O(N) bytes, materialized routes."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedRoutes, RouteTrace


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=10), st.integers(2, 300), st.integers(0, 2 ** 31))
def test_deltas_materialize_the_full_trajectory(turn_lens, E, seed):
    rng = np.random.default_rng(seed)
    L, k = 3, 2
    full = rng.integers(0, E, size=(sum(turn_lens), L, k))
    tr = RouteTrace(L, k, E)
    pos = 0
    for n in turn_lens:
        tr.add(full[pos:pos + n], start=pos)
        pos += n
    r = tr.to_routes()
    assert isinstance(r, PackedRoutes) and r.num_seqs == 1
    assert np.array_equal(r.seq(0), full)
    # each position stored once: bytes linear in trajectory length
    assert tr.nbytes == full.shape[0] * L * k * r.values.itemsize
    assert tr.turn_starts == list(np.cumsum([0] + turn_lens[:-1]))


def test_multi_turn_convention_final_token():
    # turn 1: prompt 5 + response 3 -> engine ran 7 positions; turn 2 appends user 4 + response 2 -> runs
    # positions 7..13 (the last sampled token of turn 1 first); trajectory of 14 tokens has 13 route rows.
    tr = RouteTrace(2, 2, 8)
    tr.add(np.zeros((7, 2, 2), np.int32))
    tr.add(np.ones((6, 2, 2), np.int32), start=7)
    tr.check_length(5 + 3 + 4 + 2)
    with pytest.raises(InputError, match="expected 14 or 15"):
        tr.check_length(15)


def test_continuity_errors():
    tr = RouteTrace(2, 2, 8)
    tr.add(np.zeros((4, 2, 2), np.uint8))
    with pytest.raises(InputError, match="routes for 2 tokens are missing") as e:
        tr.add(np.zeros((3, 2, 2), np.uint8), start=6)
    assert e.value.field == "start" and e.value.index == 1
    with pytest.raises(InputError, match="1 overlap"):
        tr.add(np.zeros((3, 2, 2), np.uint8), start=3)
    with pytest.raises(InputError, match="3 layers, trace has 2"):
        tr.add(np.zeros((3, 3, 2), np.uint8))
    with pytest.raises(InputError, match="k=1, trace has k=2"):
        tr.add(np.zeros((3, 2, 1), np.uint8))
    with pytest.raises(InputError, match="expert id 8 >= num_experts 8"):
        tr.add(np.full((3, 2, 2), 8, np.uint8))
    assert tr.num_tokens == 4 and tr.num_turns == 1  # nothing half-added
    # overlap allowed: first recording wins, only new positions appended
    tr.add(np.full((3, 2, 2), 5, np.uint8), start=3, allow_overlap=True)
    r = tr.to_routes()
    assert r.num_tokens == 6 and r.seq(0)[3].max() == 0 and r.seq(0)[4:].min() == 5
