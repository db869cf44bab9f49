"""Rollout: construction, validation errors naming row/field, and file round trips."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout


def small(n_tokens=(1, 2, 3)):
    prompts = [[5, 6], [7], [8, 9, 10]][: len(n_tokens)]
    responses = [list(range(11, 11 + n)) for n in n_tokens]
    lps = [[-0.5 - 0.1 * j for j in range(n)] for n in n_tokens]
    return Rollout.from_lists(prompts, responses, lps, sampling={"temperature": 0.7},
                              engine="vllm (cpu)", engine_version="0.32.0")


def test_views_and_lengths():
    r = small()
    assert len(r) == 3
    assert r.response_lens.tolist() == [1, 2, 3]
    assert r.prompt(2).tolist() == [8, 9, 10]
    assert r.response(1).tolist() == [11, 12]
    np.testing.assert_array_equal(r.logprobs(2), np.float32([-0.5, -0.6, -0.7]))
    assert r.num_response_tokens == 6
    assert r.group_ids.tolist() == [0, 1, 2]


@pytest.mark.parametrize("suffix", [".safetensors", ".jsonl"])
def test_round_trip_keeps_everything(tmp_path, suffix):
    r = small().with_trainer_logprobs(np.float32([-0.4, -0.6, -0.7, -1, -2, -3]))
    p = r.save(tmp_path / f"r{suffix}")
    q = Rollout.load(p)
    for f in ("prompt_tokens", "prompt_cu", "response_tokens", "response_cu",
              "rollout_logprobs", "trainer_logprobs", "group_ids"):
        np.testing.assert_array_equal(getattr(q, f), getattr(r, f), err_msg=f)
        assert getattr(q, f).dtype == getattr(r, f).dtype
    assert q.sampling == {"temperature": 0.7}
    assert (q.engine, q.engine_version) == ("vllm (cpu)", "0.32.0")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=6),
       st.sampled_from([".safetensors", ".jsonl"]), st.randoms(use_true_random=False))
def test_round_trip_property(tmp_path_factory, shape, suffix, rnd):
    prompts = [[rnd.randrange(0, 1000) for _ in range(p)] for p, _ in shape]
    responses = [[rnd.randrange(0, 1000) for _ in range(n)] for _, n in shape]
    # float32-representable values so .jsonl (float64 text) round-trips exactly
    lps = [[float(np.float32(-rnd.random() * 10)) for _ in range(n)] for _, n in shape]
    r = Rollout.from_lists(prompts, responses, lps)
    q = Rollout.load(r.save(tmp_path_factory.mktemp("rt") / f"x{suffix}"))
    for i in range(len(r)):
        assert q.prompt(i).tolist() == prompts[i]
        assert q.response(i).tolist() == responses[i]
        np.testing.assert_array_equal(q.logprobs(i), np.float32(lps[i]))


@pytest.mark.parametrize("mutate,field,row", [
    (lambda d: d["logprobs"][1].__setitem__(0, float("nan")), "rollout_logprobs", 1),
    (lambda d: d["logprobs"][2].__setitem__(2, 0.5), "rollout_logprobs", 2),
    (lambda d: d["logprobs"][1].pop(), "logprobs", 1),
    (lambda d: d["prompts"][0].clear(), "prompt_ids", 0),
])
def test_validation_names_row_and_field(mutate, field, row):
    d = {"prompts": [[1, 2], [3], [4]], "responses": [[5], [6, 7], [8, 9, 10]],
         "logprobs": [[-1.0], [-1.0, -2.0], [-1.0, -2.0, -3.0]]}
    mutate(d)
    with pytest.raises(InputError) as e:
        Rollout.from_lists(d["prompts"], d["responses"], d["logprobs"])
    assert e.value.field == field and e.value.row == row, str(e.value)


def test_empty_rollout_rejected():
    with pytest.raises(InputError, match="empty"):
        Rollout.from_lists([], [], [])


def _write_jsonl(path, rows, header=True):
    with open(path, "w") as f:
        if header:
            f.write(json.dumps({"schema": "skyrl-numerics/rollout", "schema_version": 1}) + "\n")
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


GOOD = {"prompt_ids": [1, 2], "response_ids": [3, 4], "logprobs": [-0.1, -0.2]}


@pytest.mark.parametrize("bad,field,row", [
    ({**GOOD, "logprobs": [-0.1]}, "logprobs", 1),
    ({**GOOD, "logprobs": [-0.1, "x"]}, "logprobs", 1),
    ({"prompt_ids": [1], "logprobs": []}, "response_ids", 1),
    ({**GOOD, "response_ids": [3, 4.5]}, "response_ids", 1),
    ({**GOOD, "logprobs": [-0.1, 0.3]}, "rollout_logprobs", 1),
])
def test_jsonl_errors_name_second_row(tmp_path, bad, field, row):
    p = _write_jsonl(tmp_path / "x.jsonl", [GOOD, bad])
    with pytest.raises(InputError) as e:
        Rollout.load(p)
    assert (e.value.field, e.value.row) == (field, row), str(e.value)
    assert "x.jsonl" in str(e.value)


def test_jsonl_not_json_and_wrong_schema(tmp_path):
    with pytest.raises(InputError, match="line 3 is not valid JSON"):
        Rollout.load(_write_jsonl(tmp_path / "a.jsonl", [GOOD, "{oops"]))
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps({"schema": "something-else"}) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(InputError, match="schema"):
        Rollout.load(p)


def test_corrupt_safetensors(tmp_path):
    p = small().save(tmp_path / "r.safetensors")
    data = bytearray(p.read_bytes())
    data[0:8] = (10**12).to_bytes(8, "little")  # header length pointing past the file
    p.write_bytes(bytes(data))
    with pytest.raises(InputError, match="safetensors"):
        Rollout.load(p)


def test_save_is_atomic_on_failure(tmp_path):
    class Boom:
        def to_arrays(self):
            raise RuntimeError("boom")
        seq_lens = np.array([3, 3, 6])
    r = small()
    r.routes = Boom()
    target = tmp_path / "r.safetensors"
    with pytest.raises(RuntimeError):
        r.save(target)
    assert list(tmp_path.iterdir()) == []
