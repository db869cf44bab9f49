"""vLLM 0.32 wire formats -> PackedRoutes / PackedSupport: round trips built with vLLM's own encoder and data
classes (the reference is vLLM's code, not ours), and every single corruption refused with InputError."""
import base64
import io
import json
import pickle
import re
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import (PackedRoutes, PackedSupport, RouteTrace, decode_vllm_routes, encode_vllm_routes,
                                   id_dtype)

pytest.importorskip("vllm")
from vllm.distributed.aux_output_connector.connector import (AuxOutputSchedulerConnector,  # noqa: E402
                                                             AuxRequestOutput)
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensChoice  # noqa: E402
from vllm.outputs import CompletionOutput, SamplingMask  # noqa: E402
from vllm.utils.serial_utils import numpy2base64  # noqa: E402
from vllm.v1.outputs import SamplingMaskLists  # noqa: E402


def vllm_dtype(E):
    # RoutedExpertsCapturer.__init__: output_dtype_name = "uint8" if num_experts <= 256 else "uint16"
    return np.uint8 if E <= 256 else np.uint16


def vllm_rows(full_rows: np.ndarray, num_tokens: int, token_start: int = 0) -> np.ndarray:
    """The rows vLLM's scheduler hands out for a finished request (AuxOutputSchedulerConnector.take_output)."""
    req = SimpleNamespace(request_id="r", num_tokens=num_tokens, is_finished=lambda: True)
    out = AuxOutputSchedulerConnector().take_output(req, {"r": AuxRequestOutput(token_start, full_rows)})
    assert out is not None
    return out


def over_the_wire(routes_b64=None, mask=None):
    """A /generate choice as the client sees it: vLLM's pydantic model -> JSON -> dict."""
    c = GenerateTokensChoice(index=0, token_ids=[0], routed_experts=routes_b64, sampling_mask=mask)
    return json.loads(c.model_dump_json())


@st.composite
def wire_case(draw):
    E = draw(st.sampled_from([1, 2, 7, 64, 255, 256, 257, 300]) | st.integers(1, 300))
    L_total = draw(st.integers(1, 6))
    moe = sorted(draw(st.sets(st.integers(0, L_total - 1), min_size=1)))
    k = draw(st.integers(1, min(4, E)))
    lens = draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=3))
    return E, L_total, moe, k, lens, draw(st.integers(0, 2 ** 31))


def make_choices(E, L_total, moe, k, lens, seed):
    """Per choice: (the MoE-only routes we expect, the full [n, L_total, k] array vLLM would encode)."""
    rng = np.random.default_rng(seed)
    out = []
    for P, R in lens:
        n = P + R
        captured = np.zeros((n + 2, L_total, k), dtype=vllm_dtype(E))   # worker buffer may hold extra rows
        ids = rng.integers(0, E, size=(n + 2, len(moe), k))
        captured[:, moe] = ids
        full = vllm_rows(captured, n)
        out.append((ids[:n - 1], full))
    return out


@settings(max_examples=60, deadline=None)
@given(wire_case())
def test_routes_round_trip_through_vllm_encoder(case):
    E, L_total, moe, k, lens, seed = case
    choices = make_choices(E, L_total, moe, k, lens, seed)
    for _, full in choices:
        assert full.dtype == vllm_dtype(E)
    wire = [over_the_wire(numpy2base64(full))["routed_experts"] for _, full in choices]
    P, R = [p for p, _ in lens], [r for _, r in lens]
    r = PackedRoutes.from_vllm(wire, E, prompt_lens=P, response_lens=R, moe_layers=moe)
    assert r.values.dtype == id_dtype(E) and r.num_experts == E
    assert (r.num_seqs, r.num_layers, r.k) == (len(lens), len(moe), k)
    assert r.seq_lens.tolist() == [p + q - 1 for p, q in lens]
    for b, (want, full) in enumerate(choices):
        np.testing.assert_array_equal(r.seq(b), want)
        assert r.to_vllm(b, num_hidden_layers=L_total, moe_layers=moe) == numpy2base64(full)
    # the same routes from raw .npy bytes and from CompletionOutput.routed_experts (ndarray)
    raw = [base64.b64decode(s) for s in wire]
    assert PackedRoutes.from_vllm(raw, E, moe_layers=moe) == r
    outs = [CompletionOutput(index=b, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                             routed_experts=full) for b, (_, full) in enumerate(choices)]
    assert PackedRoutes.from_vllm([o.routed_experts for o in outs], E, moe_layers=moe) == r
    # every layer kept when moe_layers is None: the dense layers come back as zeros
    allr = PackedRoutes.from_vllm(wire, E)
    assert allr.num_layers == L_total
    np.testing.assert_array_equal(allr.seq(0), choices[0][1])


