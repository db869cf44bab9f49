"""Multi-turn trajectories in Rollout (issue 28): loss_mask / turns, NaN logprobs at observation
tokens, round trips through both file formats, old files, and strict refusal naming row/turn/field/index."""
from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import SCHEMA_VERSION, Rollout

NAN = math.nan
# row 0: turn 0 = model [11, 12]; turn 1 = observation [13, 14] + model [15]
# row 1: turn 0 = observation [20] + model [21]; turn 1 = model [22] (no observation)
# row 2: turn 0 = model [30]
PROMPTS = [[1, 2], [3], [4, 5]]
RESP = [[11, 12, 13, 14, 15], [20, 21, 22], [30]]
MASK = [[True, True, False, False, True], [False, True, True], [True]]
TURNS = [[0, 0, 1, 1, 1], [0, 0, 1], [0]]
LPS = [[-0.5, -0.25, None, None, -1.0], [None, -2.0, -0.125], [-3.0]]


def multi(**kw):
    d = dict(loss_mask=MASK, turns=TURNS, sampling={"temperature": 1.0}, engine="vllm (cpu)")
    d.update(kw)
    return Rollout.from_lists(PROMPTS, RESP, LPS, **d)


def _same(a: Rollout, b: Rollout):
    for f in ("prompt_tokens", "prompt_cu", "response_tokens", "response_cu", "rollout_logprobs",
              "trainer_logprobs", "group_ids", "loss_mask", "turns"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), f
    assert (a.sampling, a.meta, a.engine, a.engine_version, a.vocab_size) == \
        (b.sampling, b.meta, b.engine, b.engine_version, b.vocab_size)


def test_views():
    r = multi()
    assert r.is_multi_turn and r.loss_mask.dtype == np.bool_ and r.turns.dtype == np.int32
    np.testing.assert_array_equal(r.num_turns, [2, 2, 1])
    assert [r.turn_starts(i).tolist() for i in range(3)] == [[0, 4], [1, 2], [0]]
    lp = r.rollout_logprobs
    assert np.isnan(lp[~r.loss_mask]).all() and np.isfinite(lp[r.loss_mask]).all()
    # the trainer scores the whole stream: its observation values become NaN
    t = r.with_trainer_logprobs(np.full(9, -0.75, np.float32))
    np.testing.assert_array_equal(np.isnan(t.trainer_logprobs), ~r.loss_mask)


def test_single_turn_defaults():
    r = Rollout.from_lists([[1]], [[2, 3]], [[-1.0, -2.0]])
    assert not r.is_multi_turn and r.loss_mask is None and r.turns is None
    assert r.model_mask.tolist() == [True, True] and r.turn_index.tolist() == [0, 0]
    assert r.num_turns.tolist() == [1] and r.turn_starts(0).tolist() == [0]


@pytest.mark.parametrize("suffix", [".safetensors", ".jsonl"])
def test_round_trip(tmp_path, suffix):
    r = multi().with_trainer_logprobs(np.float32([-0.5, -0.5, -1, -1, -1, -2, -2, -0.25, -3]))
    p = r.save(tmp_path / f"m{suffix}")
    _same(Rollout.load(p), r)
    if suffix == ".jsonl":
        lines = [json.loads(x) for x in p.read_text().splitlines()]
        assert lines[0]["schema_version"] == SCHEMA_VERSION == 2
        assert lines[1]["logprobs"][2:4] == [None, None] and lines[1]["loss_mask"][2] is False


@st.composite
def trajectories(draw):
    """Rows of turns: each turn 0..3 observation tokens then 1..3 model tokens (or an empty row)."""
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        resp, mask, turns = [], [], []
        for t in range(draw(st.integers(0, 4))):
            n_obs, n_model = draw(st.integers(0, 3)), draw(st.integers(1, 3))
            resp += draw(st.lists(st.integers(0, 999), min_size=n_obs + n_model, max_size=n_obs + n_model))
            mask += [False] * n_obs + [True] * n_model
            turns += [t] * (n_obs + n_model)
        rows.append((resp, mask, turns))
    return rows


