"""PackedRoutes: packing, views, buffer round trips (zero-copy), bit-packing, errors."""
import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedRoutes, bits_for, id_dtype, pack_bits, unpack_bits


def _rand_seqs(rng, lens, L, k, E, dtype=np.int32):
    return [rng.integers(0, E, size=(n, L, k)).astype(dtype) for n in lens]


@st.composite
def routes_case(draw):
    E = draw(st.integers(2, 512))
    L = draw(st.integers(1, 4))
    k = draw(st.integers(1, min(8, E)))
    lens = draw(st.lists(st.integers(0, 17), min_size=1, max_size=6))
    seed = draw(st.integers(0, 2 ** 31))
    return E, L, k, lens, seed


def test_id_dtype_is_smallest_holding_expert_count():
    assert id_dtype(2) == np.uint8 and id_dtype(256) == np.uint8
    assert id_dtype(257) == np.uint16 and id_dtype(65536) == np.uint16
    assert id_dtype(65537) == np.uint32
    assert [bits_for(e) for e in (2, 3, 4, 5, 8, 9, 128, 129, 256, 512)] == [1, 2, 2, 3, 3, 4, 7, 8, 8, 9]


@settings(max_examples=60, deadline=None)
@given(routes_case())
def test_pack_views_and_buffer_roundtrip_zero_copy(case):
    E, L, k, lens, seed = case
    rng = np.random.default_rng(seed)
    seqs = _rand_seqs(rng, lens, L, k, E)
    r = PackedRoutes.from_sequences(seqs, E)
    assert r.values.dtype == id_dtype(E) and r.cu_seqlens.dtype == np.int32
    assert r.values.shape == (sum(lens), L, k)
    assert r.seq_lens.tolist() == lens
    for b, s in enumerate(seqs):
        v = r.seq(b)
        assert np.array_equal(v, s)
        if v.size:
            assert np.shares_memory(v, r.values)  # per-sequence view, no copy
    buf = r.to_buffer()
    assert buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous
    assert r.to_buffer() is buf  # already one buffer: serialization is free
    back = PackedRoutes.from_buffer(buf)
    assert back == r
    if back.values.size:
        assert np.shares_memory(back.values, buf)
    assert np.shares_memory(back.cu_seqlens, buf)
    # from immutable bytes too: views on the bytes object
    data = r.to_bytes()
    back2 = PackedRoutes.from_bytes(data)
    assert back2 == r and not back2.values.flags.writeable
    # bit-packed: smaller, same routes
    pb = r.to_buffer(bitpack=True)
    back3 = PackedRoutes.from_buffer(pb)
    assert back3 == r
    n = r.values.size
    assert pb.size <= buf.size
    assert pb.size - (buf.size - r.values.nbytes) == (n * bits_for(E) + 7) // 8


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 20), st.integers(0, 300), st.integers(0, 2 ** 31))
def test_bitpack_roundtrip(bits, n, seed):
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 2 ** bits, size=n, dtype=np.uint64).astype(np.uint32)
    s = pack_bits(v, bits)
    assert s.size == (n * bits + 7) // 8
    assert np.array_equal(unpack_bits(s, n, bits), v)


def test_bitpack_hand_vector():
    # 3-bit values 5 (101), 3 (011), 7 (111): stream LSB-first = 1,0,1, 1,1,0, 1,1,1 -> bytes 0b11011101, 0b1
    s = pack_bits(np.array([5, 3, 7], dtype=np.uint8), 3)
    assert s.tolist() == [0b11011101, 0b00000001]
    with pytest.raises(InputError, match="does not fit in 3 bits"):
        pack_bits(np.array([8], dtype=np.uint8), 3)


def test_torch_view_shares_memory():
    r = PackedRoutes.from_sequences(_rand_seqs(np.random.default_rng(0), [3, 5], 2, 2, 300), 300)
    t = r.torch_values()
    assert t.data_ptr() == r.values.ctypes.data and tuple(t.shape) == r.values.shape
    back = PackedRoutes.from_buffer(r.to_buffer())
    assert back.torch_values().data_ptr() == r.values.ctypes.data  # same memory all the way


