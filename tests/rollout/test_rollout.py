"""Rollout: construction, validation errors naming row/field, and file round trips."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

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
    ({**GOOD, "logprobs": [-0.1, 0.3]}, "logprobs", 1),
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


# ---- strict IO (issue 13) ---------------------------------------------------------------------
import warnings

from skyrl_numerics.cli import main as cli_main
from skyrl_numerics.replay import PackedSupport


def _full(tmp_path=None):
    r = small().with_trainer_logprobs(np.float32([-0.4, -0.6, -0.7, -1, -2, -3]))
    r.group_ids = np.array([0, 0, 1], np.int64)
    return r


def _same(a: Rollout, b: Rollout):
    for f in ("prompt_tokens", "prompt_cu", "response_tokens", "response_cu", "rollout_logprobs",
              "trainer_logprobs", "group_ids"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), f
    assert (a.sampling, a.meta, a.engine, a.engine_version, a.vocab_size) == \
        (b.sampling, b.meta, b.engine, b.engine_version, b.vocab_size)
    assert (a.support is None) == (b.support is None) and (a.support is None or a.support == b.support)


@pytest.mark.parametrize("kw,field,row,index", [
    (dict(response_tokens=np.array([11, 2 ** 32 + 4, 12, 13, 14, 15])), "response_tokens", 1, 0),  # no wrap to 4
    (dict(response_tokens=np.array([11, 12, 13, 14, 15, -1])), "response_tokens", 2, 2),
    (dict(prompt_tokens=np.array([5, 6, 7, 8, 9, 10.0])), "prompt_tokens", None, None),         # float ids
    (dict(prompt_tokens=np.array([True] * 6)), "prompt_tokens", None, None),                  # bool ids
    (dict(prompt_cu=np.array([0, 2, 3, 6.0])), "prompt_cu", None, None),                      # float cu
    (dict(response_cu=np.array([0, 1, 3, 6], np.uint64) + np.uint64(2 ** 63)), "response_cu", None, 0),
    (dict(group_ids=np.array([0.0, 1.0, 2.0])), "group_ids", None, None),
    (dict(group_ids=np.array([True, False, True])), "group_ids", None, None),
    (dict(prompt_tokens=np.array([[5, 6, 7], [8, 9, 10]])), "prompt_tokens", None, None),      # 2-D
    (dict(rollout_logprobs=np.array([-0.5, -1e300, -0.6, -0.7, -0.8, -0.9])), "rollout_logprobs", 1, 0),
    (dict(prompt_cu=np.array([1, 2, 3, 6])), "prompt_cu", None, 0),
    (dict(prompt_cu=np.array([0, 4, 3, 6])), "prompt_cu", 1, 2),
    (dict(vocab_size=12), "response_tokens", 1, 1),
    (dict(vocab_size=True), "vocab_size", None, None),
])
def test_constructor_is_strict(kw, field, row, index):
    d = {f: getattr(small(), f) for f in Rollout.__dataclass_fields__}
    d.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # no numpy cast/overflow warnings either
        with pytest.raises(InputError) as e:
            Rollout(**d)
    assert e.value.field == field, str(e.value)
    if row is not None:
        assert e.value.row == row, str(e.value)
    if index is not None:
        assert e.value.index == index, str(e.value)
    assert "\n" not in str(e.value)


def test_from_lists_does_not_truncate():
    with pytest.raises(InputError) as e:
        Rollout.from_lists([[1, 2.5]], [[3]], [[-1.0]])
    assert e.value.field == "prompt_tokens"
    with pytest.raises(InputError):
        Rollout.from_lists([[1, True]], [[3]], [[-1.0]])
    with pytest.raises(InputError):
        Rollout.from_lists([[1]], [[3]], [["x"]])
    with pytest.raises(InputError) as e:
        Rollout.from_lists([[1]], [[2 ** 31]], [[-1.0]])
    assert (e.value.field, e.value.row, e.value.index) == ("response_tokens", 0, 0)


@pytest.mark.parametrize("suffix", [".safetensors", ".jsonl"])
def test_vocab_and_support_round_trip(tmp_path, suffix):
    r = _full()
    r.support = PackedSupport.from_sets([[11, 50], [12], [13, 14], [1, 14], [15], [16, 17]], vocab_size=100)
    r.vocab_size = 100
    r.validate()
    q = Rollout.load(r.save(tmp_path / f"v{suffix}"))
    _same(q, r)
    with pytest.raises(InputError) as e:
        Rollout.load(tmp_path / f"v{suffix}", vocab_size=50)
    assert e.value.field == "vocab_size" and f"v{suffix}" in str(e.value)
    small().save(tmp_path / f"w{suffix}")
    with pytest.raises(InputError) as e:
        Rollout.load(tmp_path / f"w{suffix}", vocab_size=12)      # response id 12 >= 12
    assert (e.value.field, e.value.row, e.value.index) == ("response_tokens", 1, 1)
    assert f"w{suffix}" in str(e.value)


def _hdr(**kw):
    return json.dumps({"schema": "skyrl-numerics/rollout", "schema_version": 1, **kw})


@pytest.mark.parametrize("lines,field,row,index", [
    ([_hdr(), {**GOOD, "response_ids": [3, 2 ** 32 + 4]}], "response_ids", 0, 1),
    ([_hdr(), {**GOOD, "response_ids": [3, -4]}], "response_ids", 0, 1),
    ([_hdr(), {**GOOD, "response_ids": [3, True]}], "response_ids", 0, 1),
    ([_hdr(), {**GOOD, "prompt_ids": [1, 2.0]}], "prompt_ids", 0, 1),
    ([_hdr(), {**GOOD, "prompt_ids": "12"}], "prompt_ids", 0, None),
    ([_hdr(), {**GOOD, "group_id": 1.0}], "group_id", 0, None),
    ([_hdr(), {**GOOD, "group_id": True}], "group_id", 0, None),
    ([_hdr(), {**GOOD, "group_id": 2 ** 64}], "group_id", 0, None),
    ([_hdr(), {**GOOD, "trainer_logprobs": 5}], "trainer_logprobs", 0, None),
    ([_hdr(), {**GOOD, "support": 3}], "support", 0, None),
    ([_hdr(), {**GOOD, "support": [[3], [4, 4]]}], "support", 0, 1),
    ([_hdr(), {**GOOD, "support": [[3], []]}], "support", 0, 1),
    ([_hdr(), {**GOOD, "support": [[3], [4.0]]}], "support", 0, 1),
    ([_hdr(), {**GOOD, "support": [[3]]}], "support", 0, None),
    ([_hdr(), {**GOOD, "logprobs": [-0.1, -1e39]}], "logprobs", 0, 1),             # overflows float32
    ([_hdr(), {**GOOD, "logprobs": [-0.1, -10 ** 400]}], "logprobs", 0, 1),
    ([_hdr(), '{"prompt_ids": [1], "response_ids": [3], "logprobs": [-Infinity]}'], "logprobs", 0, 0),
    ([_hdr(), {**GOOD, "extra": 1}], "extra", 0, None),
    ([_hdr(schema_version=3), GOOD], "schema_version", None, None),    # (2 is multi-turn: read)
    ([_hdr(schema_version="1"), GOOD], "schema_version", None, None),
    ([_hdr(schema_version=True), GOOD], "schema_version", None, None),
    ([json.dumps({"schema": "skyrl-numerics/rollout"}), GOOD], "schema_version", None, None),
    ([_hdr(sampling=[1]), GOOD], "sampling", None, None),
    ([_hdr(engine=3), GOOD], "engine", None, None),
    ([_hdr(vocab_size=2.0), GOOD], "vocab_size", None, None),
    ([_hdr(vocab_size=4), GOOD], "response_ids", 0, 1),
    ([_hdr(enginee="x"), GOOD], "enginee", None, None),
])
def test_jsonl_strict(tmp_path, lines, field, row, index):
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError) as e:
            Rollout.load(p)
    assert "s.jsonl" in str(e.value) and "\n" not in str(e.value)
    assert e.value.field == field, str(e.value)
    assert e.value.row == row, str(e.value)
    if index is not None:
        assert e.value.index == index, str(e.value)


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,                          # nesting: RecursionError inside json
    '{"prompt_ids": [1' + "1" * 5000 + '], "response_ids": [], "logprobs": []}',   # int digit limit
])
def test_jsonl_pathological_json(tmp_path, text):
    p = tmp_path / "x.jsonl"
    p.write_text(text + "\n")
    with pytest.raises(InputError, match="line 1 is not valid JSON"):
        Rollout.load(p)


def test_not_a_file_and_not_utf8(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(InputError, match="not a regular file"):
        Rollout.load(tmp_path / "d.jsonl")
    (tmp_path / "b.jsonl").write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(InputError, match="UTF-8"):
        Rollout.load(tmp_path / "b.jsonl")


def _rewrite_safetensors(path, arrays=None, meta=None, drop_digest=True):
    from safetensors import safe_open
    from safetensors.numpy import save_file
    with safe_open(str(path), "np") as f:
        m = dict(f.metadata())
        a = {k: f.get_tensor(k) for k in f.keys()}
    if drop_digest:
        m.pop("digest", None)
    a.update(arrays or {})
    a = {k: v for k, v in a.items() if v is not None}
    m.update(meta or {})
    m = {k: v for k, v in m.items() if v is not None}
    save_file(a, str(path), metadata=m)


@pytest.mark.parametrize("arrays,meta,field", [
    ({"response_tokens": np.array([11, 12, 13, 14, 15, 16], np.int64)}, None, "response_tokens"),  # dtype
    ({"rollout_logprobs": np.zeros(6, np.float64) - 1}, None, "rollout_logprobs"),
    ({"group_ids": np.zeros((3, 1), np.int64)}, None, "group_ids"),
    ({"extra": np.zeros(1, np.int64)}, None, "extra"),
    ({"routes.values": np.zeros((1, 1, 1), np.uint8)}, None, "routes.cu_seqlens"),
    ({"support.token_ids": np.zeros(6, np.float32), "support.offsets": np.arange(7, dtype=np.int64)},
     None, "support.token_ids"),
    (None, {"schema_version": "3"}, "schema_version"),
    (None, {"schema_version": None}, "schema_version"),
    (None, {"schema_version": "01x"}, "schema_version"),
    (None, {"sampling": '{"temperature": NaN}'}, "sampling"),    # JSON has no NaN
    (None, {"meta": '{"a": [1, Infinity]}'}, "meta"),
    (None, {"schema_version": "²"}, "schema_version"),       # isdigit() but not int()-able
    (None, {"schema_version": "１"}, "schema_version"),       # a fullwidth 1 is not the integer 1
    (None, {"sampling": "[1, 2]"}, "sampling"),
    (None, {"meta": "{"}, "meta"),
    (None, {"vocab_size": "1.5"}, "vocab_size"),
    (None, {"whatever": "1"}, "whatever"),
])
def test_safetensors_strict(tmp_path, arrays, meta, field):
    p = small().save(tmp_path / "r.safetensors")
    _rewrite_safetensors(p, arrays, meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError) as e:
            Rollout.load(p)
    assert "r.safetensors" in str(e.value) and e.value.field == field, str(e.value)


def test_safetensors_without_digest_still_loads(tmp_path):
    r = _full()
    p = r.save(tmp_path / "r.safetensors")
    _rewrite_safetensors(p)
    _same(Rollout.load(p), r)


def test_gap_cli_exit_2_one_line_no_warnings(tmp_path, capfd):
    rows = [_hdr(), {**GOOD, "trainer_logprobs": [-0.1, -0.2]},
            {**GOOD, "trainer_logprobs": [-0.1, -1e300]}]
    p = tmp_path / "g.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in rows) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli_main(["gap", str(p)]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "g.jsonl, row 1, field 'trainer_logprobs', index 1" in err, err
    p.write_text("[" * 50_000 + "\n")
    assert cli_main(["gap", str(p)]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not valid JSON" in err


# ---- any single edit or bit flip: refused with InputError, or bitwise the same data ------------
def _reference_file(tmp_path, suffix):
    r = _full()
    r.support = PackedSupport.from_sets([[11, 50], [12], [13, 14], [1, 14], [15], [16, 17]], vocab_size=100)
    r.vocab_size = 100
    r.sampling = {"temperature": 0.7, "top_k": 4}
    r.validate()
    return r, r.save(tmp_path / f"ref{suffix}")


def _load_or_refuse(p, ref):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            q = Rollout.load(p)
        except InputError as e:
            assert "\n" not in str(e) and str(p.name) in str(e)
            return False
    _same(q, ref)
    return True


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([".safetensors", ".jsonl"]), st.data())
def test_bit_flip_refused_or_identical(tmp_path_factory, suffix, data):
    tmp = tmp_path_factory.mktemp("flip")
    ref, p = _reference_file(tmp, suffix)
    raw = bytearray(p.read_bytes())
    pos = data.draw(st.integers(0, len(raw) - 1))
    bit = data.draw(st.integers(0, 7))
    raw[pos] ^= 1 << bit
    p.write_bytes(bytes(raw))
    _load_or_refuse(p, ref)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_jsonl_field_edit_refused_or_identical(tmp_path_factory, data):
    """Edit one JSON value (any row or the header) to another value of any type."""
    tmp = tmp_path_factory.mktemp("edit")
    ref, p = _reference_file(tmp, ".jsonl")
    lines = p.read_text().splitlines()
    li = data.draw(st.integers(0, len(lines) - 1))
    obj = json.loads(lines[li])
    key = data.draw(st.sampled_from(sorted(obj)))
    new = data.draw(st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                              st.floats(allow_nan=True), st.text(max_size=5),
                              st.lists(st.integers(-3, 2 ** 33), max_size=4),
                              st.lists(st.floats(), max_size=4)))
    drop_digest = data.draw(st.booleans())
    # an "edit" that writes the value the field already had leaves the file as it was (it must
    # load): not an edit
    assume(json.dumps(obj[key]) != json.dumps(new))
    obj[key] = new
    lines[li] = json.dumps(obj)
    if drop_digest:
        h = json.loads(lines[0])
        h.pop("digest", None)
        lines[0] = json.dumps(h)
    p.write_text("\n".join(lines) + "\n")
    ok = _load_or_refuse_any(p)
    if ok is not None and not drop_digest:
        pytest.fail("an edited file with its digest loaded")


def _load_or_refuse_any(p):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            return Rollout.load(p)
        except InputError as e:
            assert "\n" not in str(e) and p.name in str(e)
            return None


def test_jsonl_integer_logprob_beyond_int64_loads_as_a_float(tmp_path):
    """-10**30 fits float32; as a Python int beyond int64 it used to make the row an object
    array and the load fail naming no row."""
    p = tmp_path / "big.jsonl"
    p.write_text(_hdr() + "\n" + json.dumps({**GOOD, "logprobs": [-1, -10 ** 30]}) + "\n")
    r = Rollout.load(p)
    assert r.rollout_logprobs.tolist() == [-1.0, np.float32(-1e30)]