@settings(max_examples=40, deadline=None)
@given(trajectories(), st.sampled_from([".safetensors", ".jsonl"]), st.randoms(use_true_random=False),
       st.booleans())
def test_round_trip_property(tmp_path_factory, rows, suffix, rnd, with_trainer):
    lps = [[float(np.float32(-rnd.random() * 10)) if m else None for m in mask] for _, mask, _ in rows]
    kw = {}
    if with_trainer:
        kw["trainer_logprobs"] = [[float(np.float32(-rnd.random())) if m else NAN for m in mask]
                                  for _, mask, _ in rows]
    r = Rollout.from_lists([[1]] * len(rows), [x[0] for x in rows], lps,
                           loss_mask=[x[1] for x in rows], turns=[x[2] for x in rows], **kw)
    q = Rollout.load(r.save(tmp_path_factory.mktemp("rt") / f"x{suffix}"))
    _same(q, r)
    for i, (resp, mask, turns) in enumerate(rows):
        starts = [j for j, m in enumerate(mask) if m and (j == 0 or not mask[j - 1] or turns[j - 1] != turns[j])]
        assert q.turn_starts(i).tolist() == starts
        assert q.num_turns[i] == (turns[-1] + 1 if turns else 0)


@pytest.mark.parametrize("suffix", [".safetensors", ".jsonl"])
def test_version_1_files_load_as_single_turn(tmp_path, suffix):
    r = Rollout.from_lists([[1, 2], [3]], [[4, 5], [6]], [[-1.0, -0.5], [-2.0]])
    p = r.save(tmp_path / f"old{suffix}")
    if suffix == ".jsonl":
        lines = p.read_text().splitlines()
        h = json.loads(lines[0])
        h.pop("digest")
        h["schema_version"] = 1
        p.write_text("\n".join([json.dumps(h)] + lines[1:]) + "\n")
    else:
        _rewrite_safetensors(p, meta={"schema_version": "1"})
    q = Rollout.load(p)
    _same(q, r)
    assert not q.is_multi_turn and q.num_turns.tolist() == [1, 1]


def _rewrite_safetensors(path, arrays=None, meta=None):
    from safetensors import safe_open
    from safetensors.numpy import save_file
    with safe_open(str(path), "np") as f:
        m = dict(f.metadata())
        a = {k: f.get_tensor(k) for k in f.keys()}
    m.pop("digest", None)
    a.update(arrays or {})
    a = {k: v for k, v in a.items() if v is not None}
    m.update(meta or {})
    save_file(a, str(path), metadata=m)


def _flat(rows, dtype):
    return np.array([x for r in rows for x in r], dtype)


M, T = _flat(MASK, bool), _flat(TURNS, np.int32)
LP = np.array([NAN if x is None else x for r in LPS for x in r], np.float32)


def _with(i, v, a):
    a = a.copy()
    a[i] = v
    return a