def test_pickle_roundtrip_and_arrays():
    r = PackedRoutes.from_sequences(_rand_seqs(np.random.default_rng(1), [4, 0, 2], 3, 2, 64), 64)
    assert pickle.loads(pickle.dumps(r, protocol=5)) == r
    d = r.to_arrays()
    assert set(d) == {"values", "cu_seqlens", "num_experts", "version", "digest"}
    assert PackedRoutes.from_arrays(d) == r
    legacy = {k: d[k] for k in ("values", "cu_seqlens", "num_experts")}     # no version/digest: accepted
    assert PackedRoutes.from_arrays(legacy) == r


def test_safetensors_roundtrip(tmp_path):
    from safetensors.numpy import load_file, save_file

    for E in (8, 300):
        r = PackedRoutes.from_sequences(_rand_seqs(np.random.default_rng(E), [4, 1, 2], 3, 2, E), E)
        p = tmp_path / f"r{E}.safetensors"
        save_file({f"routes.{k}": v for k, v in r.to_arrays().items()}, str(p))
        d = {k[len("routes."):]: v for k, v in load_file(str(p)).items()}
        assert PackedRoutes.from_arrays(d) == r


def test_empty_filled_in_place_like_a_capture():
    r = PackedRoutes.empty([2, 3], num_layers=2, k=2, num_experts=8)
    r.seq(0)[...] = 1
    r.seq(1)[...] = 7
    r.validate()
    back = PackedRoutes.from_buffer(r.to_buffer())
    assert back.seq(1).min() == 7 and back.seq(0).max() == 1


def test_concat():
    rng = np.random.default_rng(2)
    a = PackedRoutes.from_sequences(_rand_seqs(rng, [2, 3], 2, 2, 8), 8)
    b = PackedRoutes.from_sequences(_rand_seqs(rng, [4], 2, 2, 8), 8)
    c = PackedRoutes.concat([a, b])
    assert c.seq_lens.tolist() == [2, 3, 4]
    assert np.array_equal(c.seq(2), b.seq(0)) and np.array_equal(c.seq(1), a.seq(1))


# ---- errors -----------------------------------------------------------------------------------------
def test_error_expert_id_out_of_range():
    seqs = [np.zeros((3, 2, 2), np.int32), np.zeros((2, 2, 2), np.int32)]
    seqs[1][1, 0, 1] = 8
    with pytest.raises(InputError, match="expert id 8 >= num_experts 8") as e:
        PackedRoutes.from_sequences(seqs, 8)
    assert e.value.field == "seqs"
    with pytest.raises(InputError, match=r"expert id 8 >= num_experts 8") as e:
        PackedRoutes(np.concatenate(seqs), np.array([0, 3, 5]), 8)
    assert e.value.index == 4  # the row holding the bad id
    with pytest.raises(InputError, match="negative expert id"):
        PackedRoutes(-np.ones((1, 1, 1), np.int64), np.array([0, 1]), 8)


def test_error_layer_count_and_shape():
    with pytest.raises(InputError, match="differ from sequence 0"):
        PackedRoutes.from_sequences([np.zeros((3, 2, 2), np.int32), np.zeros((2, 3, 2), np.int32)], 8)
    with pytest.raises(InputError, match=r"\[tokens, layers, k\]"):
        PackedRoutes(np.zeros((3, 2), np.uint8), np.array([0, 3]), 8)


def test_error_cu_seqlens():
    v = np.zeros((5, 1, 1), np.uint8)
    with pytest.raises(InputError, match="non-decreasing") as e:
        PackedRoutes(v, np.array([0, 3, 2, 5]), 4)
    assert e.value.field == "cu_seqlens" and e.value.index == 2
    with pytest.raises(InputError, match="must start at 0"):
        PackedRoutes(v, np.array([1, 5]), 4)
    with pytest.raises(InputError, match="last entry 4 != number of route rows 5"):
        PackedRoutes(v, np.array([0, 4]), 4)