@pytest.mark.parametrize("arr", [
    np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
    np.arange(60, dtype=np.uint16).reshape(5, 3, 4)[:, ::2],             # non-contiguous
    np.asfortranarray(np.arange(24, dtype=np.uint16).reshape(2, 3, 4)),
    np.zeros((0, 4, 2), np.uint8),
    np.arange(24, dtype=">u2").reshape(2, 3, 4),
])
def test_encode_is_byte_identical_to_numpy2base64_and_decodes_back(arr):
    s = encode_vllm_routes(arr)
    assert s == numpy2base64(arr)
    got = decode_vllm_routes(s, 300)
    assert got.dtype == np.uint16 and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)


CORRUPTIONS = ["float_dtype", "bool_dtype", "ndim2", "ndim4", "truncate", "id_too_big", "negative_id",
               "extra_row", "missing_row", "dense_layer_routed", "bad_char", "not_npy", "layers_differ",
               "trailing_bytes"]


@settings(max_examples=120, deadline=None)
@given(wire_case(), st.sampled_from(CORRUPTIONS), st.data())
def test_any_single_corruption_is_refused_naming_the_choice(case, how, data):
    E, L_total, moe, k, lens, seed = case
    choices = make_choices(E, L_total, moe, k, lens, seed)
    b = data.draw(st.integers(0, len(choices) - 1))
    full = choices[b][1].copy()
    n = full.shape[0]
    dense = [layer for layer in range(L_total) if layer not in moe]
    if how == "dense_layer_routed" and not dense:
        how = "id_too_big"
    if how == "layers_differ" and len(choices) == 1:      # alone, a wider array is just more (zero) layers
        how = "extra_row"
    if how in ("id_too_big", "negative_id", "dense_layer_routed", "missing_row") and n == 0:
        how = "extra_row"
    pos = data.draw(st.integers(0, max(n - 1, 0)))
    if how == "float_dtype":
        full = full.astype(data.draw(st.sampled_from([np.float32, np.float16, np.float64])))
    elif how == "bool_dtype":
        full = full.astype(bool)
    elif how == "ndim2":
        full = full.reshape(n, -1)
    elif how == "ndim4":
        full = full[None]
    elif how == "id_too_big":
        full = full.astype(np.uint16)
        full[pos, moe[0], data.draw(st.integers(0, k - 1))] = data.draw(st.integers(E, 2 ** 16 - 1))
    elif how == "negative_id":
        full = full.astype(np.int32)
        full[pos, moe[0], 0] = data.draw(st.integers(-2 ** 31, -1))
    elif how == "extra_row":
        full = np.concatenate([full, full[:1] if n else np.zeros((1,) + full.shape[1:], full.dtype)])
    elif how == "missing_row":
        full = full[:-1]
    elif how == "dense_layer_routed":
        full[pos, data.draw(st.sampled_from(dense)), 0] = data.draw(st.integers(1, max(E - 1, 1))) if E > 1 else 0
        if E == 1:                        # only id 0 exists: a routed dense layer cannot be told from 0s
            full = full[:-1]
            how = "missing_row"
    elif how == "layers_differ":
        full = np.concatenate([full, np.zeros((n, 1, k), full.dtype)], axis=1)
    s = numpy2base64(full)
    if how == "truncate":
        s = s[:data.draw(st.integers(0, len(s) - 1))]
    elif how == "bad_char":
        i = data.draw(st.integers(0, len(s) - 1))
        s = s[:i] + data.draw(st.sampled_from(["!", "-", "_", " ", "é", "\n"])) + s[i + 1:]
    elif how == "not_npy":
        s = base64.b64encode(pickle.dumps(full)).decode()
    elif how == "trailing_bytes":
        s = base64.b64encode(base64.b64decode(s) + bytes(data.draw(st.integers(1, 9)))).decode()
    wire = [numpy2base64(f) for _, f in choices]
    wire[b] = s
    P, R = [p for p, _ in lens], [r for _, r in lens]
    with pytest.raises(InputError) as ei:
        PackedRoutes.from_vllm(wire, E, prompt_lens=P, response_lens=R, moe_layers=moe)
    err = ei.value
    row = 1 if how == "layers_differ" and b == 0 else b      # choice 1 then differs from (wider) choice 0
    assert err.row == row and err.field == "routed_experts", (how, str(err))
    assert f"choice {row}" in str(err)
    if how in ("id_too_big", "negative_id", "dense_layer_routed"):
        assert err.index == pos, (how, str(err))