# (change, row, turn, field, index); flat token k: row 0 = 0..4, row 1 = 5..7, row 2 = 8
@pytest.mark.parametrize("kw,row,turn,field,index", [
    (dict(loss_mask=_with(1, False, M)), 0, 0, "loss_mask", 1),        # observation after model, same turn
    (dict(loss_mask=_with(3, True, M)), 0, 1, "rollout_logprobs", 3),  # a model token without a logprob
    (dict(loss_mask=_with(8, False, M)), 2, 0, "loss_mask", 0),        # turn without a model token
    (dict(rollout_logprobs=_with(3, -1.0, LP)), 0, 1, "rollout_logprobs", 3),   # value at an observation
    (dict(rollout_logprobs=_with(4, NAN, LP)), 0, 1, "rollout_logprobs", 4),    # NaN at a model token
    (dict(rollout_logprobs=_with(6, np.inf, LP)), 1, 0, "rollout_logprobs", 1),
    (dict(rollout_logprobs=_with(7, 0.5, LP)), 1, 1, "rollout_logprobs", 2),    # positive
    (dict(turns=_with(5, 1, T)), 1, 1, "turns", 0),                      # row starts at turn 1
    (dict(turns=_with(4, 2, T)), 0, 1, "loss_mask", 3),                 # turn 1 left with observations only
    (dict(turns=_with(2, 2, T)), 0, 2, "turns", 2),                      # jump 0 -> 2
    (dict(turns=_with(3, 0, T)), 0, 0, "turns", 3),                     # decreases 1 -> 0
    (dict(turns=_with(1, 1, T)), 0, 1, "loss_mask", 2),                 # model then observation in turn 1
    (dict(turns=_with(6, 2, T)), 1, 2, "turns", 1),
    (dict(turns=_with(2, -1, T)), 0, None, "turns", 2),                 # negative
    (dict(turns=T.astype(np.float64)), None, None, "turns", None),      # floats are not turn indices
    (dict(turns=T.astype(bool)), None, None, "turns", None),
    (dict(loss_mask=M.astype(np.float32)), None, None, "loss_mask", None),
    (dict(loss_mask=_with(0, 2, M.astype(np.int64))), 0, None, "loss_mask", 0),
    (dict(loss_mask=M[:-1]), None, None, "loss_mask", None),            # length
    (dict(turns=None), None, None, "turns", None),                       # one without the other
    (dict(loss_mask=None), None, None, "loss_mask", None),
])
def test_constructor_is_strict(kw, row, turn, field, index):
    d = {f: getattr(multi(), f) for f in Rollout.__dataclass_fields__}
    d.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError) as e:
            Rollout(**d)
    err = e.value
    assert (err.row, err.turn, err.field) == (row, turn, field), str(err)
    if index is not None:
        assert err.index == index, str(err)
    if turn is not None:
        assert f"turn {turn}" in str(err)


def _hdr(version=2):
    return json.dumps({"schema": "skyrl-numerics/rollout", "schema_version": version})


GOOD = {"prompt_ids": [1], "response_ids": [3, 4, 5], "logprobs": [-0.5, None, -1.0],
        "loss_mask": [True, False, True], "turns": [0, 1, 1]}


@pytest.mark.parametrize("row_,field,turn,index,version", [
    ({**GOOD, "loss_mask": [1, 0, 1]}, "loss_mask", None, 0, 2),                  # 0/1 are not JSON booleans
    ({**GOOD, "turns": [0, True, 1]}, "turns", None, 1, 2),
    ({**GOOD, "turns": [0, 1.0, 1]}, "turns", None, 1, 2),
    ({**GOOD, "turns": [0, 1]}, "turns", None, None, 2),
    ({**GOOD, "loss_mask": "yes"}, "loss_mask", None, None, 2),
    ({**GOOD, "logprobs": [-0.5, -0.1, -1.0]}, "logprobs", 1, 1, 2),              # value at an observation
    ({**GOOD, "logprobs": [None, None, -1.0]}, "logprobs", 0, 0, 2),              # null at a model token
    ({k: v for k, v in GOOD.items() if k != "turns"}, "turns", None, None, 2),
    ({**GOOD, "turns": [0, 0, 1]}, "loss_mask", 0, 1, 2),
    ({**GOOD, "turns": [0, 2, 2]}, "turns", 2, 1, 2),
    (GOOD, "loss_mask", None, None, 1),                                          # not in version 1
    ({**GOOD, "logprobs": [-0.5, None, -1.0], "loss_mask": None, "turns": None}, "loss_mask", None, None, 2),
])
def test_jsonl_strict(tmp_path, row_, field, turn, index, version):
    p = tmp_path / "t.jsonl"
    p.write_text(_hdr(version) + "\n" + json.dumps({"prompt_ids": [1], "response_ids": [2], "logprobs": [-1.0],
                                                    "loss_mask": [True], "turns": [0]}) + "\n"
                 + json.dumps(row_) + "\n")
    if version == 1:         # the first row must not be the one refused
        lines = p.read_text().splitlines()
        p.write_text("\n".join([lines[0], lines[2]]) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError) as e:
            Rollout.load(p)
    err = e.value
    assert "t.jsonl" in str(err) and "\n" not in str(err)
    assert (err.field, err.turn) == (field, turn), str(err)
    assert err.row == (0 if version == 1 else 1), str(err)
    if index is not None:
        assert err.index == index, str(err)


