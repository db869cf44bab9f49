"""The full-vocabulary logits digest (gap/digest.py): what it hashes, that any one-bit change of a
row changes it, that memory layout does not, and the check's figures and first mismatch."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.gap.digest import (DIGEST_BYTES, DigestCheck, LogitsDigests,
                                       first_differing_id, row_digest, row_digests)
from skyrl_numerics.hashing import DIGEST_ALGOS, hasher

# xxh3-128 where xxhash is installed (the cpu/gpu/dev extras); blake2b-128 always
ALGOS = [a for a in DIGEST_ALGOS if a != "xxh3-128" or importlib.util.find_spec("xxhash")]


def _rows(T, V, seed):
    return (np.random.default_rng(seed).normal(size=(T, V)) * 4).astype(np.float32)


@pytest.mark.parametrize("algo", ALGOS)
def test_the_digest_is_the_hash_of_the_rows_little_endian_float32_bytes(algo):
    row = _rows(1, 37, 0)[0]
    h = hasher(algo)
    h.update(row.astype("<f4").tobytes())
    assert row_digest(row, algo) == h.digest() and len(h.digest()) == DIGEST_BYTES
    # bf16 logits hash as their exact float32 values (what vLLM's sampler converts them to)
    t = torch.from_numpy(_rows(3, 37, 1)).to(torch.bfloat16)
    assert (row_digests(t, algo) == row_digests(t.float().numpy(), algo)).all()
    be = row.astype(">f4")          # same values, other byte order: same digest
    assert row_digest(be, algo) == row_digest(row, algo)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(0, 10**6), st.data())
def test_any_single_bit_change_of_a_row_changes_its_digest(V, seed, data):
    algo = data.draw(st.sampled_from(ALGOS))
    row = _rows(1, V, seed)[0]
    j = data.draw(st.integers(0, V - 1))
    bit = data.draw(st.integers(0, 31))
    flipped = row.copy()
    flipped.view(np.uint32)[j] ^= np.uint32(1 << bit)
    assert row_digest(flipped, algo) != row_digest(row, algo)
    assert first_differing_id(row, flipped) == j


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(1, 64), st.integers(0, 10**6))
def test_the_same_rows_give_the_same_digests_whatever_the_memory_layout(T, V, seed):
    rows = _rows(T, V, seed)
    want = row_digests(rows, "blake2b-128")
    wide = np.zeros((T, 2 * V + 3), np.float32)
    wide[:, 1:2 * V + 1:2] = rows                          # strided view
    assert (row_digests(wide[:, 1:2 * V + 1:2], "blake2b-128") == want).all()
    assert (row_digests(np.asfortranarray(rows), "blake2b-128") == want).all()
    tt = torch.from_numpy(rows.T.copy()).t()               # transposed torch view
    assert not tt.is_contiguous() or min(T, V) == 1
    assert (row_digests(tt, "blake2b-128") == want).all()
    for t in range(T):
        assert row_digest(rows[t], "blake2b-128") == want[t].tobytes()


def test_the_check_counts_equal_rows_and_names_the_first_mismatch():
    rows = _rows(7, 50, 3)
    eng = LogitsDigests(row_digests(rows, "blake2b-128"), "blake2b-128")
    c = DigestCheck(eng)
    c.add(0, rows[:4])
    c.add(4, torch.from_numpy(rows[4:]))
    s = c.summary()
    assert s == {"algo": "blake2b-128", "positions": 7, "frac_bitwise": 1.0,
                 "first_mismatch": None}
    bad = rows.copy()
    bad[5, 17] = np.nextafter(bad[5, 17], np.float32(np.inf))     # one ulp of one logit
    bad[6, 2] = -bad[6, 2]
    c = DigestCheck(eng)
    c.add(0, bad[:3])
    c.add(3, bad[3:])
    s = c.summary()
    assert s["frac_bitwise"] == pytest.approx(5 / 7) and s["positions"] == 7
    assert s["first_mismatch"]["position"] == 5 and s["first_mismatch"]["token_id"] is None
    assert "digest" in s["first_mismatch"]["token_id_unknown"]
    c.name_token(rows[5])                          # the engine's row: the id is named
    assert c.first_mismatch["token_id"] == 17 and "token_id_unknown" not in c.first_mismatch
    assert c.first_mismatch["engine_logit"] == float(rows[5, 17])
    with pytest.raises(InputError, match="position 5"):   # not the row the engine hashed
        c.name_token(bad[5])


def test_bad_input_names_the_field():
    with pytest.raises(InputError, match="logits_digest"):
        LogitsDigests(np.zeros((3, 8), np.uint8), "blake2b-128")
    with pytest.raises(InputError, match="unknown digest algorithm"):
        LogitsDigests(np.zeros((3, 16), np.uint8), "md5")
    c = DigestCheck(LogitsDigests(np.zeros((2, 16), np.uint8), "blake2b-128"))
    with pytest.raises(InputError, match="beyond the engine's 2 digests"):
        c.add(1, _rows(2, 5, 0))
    with pytest.raises(InputError, match="floating point"):
        row_digests(np.zeros((2, 3), np.int32), "blake2b-128")
    with pytest.raises(InputError, match="algorithms"):
        LogitsDigests.concat([LogitsDigests(np.zeros((1, 16), np.uint8), "blake2b-128"),
                              LogitsDigests(np.zeros((1, 16), np.uint8), "xxh3-128")])


def test_mask_compares_model_tokens_only_and_names_their_position():
    """Multi-turn: observation rows (zero digests, never sampled) are skipped; a mismatch is named
    at its position in the whole response stream; the token id of a masked trainer row is found."""
    rows = _rows(8, 40, 5)
    d = row_digests(rows, "blake2b-128")
    mask = np.array([1, 1, 0, 0, 1, 0, 1, 1], bool)
    d[~mask] = 0
    eng = LogitsDigests(d, "blake2b-128")
    c = DigestCheck(eng, mask=mask)
    c.add(0, rows[:3])
    c.add(3, rows[3:])
    assert c.summary()["positions"] == 5 and c.summary()["frac_bitwise"] == 1.0
    bad = rows.copy()
    bad[2, 0] += 1.0                                  # an observation row: not read
    bad[6, 9] = np.nextafter(bad[6, 9], np.float32(-np.inf))
    c = DigestCheck(eng, mask=mask)
    c.add(0, bad[:5])
    c.add(5, bad[5:])
    s = c.summary()
    assert s["frac_bitwise"] == pytest.approx(4 / 5) and s["first_mismatch"]["position"] == 6
    c.name_token(rows[6])
    assert c.first_mismatch["token_id"] == 9