def test_error_corrupt_buffer():
    r = PackedRoutes.from_sequences([np.ones((3, 2, 2), np.int32)], 8)
    buf = r.to_buffer().copy()
    with pytest.raises(InputError, match="truncated"):
        PackedRoutes.from_buffer(buf[:-1])
    bad = buf.copy()
    bad[:8] = 0
    with pytest.raises(InputError, match="bad magic"):
        PackedRoutes.from_buffer(bad)
    bad = buf.copy()
    bad[buf.size - 1] = 9  # id 9 with 8 experts: the digest catches it
    with pytest.raises(InputError, match="digest"):
        PackedRoutes.from_buffer(bad)
    _reseal(bad)           # re-sealed (a buggy writer): the id check still refuses it
    with pytest.raises(InputError, match="expert id 9 >= num_experts 8"):
        PackedRoutes.from_buffer(bad)


# ---- hardening (issue 13): checksummed header, exact fields, strict from_arrays -----------------
import struct

from skyrl_numerics.replay import routes as R


def _reseal(buf):
    R._seal(buf)


def _routes(E=8, bitpack=False):
    r = PackedRoutes.from_sequences(_rand_seqs(np.random.default_rng(E), [3, 0, 2], 2, 2, E), E)
    return r, r.to_buffer(bitpack=bitpack).copy()


@pytest.mark.parametrize("E", [2, 3, 8, 9, 300])
@pytest.mark.parametrize("bitpack", [False, True])
def test_every_single_bit_flip_is_refused(E, bitpack):
    """Exhaustive: every bit of header + payload; the digest covers all of it."""
    r, buf = _routes(E, bitpack)
    for pos in range(buf.size):
        for bit in range(8):
            bad = buf.copy()
            bad[pos] ^= 1 << bit
            with pytest.raises(InputError):
                PackedRoutes.from_buffer(bad)
    assert PackedRoutes.from_buffer(buf) == r


@pytest.mark.parametrize("field,value,match", [
    ("bits", 4, "bit width 4, expected 3"),        # E = 8 bit-packed: ceil(log2 8) = 3
    ("E", 9, "bit width 3, expected 4"),           # E edited: no longer consistent with the bit width
    ("E", 300, "itemsize"),
    ("itemsize", 2, "itemsize"),
    ("flags", 2, "unknown flags"),
    ("version", 1, "unsupported version"),
    ("k", 0, "k = 0"),
    ("T", 2 ** 40, "absurd"),
])
def test_edited_header_fields_refused_even_when_resealed(field, value, match):
    r, buf = _routes(8, bitpack=True)
    names = ["magic", "version", "flags", "itemsize", "bits", "pad", "E", "L", "k", "B", "T", "nbytes", "digest"]
    vals = list(R._HEADER.unpack_from(buf[:R.HEADER_BYTES]))
    vals[names.index(field)] = value
    R._HEADER.pack_into(buf, 0, *vals)
    _reseal(buf)
    with pytest.raises(InputError, match=match):
        PackedRoutes.from_buffer(buf)


def test_buffer_length_exact_and_non_buffers():
    r, buf = _routes()
    with pytest.raises(InputError, match="truncated or inconsistent"):
        PackedRoutes.from_buffer(np.concatenate([buf, np.zeros(1, np.uint8)]))
    with pytest.raises(InputError):
        PackedRoutes.from_buffer(12345)


def test_in_place_capture_is_resealed():
    r = PackedRoutes.empty([2], num_layers=1, k=1, num_experts=4)
    buf = r.to_buffer()
    r.seq(0)[...] = 3                         # written after a first to_buffer()
    assert PackedRoutes.from_buffer(r.to_buffer()).seq(0).tolist() == [[[3]], [[3]]]


