"""PackedIndex (replay/index.py): the DSA indexer's choices packed, bit-packed, validated, and
carried by a Rollout file. numpy only; the engine/trainer equality is
tests/e2e/test_deepseek_v32_vllm.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedIndex
from skyrl_numerics.replay.index import bytes_per_token, implied_rows
from skyrl_numerics.rollout import Rollout


def _choices(rng, n_tokens: int, layers: int, topk: int) -> np.ndarray:
    """Rows of positions 0 .. n_tokens - 2 as the indexer makes them: every visible key below
    topk, then topk distinct ascending keys <= p."""
    rows = np.zeros((max(0, n_tokens - 1), layers, topk), np.int64)
    for p in range(rows.shape[0]):
        for l in range(layers):
            if p < topk:
                rows[p, l] = implied_rows(p + 1, topk)[p]
            else:
                rows[p, l] = np.sort(rng.choice(p + 1, topk, replace=False))
    return rows


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(1, 3),
       st.integers(1, 9), st.integers(0, 2 ** 32 - 1), st.booleans())
def test_round_trip_bitpacked_and_full_rows(lens, layers, topk, seed, bitpack):
    rng = np.random.default_rng(seed)
    seqs = [_choices(rng, n, layers, topk) for n in lens]
    idx = PackedIndex.from_sequences(seqs, topk)
    assert idx.rows.num_experts == max([1] + [s.shape[0] for s in seqs])   # positions < bound
    back = PackedIndex.from_bytes(idx.to_bytes(bitpack=bitpack))
    assert back == idx
    for b, s in enumerate(seqs):
        assert idx.seq(b).shape[0] == max(0, s.shape[0] - topk)
        assert np.array_equal(idx.full_rows(b, s.shape[0]), s)
    assert PackedIndex.concat([idx, idx]).seq(len(lens)).tobytes() == idx.seq(0).tobytes()


def test_bitpacked_size_is_the_documented_cost():
    rng = np.random.default_rng(0)
    seq = _choices(rng, 301, 2, 16)                  # positions < 300: 9 bits each
    idx = PackedIndex.from_sequences([seq], 16)
    rows = 300 - 16
    assert idx.nbytes(bitpack=True) - idx.nbytes(bitpack=False) < 0
    assert abs(idx.rows.to_buffer(bitpack=True).nbytes - 64 * 2 - rows * 2 * 16 * 9 / 8) < 64
    # DeepSeek-V3.2: 61 indexer layers x index_topk 2048, 128 Ki context (17 bits)
    assert bytes_per_token(61, 2048, 1 << 17) == 265_472
    assert bytes_per_token(61, 2048, 1 << 13) == 203_008


def test_refuses_rows_the_indexer_cannot_make():
    rng = np.random.default_rng(1)
    seq = _choices(rng, 30, 1, 4)
    bad = seq.copy()
    bad[2, 0, 3] = 1                  # position 2 < topk must read keys 0, 1, 2 and zeros
    with pytest.raises(InputError, match="visible keys"):
        PackedIndex.from_sequences([bad], 4)
    bad = seq.copy()
    bad[10, 0] = [1, 2, 3, 11]        # key 11 after query 10: not causal
    with pytest.raises(InputError, match="causal"):
        PackedIndex.from_sequences([bad], 4)
    bad = seq.copy()
    bad[10, 0] = [1, 2, 2, 5]         # a key twice
    with pytest.raises(InputError, match="ascending"):
        PackedIndex.from_sequences([bad], 4)


def test_rollout_carries_checks_and_saves_the_choices(tmp_path):
    rng = np.random.default_rng(2)
    prompts, responses = [[1] * 20, [2] * 5], [[3] * 6, [4] * 2]
    seqs = [_choices(rng, len(p) + len(r), 2, 8) for p, r in zip(prompts, responses)]
    idx = PackedIndex.from_sequences(seqs, 8)
    ro = Rollout.from_lists(prompts, responses, [[0.0] * len(r) for r in responses], index=idx)
    assert Rollout.load(ro.save(tmp_path / "r.safetensors")).index == idx
    with pytest.raises(InputError, match="index"):
        ro.save(tmp_path / "r.jsonl")
    short = PackedIndex.from_sequences([seqs[0][:-1], seqs[1]], 8)
    with pytest.raises(InputError) as e:
        Rollout.from_lists(prompts, responses, [[0.0] * len(r) for r in responses], index=short)
    assert e.value.field == "index" and e.value.row == 0