def test_jsonl_turn_fields_in_every_row_or_none(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_text(_hdr() + "\n" + json.dumps(GOOD) + "\n"
                 + json.dumps({"prompt_ids": [1], "response_ids": [2], "logprobs": [-1.0]}) + "\n")
    with pytest.raises(InputError) as e:
        Rollout.load(p)
    assert (e.value.row, e.value.field) == (1, "loss_mask"), str(e.value)


@pytest.mark.parametrize("arrays,meta,field", [
    ({"loss_mask": M.astype(np.uint8)}, None, "loss_mask"),                    # dtype
    ({"turns": T.astype(np.int64)}, None, "turns"),
    ({"turns": None}, None, "turns"),                                          # one without the other
    ({"loss_mask": np.ones((9, 1), bool)}, None, "loss_mask"),
    ({"turns": _with(2, 0, T)}, None, "loss_mask"),                           # observation after model
    ({"rollout_logprobs": _with(2, -0.5, LP)}, None, "rollout_logprobs"),
    (None, {"schema_version": "1"}, "loss_mask"),                              # not in version 1
])
def test_safetensors_strict(tmp_path, arrays, meta, field):
    p = multi().save(tmp_path / "m.safetensors")
    _rewrite_safetensors(p, arrays, meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError) as e:
            Rollout.load(p)
    assert "m.safetensors" in str(e.value) and e.value.field == field, str(e.value)


# ---- single-value edits of a saved multi-turn file: refused (or, for a turn index edited into
# another valid trajectory without the digest, loaded as that) ------------------------------------
@settings(max_examples=120, deadline=None)
@given(st.data())
def test_jsonl_per_token_edit_refused(tmp_path_factory, data):
    r = multi().with_trainer_logprobs(np.float32([-0.5, -0.5, -1, -1, -1, -2, -2, -0.25, -3]))
    p = r.save(tmp_path_factory.mktemp("e") / "e.jsonl")
    lines = p.read_text().splitlines()
    li = data.draw(st.integers(1, len(lines) - 1))
    obj = json.loads(lines[li])
    key = data.draw(st.sampled_from(["loss_mask", "turns", "logprobs", "trainer_logprobs"]))
    j = data.draw(st.integers(0, len(obj[key]) - 1))
    old = obj[key][j]
    if key == "loss_mask":
        new = not old
    elif key == "turns":
        new = old + data.draw(st.sampled_from([-1, 1]))
    else:
        new = None if old is not None else -0.5
    obj[key][j] = new
    lines[li] = json.dumps(obj)
    drop_digest = data.draw(st.booleans())
    if drop_digest:
        h = json.loads(lines[0])
        h.pop("digest")
        lines[0] = json.dumps(h)
    p.write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            q = Rollout.load(p)
        except InputError as e:
            assert "\n" not in str(e) and "e.jsonl" in str(e)
            return
    # loaded: only a turn index, without the digest, can make another valid trajectory
    assert drop_digest and key == "turns", (key, j, old, new)
    assert q.turns.tolist() != r.turns.tolist()


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_safetensors_bit_flip_refused_or_identical(tmp_path_factory, data):
    r = multi()
    p = r.save(tmp_path_factory.mktemp("f") / "f.safetensors")
    raw = bytearray(p.read_bytes())
    raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    p.write_bytes(bytes(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            q = Rollout.load(p)
        except InputError as e:
            assert "\n" not in str(e) and "f.safetensors" in str(e)
            return
    _same(q, r)