def test_prompt_start_is_refused_and_deltas_rebuild_the_trajectory_with_route_trace():
    E, L_total, moe, k = 300, 4, [1, 2, 3], 2
    rng = np.random.default_rng(3)
    n1, P2, R2 = 7, 11, 5                      # turn 1 has 7 tokens; turn 2's prompt holds them + 4 new
    captured = np.zeros((P2 + R2, L_total, k), np.uint16)
    captured[:, moe] = rng.integers(0, E, size=(P2 + R2, 3, k))
    t1 = numpy2base64(vllm_rows(captured, n1))
    start = n1 - 1                             # last sampled token of turn 1 was never run
    t2 = numpy2base64(vllm_rows(captured[start:], P2 + R2, token_start=start))
    with pytest.raises(InputError) as ei:
        PackedRoutes.from_vllm([t1, t2], E, prompt_lens=[4, P2], response_lens=[3, R2], prompt_start=[0, start],
                               moe_layers=moe)
    assert ei.value.row == 1 and ei.value.field == "prompt_start" and "RouteTrace" in str(ei.value)
    with pytest.raises(InputError) as ei:
        PackedRoutes.from_vllm([t1], E, prompt_lens=[4], response_lens=[3], prompt_start=5, moe_layers=moe)
    assert ei.value.field == "prompt_start" and "> prompt_len 4" in str(ei.value)
    trace = RouteTrace(len(moe), k, E)
    trace.add(decode_vllm_routes(t1, E, moe_layers=moe, rows=n1 - 1))
    trace.add(decode_vllm_routes(t2, E, moe_layers=moe, rows=P2 + R2 - 1 - start), start=start)
    trace.check_length(P2 + R2)
    np.testing.assert_array_equal(trace.to_routes().seq(0), captured[:P2 + R2 - 1][:, moe])
    with pytest.raises(InputError, match="2 route rows"):
        decode_vllm_routes(numpy2base64(captured[:2]), E, moe_layers=moe, rows=3)


class _Boom:
    fired = False

    def __reduce__(self):
        return (_fire, ())


def _fire():
    _Boom.fired = True
    return 0


def test_never_unpickles_nor_opens_zip():
    obj = np.array([[[_Boom()]]], dtype=object)
    with io.BytesIO() as f:
        np.save(f, obj, allow_pickle=True)
        evil = base64.b64encode(f.getvalue()).decode()
    with pytest.raises(InputError, match="must be integers, got dtype object"):
        PackedRoutes.from_vllm([evil], 8)
    assert not _Boom.fired
    with io.BytesIO() as f:
        with zipfile.ZipFile(f, "w") as z:
            z.writestr("arr_0.npy", base64.b64decode(numpy2base64(np.zeros((1, 1, 1), np.uint8))))
        npz = f.getvalue()
    with pytest.raises(InputError, match="malformed .npy"):
        PackedRoutes.from_vllm([npz], 8)