@pytest.mark.parametrize("d,field", [
    (dict(cu_seqlens=np.array([0.0, 3.0, 3.0, 5.0])), "cu_seqlens"),                   # float cu
    (dict(cu_seqlens=np.array([0, 3, 3, 5 + 2 ** 32], np.int64)), "cu_seqlens"),       # would wrap to 5
    (dict(cu_seqlens=np.array([0, 3, 3, 5], np.int64)), "cu_seqlens"),                 # not int32 on the wire
    (dict(num_experts=np.array([8.0])), "num_experts"),
    (dict(num_experts=np.array([8, 8])), "num_experts"),
    (dict(num_experts=np.array([2 ** 40])), "num_experts"),
    (dict(values=None), "values"),
    (dict(extra=np.zeros(1)), "extra"),
    (dict(version=np.array([2], np.int64)), "version"),
    (dict(digest=np.array([1], np.uint64)), "digest"),
    (dict(digest=None), "digest"),
])
def test_from_arrays_strict(d, field):
    r, _ = _routes()
    a = dict(r.to_arrays())
    for k, v in d.items():
        if v is None:
            a.pop(k)
        else:
            a[k] = v
    with pytest.raises(InputError) as e:
        PackedRoutes.from_arrays(a)
    assert e.value.field == field, str(e.value)


def test_constructor_refuses_float_cu_and_num_experts():
    v = np.zeros((3, 1, 1), np.uint8)
    with pytest.raises(InputError, match="integers"):
        PackedRoutes(v, np.array([0, 1.9, 3]), 4)
    with pytest.raises(InputError):
        PackedRoutes(v, np.array([0, 3]), 4.5)
    with pytest.raises(InputError):
        PackedRoutes(v.astype(np.float32), np.array([0, 3]), 4)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 600), st.booleans(), st.data())
def test_flip_property_refused_or_identical(E, bitpack, data):
    lens = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
    rng = np.random.default_rng(E)
    r = PackedRoutes.from_sequences(_rand_seqs(rng, lens, 2, 2, E), E)
    buf = r.to_buffer(bitpack=bitpack).copy()
    pos = data.draw(st.integers(0, buf.size - 1))
    buf[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        back = PackedRoutes.from_buffer(buf)
    except InputError:
        return
    assert back == r           # (only possible if the flip hit nothing that matters)


def test_digest_check_reads_a_large_buffer_in_place():
    """The load's digest check on a 24 MiB buffer costs no copy: ``from_buffer`` allocates < 64 KiB
    (tracemalloc; the payload is hashed through views), the stored digest is xxh3-64 of the header
    with its digest field zeroed + everything after it (computed here with xxhash directly), and it
    reaches the buffer's last byte. Its speed, as a ratio to memcpy, is in benchmarks/bench_replay.py."""
    import tracemalloc

    import xxhash

    r = PackedRoutes.from_sequences([np.random.default_rng(0).integers(0, 64, (1 << 16, 48, 8))], 64)
    buf = r.to_buffer()
    assert buf.nbytes > 24 * 2 ** 20
    tracemalloc.start()
    try:
        back = PackedRoutes.from_buffer(buf, validate=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"from_buffer allocated {peak} bytes for a {buf.nbytes}-byte buffer"
    assert np.shares_memory(back.values, buf) and back.num_tokens == 1 << 16
    head = bytearray(buf[:R.HEADER_BYTES].tobytes())
    stored = struct.unpack_from("<Q", head, R._DIGEST_AT)[0]
    head[R._DIGEST_AT:R._DIGEST_AT + 8] = bytes(8)
    assert stored == xxhash.xxh3_64(bytes(head) + buf[R.HEADER_BYTES:].tobytes()).intdigest()
    bad = buf.copy()
    bad[-1] ^= 1          # still a valid id (< 64): only the digest can see it, unvalidated
    with pytest.raises(InputError, match="digest"):
        PackedRoutes.from_buffer(bad, validate=False)
