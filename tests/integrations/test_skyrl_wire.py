"""``replay/skyrl_wire.py`` against SkyRL 0.4.0's own wire code (``generate_wire.py``, ``routed_experts.py``,
``sample_support.py``): our envelopes are the bytes SkyRL's packers write and its decoders (the raw-body
splice of ``load_packed_body`` included) read, and ours read what its packers write — routes on both sides
of the uint8 / int16 / int32 boundaries (vLLM's uint16 for > 256 experts re-packed as int16), supports in
the caller's rank order with trailing ``-1``. Bad arrays are refused by both."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedSupport
from skyrl_numerics.replay.skyrl_wire import (pack_routes, pack_support, support_array, support_from_skyrl,
                                              unpack_routes, unpack_support)

WIRE = "backends.skyrl_train.inference_servers.generate_wire"


@st.composite
def route_arrays(draw):
    n, L, k = draw(st.integers(0, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    top = draw(st.sampled_from([1, 255, 256, 511, 32767, 32768, 2**31 - 1]))
    dtype = draw(st.sampled_from([np.uint8, np.uint16, np.int16, np.int32, np.int64]))
    if np.iinfo(dtype).max < top:
        top = int(np.iinfo(dtype).max)
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    a = rng.integers(0, top + 1, size=(n, L, k), dtype=np.int64)
    if a.size and draw(st.booleans()):
        a.flat[int(rng.integers(a.size))] = top       # the boundary itself
    return a.astype(dtype)


@st.composite
def support_rows(draw):
    V = draw(st.integers(2, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    rows = [rng.permutation(V)[: int(rng.integers(1, min(V, 12) + 1))].tolist()
            for _ in range(draw(st.integers(0, 8)))]
    return rows, V, draw(st.sampled_from([None, 12, 14]))


@settings(max_examples=40, deadline=None)
@given(a=route_arrays())
def test_routes_envelope_is_skyrls(skyrl, a):
    wire = skyrl(WIRE)
    ours = pack_routes(a)
    assert ours == wire.pack_routed_experts(a)                        # the same bytes, dtype, shape
    back = wire.decode_packed_routed_experts(ours)
    assert back.dtype == ours_dtype(ours) and np.array_equal(back, a)
    mine = unpack_routes(wire.pack_routed_experts(a))
    assert mine.dtype == back.dtype and np.array_equal(mine, a)
    # through the raw-body splice of SkyRL's client
    raw = json.dumps({"choices": [{"token_ids": [1], "routed_experts": ours, "rollout_sample_support": None}]},
                     separators=(",", ":")).encode()
    spliced = wire.load_packed_body(raw)["choices"][0]["routed_experts"]
    assert np.array_equal(wire.decode_packed_routed_experts(spliced), a)


def ours_dtype(envelope) -> np.dtype:
    return np.dtype(envelope["dtype"])


@settings(max_examples=40, deadline=None)
@given(case=support_rows())
def test_support_envelope_is_skyrls(skyrl, case):
    wire = skyrl(WIRE)
    rows, V, width = case
    ours = pack_support(rows, width)
    arr = wire.decode_packed_sample_support(ours)                     # SkyRL's validator accepts it
    assert arr.shape == (len(rows), max((len(r) for r in rows), default=0) if width is None else width)
    assert [r[r >= 0].tolist() for r in arr] == rows                  # the given (rank) order kept
    assert ours == wire.pack_sample_support(support_array(rows, width))
    assert unpack_support(wire.pack_sample_support(arr), V) == PackedSupport.from_sets(rows, V)


def test_bad_arrays_are_refused_by_both(skyrl):
    wire = skyrl(WIRE)
    late = np.array([[3, -1, 4]], np.int32)                           # padding before an id
    with pytest.raises(ValueError, match="trailing"):
        wire.validate_sample_support(late)
    with pytest.raises(InputError, match="padding must trail") as e:
        support_from_skyrl(late)
    assert e.value.field == "rollout_sample_support" and e.value.index == 0
    with pytest.raises(InputError, match="duplicate"):
        support_from_skyrl(np.array([[1, 2], [5, 5]], np.int32))
    with pytest.raises(InputError, match="outside"):
        support_from_skyrl(np.array([[1, 9]], np.int32), vocab_size=9)
    with pytest.raises(InputError, match="empty"):
        support_from_skyrl(np.array([[-1, -1]], np.int32))
    with pytest.raises(InputError, match="duplicate"):
        support_array([[4, 4]])
    with pytest.raises(InputError, match="more than the width 2") as e:
        support_array([[1, 2], [1, 2, 3]], width=2)
    assert e.value.index == 1
    # vLLM's uint16 routes (> 256 experts) are not SkyRL's: both decoders refuse the envelope
    u16 = {"data": "AAABAA==", "shape": [1, 1, 2], "dtype": "uint16"}
    with pytest.raises(ValueError, match="uint16"):
        wire.decode_packed_routed_experts(u16)
    with pytest.raises(InputError, match="uint16"):
        unpack_routes(u16)
    i16 = {"data": "AAABAA==", "shape": [1, 1, 2], "dtype": "int16"}  # ids 0, 1: canonical is uint8
    with pytest.raises(ValueError, match="non-canonical"):
        wire.decode_packed_routed_experts(i16)
    with pytest.raises(InputError, match="non-canonical"):
        unpack_routes(i16)
    with pytest.raises(InputError, match="bytes"):
        unpack_routes({"data": "AAAA", "shape": [1, 1, 2], "dtype": "uint8"})


def test_keyed_weight_sync_client_sends_the_key_and_never_shows_it(skyrl, monkeypatch):
    """SkyRL's SkyrlWeightSyncClient as integrations.skyrl.KeyedWeightSyncClient: its one session
    carries the bearer key (argument or $VLLM_API_KEY), repr hides it, no key is refused."""
    skyrl("backends.skyrl_train.weight_sync.control_plane")
    from skyrl_numerics.integrations.skyrl import KeyedWeightSyncClient

    c = KeyedWeightSyncClient(["http://127.0.0.1:9"], api_key="s3cret")
    assert c._session.headers["Authorization"] == "Bearer s3cret" and "s3cret" not in repr(c)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert KeyedWeightSyncClient(["http://127.0.0.1:9"])._session.headers["Authorization"] == "Bearer from-env"
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(InputError, match="API key") as e:
        KeyedWeightSyncClient(["http://127.0.0.1:9"])
    assert e.value.field == "api_key"