def test_argument_errors():
    ok = numpy2base64(np.zeros((3, 2, 1), np.uint8))
    cases = [
        (dict(encoded=ok), "sequence with one entry per choice"),          # a bare string, not a list
        (dict(encoded=[]), "no choices"),
        (dict(encoded=[ok, None]), "no routes"),
        (dict(encoded=[ok, 17]), "got int"),
        (dict(encoded=[ok], moe_layers=[]), "no MoE layers"),
        (dict(encoded=[ok], moe_layers=[2]), "outside [0, 2)"),
        (dict(encoded=[ok], moe_layers=[1, 1]), "strictly increasing"),
        (dict(encoded=[ok], moe_layers=[1, 0]), "strictly increasing"),
        (dict(encoded=[ok], prompt_lens=[2]), "come together"),
        (dict(encoded=[ok], prompt_lens=[2, 2], response_lens=[2, 2]), "2 entries for 1 choices"),
        (dict(encoded=[ok], prompt_lens=[2], response_lens=[1.5]), "not an integer"),
        (dict(encoded=[ok], num_experts=0), "num_experts must be >= 1"),
        (dict(encoded=[ok], num_experts=True), "expected an integer"),
    ]
    for kw, msg in cases:
        kw = {"num_experts": 8, **kw}
        with pytest.raises(InputError, match=re.escape(msg)):
            PackedRoutes.from_vllm(kw.pop("encoded"), kw.pop("num_experts"), **kw)
    r = PackedRoutes.from_vllm([ok], 8, prompt_lens=[2], response_lens=[2], moe_layers=[1])
    with pytest.raises(InputError, match="needs num_hidden_layers"):
        r.to_vllm(0, moe_layers=[1])
    with pytest.raises(InputError, match="pass moe_layers"):
        r.to_vllm(0, num_hidden_layers=2)
    with pytest.raises(InputError, match="2 moe_layers for 1 route layers"):
        r.to_vllm(0, num_hidden_layers=2, moe_layers=[0, 1])


# ---- sampling_mask --------------------------------------------------------------------------------------
@st.composite
def mask_case(draw):
    V = draw(st.integers(1, 1000))
    choices = draw(st.lists(st.lists(st.sets(st.integers(0, V - 1), min_size=1, max_size=40), max_size=6),
                            min_size=1, max_size=4))
    return V, choices, draw(st.integers(0, 2 ** 31))


@settings(max_examples=60, deadline=None)
@given(mask_case())
def test_sampling_mask_round_trip_through_vllm_classes(case):
    V, choices, seed = case
    rng = np.random.default_rng(seed)
    wire, objs, sampled = [], [], []
    for rows in choices:
        sorted_rows = [sorted(s) for s in rows]
        ids = np.array([t for s in sorted_rows for t in s], np.int32)
        offsets = np.cumsum([0] + [len(s) for s in sorted_rows])
        nested = SamplingMaskLists(ids, offsets).to_nested_list()       # as the output processor builds it
        assert nested == sorted_rows
        objs.append(SamplingMask(nested))
        wire.append(over_the_wire(mask=nested)["sampling_mask"])
        sampled.append([int(rng.choice(s)) for s in sorted_rows])
    want = PackedSupport.from_sets([s for rows in choices for s in rows], V)
    got = PackedSupport.from_vllm(wire, V, response_lens=[len(c) for c in choices], token_ids=sampled)
    assert got == want and got.vocab_size == V
    assert got.token_ids.dtype == np.int32 and got.offsets.dtype == np.int64
    assert got.sizes.tolist() == [len(s) for rows in choices for s in rows]
    assert PackedSupport.from_vllm(objs, V) == want                    # vllm.outputs.SamplingMask objects
    shuffled = [[list(rng.permutation(sorted(s))) for s in rows] for rows in choices]
    assert PackedSupport.from_vllm(shuffled, V) == want                # any order in, sorted out


MASK_CORRUPTIONS = ["duplicate", "too_big", "negative", "bool", "float", "str_row", "int_row", "empty_row",
                    "count", "not_sampled", "none"]


