"""PackedGates (the engine's combine weights beside the routes): packing round trips, storage
error bounds, checks, RouteTrace turn deltas with gates, and the Rollout file."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedGates, PackedRoutes, RouteTrace
from skyrl_numerics.replay.gates import GATE_DTYPES, bf16_bits, bf16_to_float32
from skyrl_numerics.rollout import Rollout

# combine weights: normalized top-k weights in (0, 1], DeepSeek's x routed_scaling_factor, some tiny
weights = st.floats(min_value=2.0 ** -20, max_value=4.0, width=32)


@st.composite
def gate_batches(draw):
    L, k = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    return [draw(hnp.arrays(np.float32, (n, L, k), elements=weights)) for n in lens]


@settings(max_examples=60)
@given(gate_batches(), st.sampled_from(sorted(GATE_DTYPES)))
def test_round_trip_and_storage_error(seqs, dtype):
    g = PackedGates.from_sequences(seqs, dtype)
    assert g.num_seqs == len(seqs) and g.seq_lens.tolist() == [len(s) for s in seqs]
    assert g.bytes_per_token == g.num_layers * g.k * GATE_DTYPES[dtype].itemsize
    back = PackedGates.from_arrays(g.to_arrays())
    assert back == g
    x = np.concatenate(seqs)
    got = back.to_float32()
    # the format's own rounding, as torch rounds (round to nearest even): bit for bit
    ref = {"float32": torch.from_numpy(x),
           "float16": torch.from_numpy(x).to(torch.float16).float(),
           "bfloat16": torch.from_numpy(x).to(torch.bfloat16).float()}[dtype].numpy()
    assert np.array_equal(got, ref)
    for b in range(len(seqs)):
        assert np.array_equal(back.rows(slice(g.cu_seqlens[b], g.cu_seqlens[b + 1])), ref[g.cu_seqlens[b]:g.cu_seqlens[b + 1]])


def test_bf16_bits_match_torch_including_ties():
    # exact ties (low 16 bits 0x8000) round to even; neighbours of ties round to nearest
    u = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x00000001, 0x7F7FFFFF >> 1],
                 dtype=np.uint32)
    x = u.view(np.float32)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_bits(x), ref)
    assert np.array_equal(bf16_to_float32(ref), torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_refusals():
    with pytest.raises(InputError, match="not finite"):
        PackedGates.from_sequences([np.array([[[np.nan]]], np.float32)])
    with pytest.raises(InputError, match="not finite in float16"):
        PackedGates.from_sequences([np.array([[[1e5]]], np.float32)], "float16")
    PackedGates.from_sequences([np.array([[[1e5]]], np.float32)], "bfloat16")   # bf16 has the range
    with pytest.raises(InputError, match="unknown gate dtype"):
        PackedGates.from_sequences([np.zeros((1, 1, 1), np.float32)], "int8")
    with pytest.raises(InputError, match="must be floats"):
        PackedGates.from_sequences([np.zeros((1, 1, 1), np.int32)])
    g = PackedGates.from_sequences([np.full((2, 1, 2), 0.5, np.float32)])
    arrays = g.to_arrays()
    arrays["values"] = arrays["values"].copy()
    arrays["values"][0, 0, 0] = np.float16(0.25)
    with pytest.raises(InputError, match="digest"):
        PackedGates.from_arrays(arrays)
    with pytest.raises(InputError, match="unknown array"):
        PackedGates.from_arrays({**g.to_arrays(), "extra": np.zeros(1)})
    routes = PackedRoutes.from_sequences([np.zeros((3, 1, 2), np.uint8)], 4)
    with pytest.raises(InputError, match="do not match routes"):
        g.check_routes(routes)


def test_concat_and_seqs_views():
    a = PackedGates.from_sequences([np.full((2, 1, 2), 0.25, np.float32), np.full((3, 1, 2), 0.5, np.float32)])
    b = PackedGates.from_sequences([np.full((1, 1, 2), 0.75, np.float32)])
    c = PackedGates.concat([a, b])
    assert c.seq_lens.tolist() == [2, 3, 1]
    assert c.seqs(1, 2).to_float32()[:, 0, 0].tolist() == [0.5, 0.5, 0.5, 0.75]
    with pytest.raises(InputError, match="part 1"):
        PackedGates.concat([a, PackedGates.from_sequences([np.zeros((1, 2, 2), np.float32)])])


def test_trace_turn_deltas_with_gates():
    rng = np.random.default_rng(0)
    L, k, E = 2, 2, 8
    ids = rng.integers(0, E, size=(10, L, k))
    w = rng.uniform(0.01, 1, size=(10, L, k)).astype(np.float32)
    tr = RouteTrace(L, k, E, gate_dtype="float32")
    tr.add(ids[:4], gates=w[:4])
    tr.add(ids[4:7], start=4, gates=w[4:7])
    # an overlapping delta: the recorded rows win, for ids and weights alike
    tr.add(ids[5:10] * 0 + 1, start=5, allow_overlap=True, gates=np.full((5, L, k), 9.0, np.float32))
    assert tr.num_tokens == 10 and tr.nbytes == 10 * L * k * (1 + 4)
    routes, gates = tr.to_routes(), tr.to_gates()
    gates.check_routes(routes)
    assert np.array_equal(gates.to_float32()[:7], w[:7]) and (gates.to_float32()[7:] == 9.0).all()
    assert np.array_equal(routes.values[:7], ids[:7])
    with pytest.raises(InputError, match="pass gates="):
        tr.add(ids[:1], start=10)
    with pytest.raises(InputError, match="shape"):
        tr.add(ids[:2], start=10, gates=w[:1])
    assert tr.num_tokens == 10     # rejected deltas left it unchanged
    plain = RouteTrace(L, k, E)
    with pytest.raises(InputError, match="without gate_dtype"):
        plain.add(ids[:1], gates=w[:1])
    with pytest.raises(InputError, match="no gate weights"):
        plain.to_gates()


def test_rollout_file_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]]
    lens = [len(p) + len(r) - 1 for p, r in zip(prompts, responses)]
    routes = PackedRoutes.from_sequences([rng.integers(0, 8, size=(n, 2, 2)) for n in lens], 8)
    gates = PackedGates.from_sequences([rng.uniform(0, 1, size=(n, 2, 2)).astype(np.float32) for n in lens])
    ro = Rollout.from_lists(prompts, responses, [[-1.0] * len(r) for r in responses], routes=routes,
                            gates=gates)
    back = Rollout.load(ro.save(tmp_path / "r.safetensors"))
    assert back.gates == gates and back.routes == routes
    with pytest.raises(InputError, match="gates"):
        Rollout.from_lists(prompts, responses, [[-1.0] * len(r) for r in responses], routes=routes,
                           gates=PackedGates.from_sequences([np.zeros((n + 1, 2, 2), np.float32) for n in lens]))