@settings(max_examples=120, deadline=None)
@given(mask_case(), st.sampled_from(MASK_CORRUPTIONS), st.data())
def test_sampling_mask_single_corruption_is_refused_naming_choice_and_position(case, how, data):
    V, choices, _ = case
    choices = [[sorted(s) for s in rows] for rows in choices]
    c = data.draw(st.integers(0, len(choices) - 1))
    if not choices[c]:
        choices[c] = [[0]]
    i = data.draw(st.integers(0, len(choices[c]) - 1))
    row = list(choices[c][i])
    sampled = [[s[0] for s in rows] for rows in choices]
    lens = [len(rows) for rows in choices]
    bad = [list(map(list, rows)) for rows in choices]
    if how == "duplicate":
        bad[c][i] = row + [row[data.draw(st.integers(0, len(row) - 1))]]
    elif how == "too_big":
        bad[c][i] = row + [data.draw(st.integers(V, 2 ** 70))]
    elif how == "negative":
        bad[c][i] = row + [data.draw(st.integers(-2 ** 40, -1))]
    elif how == "bool":
        bad[c][i] = row + [True]
    elif how == "float":
        bad[c][i] = row + [float(row[0]) + data.draw(st.sampled_from([0.0, 0.5]))]
    elif how == "str_row":
        bad[c][i] = "1,2"
    elif how == "int_row":
        bad[c][i] = row[0]
    elif how == "empty_row":
        bad[c][i] = []
    elif how == "count":
        lens[c] += data.draw(st.sampled_from([-1, 1]))
    elif how == "not_sampled":
        if len(row) == V:
            bad[c][i] = row + [row[0]]
            how = "duplicate"
        else:
            sampled[c][i] = min(set(range(V)) - set(row))
    elif how == "none":
        bad[c] = None
    with pytest.raises(InputError) as ei:
        PackedSupport.from_vllm(bad, V, response_lens=lens, token_ids=sampled if how == "not_sampled" else None)
    err = ei.value
    assert err.row == c and err.field == "sampling_mask", (how, str(err))
    if how not in ("count", "none"):
        assert err.index == i, (how, str(err))


def test_errors_name_the_position_within_a_later_choice():
    wire = [[[1], [2, 3]], [[4], [5], [6, 7], [8]]]
    with pytest.raises(InputError) as ei:
        PackedSupport.from_vllm(wire, 10, token_ids=[[1, 3], [4, 5, 7, 9]])
    assert (ei.value.row, ei.value.index) == (1, 3) and "sampled token 9" in str(ei.value)
    for bad, msg in (([[1], [2, 2]], "duplicate token id 2"), ([[1], [2, 10]], "token id 10 outside [0, 10)")):
        with pytest.raises(InputError, match=re.escape(msg)) as ei:
            PackedSupport.from_vllm([wire[0], wire[1][:3] + [bad[1]]], 10)
        assert (ei.value.row, ei.value.index) == (1, 3)
    full = np.zeros((5, 2, 2), np.uint16)
    full[:, 1] = [0, 1]
    full[4, 1, 1] = 9
    with pytest.raises(InputError, match=re.escape("expert id 9 outside [0, 9) at position 4, layer 1, slot 1")) as ei:
        PackedRoutes.from_vllm([numpy2base64(full[:3]), numpy2base64(full)], 9, moe_layers=[1])
    assert (ei.value.row, ei.value.index) == (1, 4)


def test_sampling_mask_argument_errors():
    with pytest.raises(InputError, match="one entry per choice"):
        PackedSupport.from_vllm("[[1]]", 10)
    with pytest.raises(InputError, match="vocab_size 0"):
        PackedSupport.from_vllm([[[1]]], 0)
    with pytest.raises(InputError, match="2 entries for 1 choices"):
        PackedSupport.from_vllm([[[1]]], 10, response_lens=[1, 1])
    with pytest.raises(InputError, match="1 mask rows for a response of 2 tokens"):
        PackedSupport.from_vllm([[[1]]], 10, token_ids=[[1, 2]])
    empty = PackedSupport.from_vllm([[], []], 10, response_lens=[0, 0])
    assert empty.num_tokens == 0 and empty.nnz == 0
