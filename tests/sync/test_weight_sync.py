"""Delta weight sync: byte-exact round trips (bf16 / fp32 / fp8), sparse and zero-change steps,
snapshot cadence, fsspec, and every corruption case leaving the receiver's last good weights."""
from __future__ import annotations

import json
import threading

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.codec import (Zstd, digest, shuffle, tensor_bytes, unshuffle, xor_bytes,
                                       xor_reference)
from skyrl_numerics.sync.manifest import Manifest, list_versions, manifest_path, seal
from skyrl_numerics.sync.store import SyncStore
from skyrl_numerics.sync.weight_sync import DeltaPublisher, DeltaReceiver

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def raw(t: torch.Tensor) -> bytes:
    return tensor_bytes(t.contiguous()).tobytes()


def random_tensor(rng: np.random.Generator, dtype, shape) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, inf and subnormals included)."""
    size = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape))
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    b = rng.integers(0, 256, n * size, dtype=np.uint8)
    return torch.from_numpy(b).view(dtype).reshape(shape).clone()


def sparse_update(rng, t: torch.Tensor, frac: float) -> torch.Tensor:
    """Replace a random ``frac`` of the elements by other arbitrary bit patterns."""
    out = t.clone().reshape(-1)
    k = int(round(frac * out.numel()))
    idx = torch.from_numpy(rng.choice(out.numel(), size=k, replace=False))
    out[idx] = random_tensor(rng, t.dtype, (k,))
    return out.reshape(t.shape)


def make_state(seed=0, shapes=((64, 32), (7,), (3, 5, 4))):
    rng = np.random.default_rng(seed)
    return {f"t{i}.{str(dt)[6:]}": random_tensor(rng, dt, shapes[i % len(shapes)])
            for i, dt in enumerate(DTYPES)}


def assert_same_bytes(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert raw(a[k]) == raw(b[k]), k


# ---- codec ---------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 100), seed=st.integers(0, 2**31))
def test_xor_fast_path_is_bitwise_the_reference(n, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, n, dtype=np.uint8)
    assert xor_bytes(a, b).tobytes() == xor_reference(a, b).tobytes()
    assert xor_reference(a, b).tobytes() == bytes(x ^ y for x, y in zip(a.tolist(), b.tolist()))


def test_hand_computed_bf16_and_fp8_bytes():
    # bf16 1.0 = 0x3F80, next value up 1.0078125 = 0x3F81: the XOR is 0x0001, little endian
    a = torch.tensor([1.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0078125], dtype=torch.bfloat16)
    assert xor_bytes(tensor_bytes(a), tensor_bytes(b)).tolist() == [0x01, 0x00]
    # torch's fp8 bytes are the OCP E4M3FN encoding, as ml_dtypes writes it
    x = np.array([0.0, -0.0, 1.0, -2.5, 448.0, 0.001953125], dtype=np.float32)
    t = torch.from_numpy(x).to(torch.float8_e4m3fn)
    assert tensor_bytes(t).tobytes() == x.astype(ml_dtypes.float8_e4m3fn).tobytes()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 64), itemsize=st.sampled_from([1, 2, 3, 4, 8]), seed=st.integers(0, 2**31))
def test_shuffle_round_trip(n, itemsize, seed):
    b = np.random.default_rng(seed).integers(0, 256, n * itemsize, dtype=np.uint8)
    s = shuffle(b, itemsize)
    # spec: element bytes [n, itemsize] transposed to planes [itemsize, n]
    assert s.tobytes() == b.reshape(n, itemsize).T.tobytes()
    assert unshuffle(s, itemsize).tobytes() == b.tobytes()
    out = np.full(n * itemsize + 5, 7, dtype=np.uint8)  # a reused, larger buffer
    assert unshuffle(s, itemsize, out=out).tobytes() == b.tobytes()
    if itemsize == 2 and n:
        assert s[:n].tobytes() == b[0::2].tobytes()  # plane of low bytes first


def test_tensor_bytes_shares_memory():
    t = torch.zeros(4, dtype=torch.bfloat16)
    tensor_bytes(t)[0] = 0x80  # bf16 low byte of element 0
    assert t.view(torch.int16)[0].item() == 0x0080


def test_zstd_rejects_wrong_size_and_garbage():
    z = Zstd(1)
    blob = z.compress(np.arange(100, dtype=np.uint8))
    assert z.decompress(blob, 100).tolist() == list(range(100))
    with pytest.raises(ValueError):
        z.decompress(blob, 99)
    with pytest.raises(ValueError):
        z.decompress(b"not zstd", 100)


# ---- round trips -----------------------------------------------------------------------------
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), fracs=st.lists(st.sampled_from([0.0, 0.01, 0.03, 0.5, 1.0]),
                                                   min_size=1, max_size=4),
       use_shuffle=st.booleans(), every=st.integers(1, 4))
def test_delta_round_trip_byte_exact(tmp_path_factory, seed, fracs, use_shuffle, every):
    root = tmp_path_factory.mktemp("sync")
    rng = np.random.default_rng(seed)
    state = make_state(seed)
    pub = DeltaPublisher(root, snapshot_every=every, use_shuffle=use_shuffle)
    rec = DeltaReceiver(root)
    pub.publish(state)
    rec.sync()
    assert_same_bytes(state, rec.state)
    for frac in fracs:
        state = {k: sparse_update(rng, v, frac) for k, v in state.items()}
        m = pub.publish(state)
        assert rec.sync() == [m]
        assert rec.version == m.version
        assert_same_bytes(state, rec.state)


def test_sparse_update_payloads_are_small(tmp_path):
    rng = np.random.default_rng(0)
    state = {"w": torch.randn(256, 256).bfloat16()}
    pub = DeltaPublisher(tmp_path)
    full = pub.publish(state)
    w = state["w"].clone().reshape(-1)
    idx = torch.from_numpy(rng.choice(w.numel(), w.numel() // 100, replace=False))
    w[idx] += 1e-2 * w[idx]  # a small training-like update to 1 % of the elements
    delta = pub.publish({"w": w.reshape(256, 256)})
    assert delta.base_version == 0 and delta.changed == ["w"]
    assert delta.payload_nbytes < 0.05 * delta.raw_nbytes < full.payload_nbytes


@pytest.mark.parametrize("algo", ["xxh3-128", "blake2b-128"])
def test_checksum_algorithms(tmp_path, algo):
    state = make_state(10)
    pub = DeltaPublisher(tmp_path, checksum=algo)
    m = pub.publish(state)
    assert all(t.checksum.startswith(algo + ":") for t in m.tensors)
    assert all(t.checksum == digest(raw(state[t.name]), algo) for t in m.tensors)
    rec = DeltaReceiver(tmp_path)
    rec.sync()
    assert_same_bytes(state, rec.state)
    with pytest.raises(InputError, match="checksum"):
        DeltaPublisher(tmp_path, checksum="md5")


def test_zero_change_step_writes_no_payload(tmp_path):
    state = make_state(1)
    state["empty"] = torch.empty(0, 3, dtype=torch.bfloat16)
    pub = DeltaPublisher(tmp_path)
    rec = DeltaReceiver(tmp_path)
    pub.publish(state)
    rec.sync()
    m = pub.publish(state)
    assert m.base_version == 0 and m.changed == [] and m.payload_nbytes == 0
    assert not (tmp_path / "payloads" / f"{1:012d}").exists()
    assert rec.sync() == [m] and rec.version == 1
    assert_same_bytes(state, rec.state)


def test_snapshot_cadence_and_on_request(tmp_path):
    state = make_state(2)
    pub = DeltaPublisher(tmp_path, snapshot_every=3)
    bases = [pub.publish(state).base_version for _ in range(7)]
    assert bases == [None, 0, 1, None, 3, 4, None]
    assert pub.publish(state, full=True).base_version is None


def test_receiver_catches_up_from_latest_snapshot_after_prune(tmp_path):
    rng = np.random.default_rng(3)
    state = make_state(3)
    pub = DeltaPublisher(tmp_path, snapshot_every=3)
    for _ in range(8):                     # versions 0..7, snapshots at 0, 3, 6
        pub.publish(state)
        state = {k: sparse_update(rng, v, 0.05) for k, v in state.items()}
    assert pub.prune(keep_last=2) == [0, 1, 2, 3, 4, 5]
    assert list_versions(pub.store) == [6, 7]
    late = DeltaReceiver(tmp_path)
    assert [m.version for m in late.sync()] == [6, 7]
    # a publisher reopened on the same root continues the numbering
    assert DeltaPublisher(tmp_path).next_version == 8


def test_module_target_updated_in_place(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).bfloat16()
    ptr = model[0].weight.data_ptr()
    rec = DeltaReceiver(tmp_path, model, version=None)
    pub = DeltaPublisher(tmp_path)
    new = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    pub.publish(new)
    rec.sync()
    assert model[0].weight.data_ptr() == ptr
    assert_same_bytes(new, dict(model.state_dict()))
    new["0.bias"] = new["0.bias"] * 3
    pub.publish(new)
    rec.sync()
    assert_same_bytes(new, dict(model.state_dict()))


def test_receiver_with_claimed_base(tmp_path):
    state = make_state(4)
    pub = DeltaPublisher(tmp_path)
    pub.publish(state)
    mine = {k: v.clone() for k, v in state.items()}
    rec = DeltaReceiver(tmp_path, mine, version=0)
    new = {k: v.clone() for k, v in state.items()}
    new["t1.float32"][0] = 1.5
    pub.publish(new)
    rec.sync()
    assert_same_bytes(new, mine)  # the caller's dict tensors were updated in place


@pytest.mark.parametrize("url", ["memory://skyrl-ws-test/run"])
def test_fsspec_memory_round_trip(url):
    import fsspec

    rng = np.random.default_rng(5)
    state = make_state(5)
    pub = DeltaPublisher(url, snapshot_every=2)
    rec = DeltaReceiver(url)
    for _ in range(4):
        pub.publish(state)
        rec.sync()
        assert_same_bytes(state, rec.state)
        state = {k: sparse_update(rng, v, 0.03) for k, v in state.items()}
    fs = fsspec.filesystem("memory")
    files = fs.find("/skyrl-ws-test/run")
    assert files and not any(".tmp-" in f for f in files)
    assert list_versions(SyncStore(url)) == [0, 1, 2, 3]
    fs.rm("/skyrl-ws-test", recursive=True)


def test_file_url_is_a_local_path(tmp_path):
    state = make_state(13)
    DeltaPublisher(f"file://{tmp_path}").publish(state)
    assert (tmp_path / manifest_path(0)).exists()
    rec = DeltaReceiver(str(tmp_path))
    rec.sync()
    assert_same_bytes(state, rec.state)


def test_manifest_is_written_after_its_payloads(tmp_path):
    order = []

    class Recording(SyncStore):
        def write(self, rel, data):
            order.append(rel)
            super().write(rel, data)

    pub = DeltaPublisher(tmp_path)
    pub.store = Recording(tmp_path)
    pub.publish(make_state(6))
    assert order[-1] == manifest_path(0) and all(r.startswith("payloads/") for r in order[:-1])
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_prepare_in_a_thread_then_commit(tmp_path):
    state = make_state(7)
    pub = DeltaPublisher(tmp_path)
    rec = DeltaReceiver(tmp_path)
    pub.publish(state)
    rec.sync()
    new = {k: sparse_update(np.random.default_rng(8), v, 0.1) for k, v in state.items()}
    pub.publish(new)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("p", rec.prepare(1)))
    th.start()
    th.join()
    assert_same_bytes(state, rec.state)  # prepare touched nothing
    rec.commit(out["p"])
    assert_same_bytes(new, rec.state)
    with pytest.raises(InputError, match="out of order"):
        rec.commit(out["p"])  # stale: the receiver already holds version 1
    pub.publish(state, full=True)                         # version 2
    pub.publish({k: v.clone() for k, v in new.items()})   # version 3, a delta on 2
    p2 = rec.prepare(2)
    rec.prepare(2)  # a second prepare reuses the staging buffers: the first one is void
    with pytest.raises(InputError, match="stale"):
        rec.commit(p2)
    assert rec.version == 1
    assert_same_bytes(new, rec.state)


# ---- corruption and misuse: clear errors, last good weights kept -----------------------------
@pytest.fixture
def synced(tmp_path):
    """Versions 0 (full) and 1 (delta changing every tensor); a receiver at version 0."""
    rng = np.random.default_rng(9)
    s0 = make_state(9)
    s1 = {k: sparse_update(rng, v, 0.2) for k, v in s0.items()}
    pub = DeltaPublisher(tmp_path)
    pub.publish(s0)
    m1 = pub.publish(s1)
    rec = DeltaReceiver(tmp_path)
    rec.apply(0)
    return tmp_path, pub, rec, s0, s1, m1


def expect_kept(rec, s0, match, field=None, version=1):
    with pytest.raises(InputError, match=match) as ei:
        rec.apply(version)
    if field is not None:
        assert ei.value.field == field
    assert rec.version == 0
    assert_same_bytes(s0, rec.state)
    return ei.value


def edit_manifest(root, version, fn, reseal=True, key=None):
    """Edit a manifest; ``reseal``: recompute its digest (a buggy writer, or a forger without the
    key) so the checks behind the digest are reached."""
    p = root / manifest_path(version)
    d = json.loads(p.read_text())
    fn(d)
    if reseal:
        seal(d, key)
    p.write_text(json.dumps(d))


def test_corrupt_payload(synced):
    root, _, rec, s0, s1, m1 = synced
    last = m1.tensors[-1]  # the other tensors verify fine first: nothing may be half-applied
    p = root / last.payload
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))
    expect_kept(rec, s0, "corrupt", field=last.name)


def test_truncated_payload(synced):
    root, _, rec, s0, _, m1 = synced
    p = root / m1.tensors[0].payload
    p.write_bytes(p.read_bytes()[:-3])
    expect_kept(rec, s0, "corrupt", field=m1.tensors[0].name)


def test_missing_payload_file(synced):
    root, _, rec, s0, _, m1 = synced
    (root / m1.tensors[1].payload).unlink()
    expect_kept(rec, s0, "missing", field=m1.tensors[1].name)


def test_payload_that_verifies_but_does_not_decode(synced):
    root, _, rec, s0, _, m1 = synced
    e = m1.tensors[0]
    junk = b"\x00" * 32
    (root / e.payload).write_bytes(junk)

    def fix(d):
        d["tensors"][0].update(payload_nbytes=len(junk), payload_checksum=digest(junk))

    edit_manifest(root, 1, fix)
    expect_kept(rec, s0, "does not decode", field=e.name)


def test_missing_and_garbled_manifest(synced):
    root, _, rec, s0, _, _ = synced
    expect_kept(rec, s0, "missing", field="manifest", version=2)
    (root / manifest_path(1)).write_text("{not json")
    expect_kept(rec, s0, "not valid JSON")


def test_out_of_order_versions(synced):
    root, pub, rec, s0, s1, _ = synced
    pub.publish(s1)  # version 2, base 1
    expect_kept(rec, s0, "mismatched base", field="base_version", version=2)
    rec.apply(1)
    with pytest.raises(InputError, match="out of order"):
        rec.apply(0)  # an older snapshot
    with pytest.raises(InputError, match="out of order"):
        rec.apply(1)  # the same delta twice
    assert rec.version == 1
    assert_same_bytes(s1, rec.state)


def test_delta_needs_a_snapshot_first(synced):
    root = synced[0]
    with pytest.raises(InputError, match="full snapshot first"):
        DeltaReceiver(root).apply(1)


def test_mismatched_base_bytes(synced):
    """The receiver claims version 0 but holds other bytes: the decoded digest catches it."""
    root, _, _, s0, _, m1 = synced
    wrong = {k: v.clone() for k, v in s0.items()}
    name = m1.tensors[0].name
    wrong[name].view(-1).view(torch.uint8)[0] ^= 1
    rec = DeltaReceiver(root, wrong, version=0)
    with pytest.raises(InputError, match="checksum mismatch") as ei:
        rec.apply(1)
    assert ei.value.field == name and rec.version == 0


def test_unknown_tensor_name(synced):
    root, _, rec, s0, _, _ = synced
    edit_manifest(root, 1, lambda d: d["tensors"][1].update(name="layers.9.nope"))
    err = expect_kept(rec, s0, "unknown tensor", field="layers.9.nope")
    assert "layers.9.nope" in str(err)


def test_dtype_and_shape_mismatch(synced):
    root, _, rec, s0, _, m1 = synced
    name = m1.tensors[0].name  # a bf16 [64, 32] tensor
    good = (root / manifest_path(1)).read_text()
    edit_manifest(root, 1, lambda d: d["tensors"][0].update(dtype="float16"))
    err = expect_kept(rec, s0, "dtype float16", field=name)
    assert "bfloat16" in str(err)
    (root / manifest_path(1)).write_text(good)
    edit_manifest(root, 1, lambda d: d["tensors"][0].update(shape=[32, 64]))
    expect_kept(rec, s0, "shape", field=name)


def test_manifest_schema_errors(synced):
    root, _, rec, s0, _, m1 = synced
    good = (root / manifest_path(1)).read_text()
    cases = [
        (lambda d: d["tensors"][0].update(nbytes=5), "nbytes", m1.tensors[0].name),
        (lambda d: d["tensors"][0].update(dtype="float99"), "unknown dtype", m1.tensors[0].name),
        (lambda d: d["tensors"][0].pop("checksum"), "missing field", m1.tensors[0].name),
        (lambda d: d.update(filters=["shuffle"]), "filters", "filters"),
        (lambda d: d.update(format="other"), "format", "format"),
        (lambda d: d.update(base_version=7), "base_version", "base_version"),
        (lambda d: d["tensors"].append(d["tensors"][0]), "listed twice", "tensors"),
        (lambda d: d["tensors"][0].update(checksum="md5:00"), "checksum", m1.tensors[0].name),
    ]
    for fn, match, field in cases:
        (root / manifest_path(1)).write_text(good)
        edit_manifest(root, 1, fn)
        expect_kept(rec, s0, match, field=field)
    (root / manifest_path(1)).write_text(good)
    rec.apply(1)  # the untouched manifest still applies
    assert rec.version == 1


def test_receiver_missing_tensor_in_manifest(synced):
    root, _, rec, s0, _, m1 = synced
    edit_manifest(root, 1, lambda d: d["tensors"].pop(2))
    expect_kept(rec, s0, "missing from the manifest", field=m1.tensors[2].name)


def test_publisher_input_errors(tmp_path):
    pub = DeltaPublisher(tmp_path)
    with pytest.raises(InputError, match="empty"):
        pub.publish({})
    with pytest.raises(InputError) as ei:
        pub.publish({"w": np.zeros(3)})
    assert ei.value.field == "w"
    pub.publish({"w": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(InputError, match="full=True") as ei:
        pub.publish({"w": torch.zeros(4), "b": torch.zeros(2)})
    assert ei.value.field == "w"
    with pytest.raises(InputError, match="missing"):
        pub.publish({"w": torch.zeros(3)})
    with pytest.raises(InputError, match="new since"):
        pub.publish({"w": torch.zeros(3), "b": torch.zeros(2), "c": torch.zeros(1)})
    assert pub.publish({"w": torch.zeros(4)}, full=True).base_version is None
    with pytest.raises(InputError, match="snapshot_every"):
        DeltaPublisher(tmp_path, snapshot_every=0)


def test_manifest_json_round_trip(synced):
    root, _, _, _, _, m1 = synced
    again = Manifest.from_json(m1.to_json())
    assert again == m1


def test_failed_publish_keeps_the_previous_base(tmp_path):
    """A publish that dies before its manifest is written leaves no version and the old XOR
    base: the next publish is a correct delta against the last PUBLISHED version."""
    rng = np.random.default_rng(11)
    s0 = make_state(11)
    s1 = {k: sparse_update(rng, v, 0.1) for k, v in s0.items()}
    s2 = {k: sparse_update(rng, v, 0.1) for k, v in s1.items()}

    class FailOnManifest(SyncStore):
        fail = True

        def write(self, rel, data):
            if rel.startswith("manifests/") and self.fail:
                self.fail = False
                raise OSError("disk full")
            super().write(rel, data)

    pub = DeltaPublisher(tmp_path)
    pub.store = FailOnManifest(tmp_path)
    rec = DeltaReceiver(tmp_path)
    pub.store.fail = False
    pub.publish(s0)
    pub.store.fail = True
    with pytest.raises(OSError):
        pub.publish(s1)
    assert list_versions(pub.store) == [0] and pub.next_version == 1
    m = pub.publish(s2)  # version 1, a delta s0 -> s2
    assert (m.version, m.base_version) == (1, 0)
    rec.sync()
    assert_same_bytes(s2, rec.state)


def test_sync_stops_at_a_bad_version_with_the_last_good_weights(tmp_path):
    rng = np.random.default_rng(12)
    states = [make_state(12)]
    for _ in range(3):
        states.append({k: sparse_update(rng, v, 0.1) for k, v in states[-1].items()})
    pub = DeltaPublisher(tmp_path)
    manifests = [pub.publish(s) for s in states]
    bad = tmp_path / manifests[2].tensors[0].payload
    bad.write_bytes(bad.read_bytes()[::-1])
    rec = DeltaReceiver(tmp_path)
    with pytest.raises(InputError, match="corrupt"):
        rec.sync()
    assert rec.version == 1
    assert_same_bytes(states[1], rec.state)


@pytest.mark.parametrize("workers", [1, 4])
def test_payload_io_overlaps_up_to_io_workers(tmp_path, workers):
    """Object stores answer each request after a round trip: reads and writes of one version are
    kept in flight together, at most ``io_workers`` at a time, and still land in order."""
    import time as _time

    class Slow(SyncStore):
        lock = threading.Lock()
        now = peak = 0

        def _enter(self):
            with self.lock:
                Slow.now += 1
                Slow.peak = max(Slow.peak, Slow.now)
            _time.sleep(0.02)
            with self.lock:
                Slow.now -= 1

        def read(self, rel, **kw):
            if rel.startswith("payloads/"):
                self._enter()
            return super().read(rel, **kw)

        def write(self, rel, data):
            if rel.startswith("payloads/"):
                self._enter()
            super().write(rel, data)

    state = {f"w{i}": torch.full((16,), float(i)) for i in range(8)}
    pub = DeltaPublisher(tmp_path, io_workers=workers)
    pub.store = Slow(tmp_path)
    pub.publish(state)
    assert Slow.peak == workers
    Slow.peak = 0
    rec = DeltaReceiver(tmp_path, io_workers=workers)
    rec.store = Slow(tmp_path)
    rec.sync()
    assert Slow.peak == workers
    assert_same_bytes(state, rec.state)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), which=st.integers(0, 10**6), pos=st.integers(0, 10**6),
       bit=st.integers(0, 7))
def test_any_flipped_payload_bit_is_caught(tmp_path_factory, seed, which, pos, bit):
    root = tmp_path_factory.mktemp("flip")
    rng = np.random.default_rng(seed)
    s0 = make_state(seed)
    s1 = {k: sparse_update(rng, v, 0.05) for k, v in s0.items()}
    pub = DeltaPublisher(root)
    pub.publish(s0)
    m1 = pub.publish(s1)
    rec = DeltaReceiver(root)
    rec.apply(0)
    with_payload = [e for e in m1.tensors if e.payload]
    e = with_payload[which % len(with_payload)]
    p = root / e.payload
    b = bytearray(p.read_bytes())
    b[pos % len(b)] ^= 1 << bit
    p.write_bytes(bytes(b))
    with pytest.raises(InputError, match="corrupt") as ei:
        rec.apply(1)
    assert ei.value.field == e.name and rec.version == 0
    assert_same_bytes(s0, rec.state)


# ---- hardening (issue 13): manifest digest, strict fields, HMAC, checks before touching -------
@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv("SKYRL_NUMERICS_SYNC_KEY", raising=False)


def _swap_same_shape(d):
    """Swap the names of two same-shape entries (build a state where that exists)."""
    ts = d["tensors"]
    a, b = [i for i, t in enumerate(ts) if t["shape"] == ts[0]["shape"] and t["dtype"] == ts[0]["dtype"]][:2]
    ts[a]["name"], ts[b]["name"] = ts[b]["name"], ts[a]["name"]


def _twin_state(seed):
    rng = np.random.default_rng(seed)
    return {n: random_tensor(rng, torch.bfloat16, (8, 4)) for n in ("a", "b", "c")} | \
        {"d": random_tensor(rng, torch.float32, (5,))}


UNSEALED_EDITS = [
    ("rename", lambda d: d["tensors"][0].update(name="zzz")),
    ("drop", lambda d: d["tensors"].pop(1)),
    ("add", lambda d: d["tensors"].append(dict(d["tensors"][0], name="extra"))),
    ("transpose", lambda d: d["tensors"][0].update(shape=d["tensors"][0]["shape"][::-1])),
    ("dtype", lambda d: d["tensors"][0].update(dtype="float16")),
    ("empty names", lambda d: d.update(tensors=[])),
    ("swap", _swap_same_shape),
    ("version", lambda d: d.update(created_unix=d["created_unix"] + 1)),
]


@pytest.mark.parametrize("what,fn", UNSEALED_EDITS)
@pytest.mark.parametrize("holding", [False, True])
def test_unsealed_manifest_edits_refused(tmp_path, what, fn, holding):
    s0 = _twin_state(1)
    pub = DeltaPublisher(tmp_path)
    pub.publish(s0)
    edit_manifest(tmp_path, 0, fn, reseal=False)
    target = {k: v.clone() for k, v in s0.items()} if holding else None
    before = {k: v.clone() for k, v in target.items()} if holding else None
    rec = DeltaReceiver(tmp_path, target)
    with pytest.raises(InputError, match="digest") as ei:
        rec.apply(0)
    assert ei.value.field == "manifest_digest" and "000000000000" in str(ei.value)
    assert rec.version is None
    if holding:
        assert_same_bytes(before, rec.state)
    else:
        assert rec.state == {}


def test_resealed_edits_still_refused_before_touching(tmp_path):
    """Forged digests (no key): the receiver's own checks against the model still refuse them."""
    rng = np.random.default_rng(2)
    s0 = _twin_state(2)
    s1 = {k: sparse_update(rng, v, 0.3) for k, v in s0.items()}
    pub = DeltaPublisher(tmp_path)
    pub.publish(s0)
    pub.publish(s1)
    good = (tmp_path / manifest_path(1)).read_text()
    held = {k: v.clone() for k, v in s0.items()}
    rec = DeltaReceiver(tmp_path, held, version=0)
    for fn, match in [(lambda d: d["tensors"][0].update(name="zzz"), "unknown tensor"),
                      (lambda d: d["tensors"].pop(1), "missing from the manifest"),
                      (lambda d: d["tensors"][0].update(shape=[4, 8], ), "shape"),
                      (lambda d: d["tensors"][3].update(dtype="int32"), "dtype"),
                      (lambda d: d.update(tensors=[]), "no tensors"),
                      (_swap_same_shape, "checksum mismatch")]:      # delta: XOR against the wrong base
        (tmp_path / manifest_path(1)).write_text(good)
        edit_manifest(tmp_path, 1, fn)
        with pytest.raises(InputError, match=match):
            rec.apply(1)
        assert rec.version == 0
        assert_same_bytes(s0, rec.state)
    # a fresh receiver told what to expect checks the first snapshot too
    pub.publish(s1, full=True)                                         # version 2
    edit_manifest(tmp_path, 2, lambda d: d["tensors"][0].update(name="zzz"))
    fresh = DeltaReceiver(tmp_path, expect=s0)
    with pytest.raises(InputError, match="unknown tensor"):
        fresh.apply(2)
    assert fresh.state == {} and fresh.version is None


MALFORMED = [
    (lambda d: d["tensors"][0].update(shape="abc"), "shape"),
    (lambda d: d["tensors"][0].update(shape=[1e300]), "shape"),
    (lambda d: d["tensors"][0].update(shape=[True, 2]), "shape"),
    (lambda d: d["tensors"][0].update(shape=[2 ** 40, 2 ** 40]), "shape|nbytes"),
    (lambda d: d["tensors"][0].update(shape=[2 ** 20, 2 ** 20], nbytes=2 ** 41), "nbytes"),
    (lambda d: d["tensors"][0].update(nbytes="5"), "nbytes"),
    (lambda d: d["tensors"][0].update(nbytes=None), "nbytes"),
    (lambda d: d["tensors"][0].update(dtype=["bfloat16"]), "dtype"),
    (lambda d: d["tensors"][0].update(name=""), "name"),
    (lambda d: d["tensors"][0].update(name=7), "name"),
    (lambda d: d["tensors"][0].update(payload="../../etc/passwd"), "payload"),
    (lambda d: d["tensors"][0].update(payload=7), "payload"),
    (lambda d: d["tensors"][0].update(payload_nbytes=-1), "payload_nbytes"),
    (lambda d: d["tensors"][0].update(payload_checksum=None), "payload_checksum"),
    (lambda d: d["tensors"][0].update(extra=1), "unknown field"),
    (lambda d: d.update(level="x"), "level"),
    (lambda d: d.update(level=1.5), "level"),
    (lambda d: d.update(created_unix=float("nan")), "created_unix"),
    (lambda d: d.update(created_unix="now"), "created_unix"),
    (lambda d: d.update(version=True), "version"),
    (lambda d: d.update(version=2 ** 80), "version"),
    (lambda d: d.update(base_version=0.0), "base_version"),
    (lambda d: d.update(filters="xor"), "filters"),
    (lambda d: d.update(filters=["xor", "xor", "shuffle"]), "filters"),
    (lambda d: d.update(tensors={"a": 1}), "tensors"),
    (lambda d: d["tensors"].__setitem__(0, [1, 2]), "name"),
    (lambda d: d.update(extra=[[[[1]]]]), "unknown field"),
]


@pytest.mark.parametrize("fn,match", MALFORMED)
def test_malformed_fields_are_input_errors(synced, fn, match):
    root, _, rec, s0, _, _ = synced
    edit_manifest(root, 1, fn)
    err = expect_kept(rec, s0, match)
    assert "000000000001" in str(err) and "\n" not in str(err)


def test_deep_nesting_non_finite_and_directory_payload(synced):
    root, _, rec, s0, _, m1 = synced
    good = (root / manifest_path(1)).read_text()
    (root / manifest_path(1)).write_text("[" * 100_000 + "]" * 100_000)
    expect_kept(rec, s0, "not valid JSON")
    (root / manifest_path(1)).write_text(good.replace('"level": 1', '"level": 1e999'))
    expect_kept(rec, s0, "digest|level")
    (root / manifest_path(1)).write_text(good)
    p = root / m1.tensors[0].payload
    p.unlink()
    p.mkdir()
    expect_kept(rec, s0, "directory", field=m1.tensors[0].name)


def test_hmac_signing(tmp_path, monkeypatch):
    s0 = make_state(3)
    pub = DeltaPublisher(tmp_path, key=b"shared secret")
    m = pub.publish(s0)
    d = json.loads((tmp_path / manifest_path(0)).read_text())
    assert d["signature"].startswith("hmac-sha256:") and d["manifest_digest"].startswith(("xxh3", "blake2b"))
    rec = DeltaReceiver(tmp_path, key="shared secret")
    rec.sync()
    assert_same_bytes(s0, rec.state)
    with pytest.raises(InputError, match="signature does not verify") as ei:
        DeltaReceiver(tmp_path, key=b"other").apply(0)
    assert ei.value.field == "signature"
    # an edit resealed without the key (digest right, signature stale or dropped): refused
    edit_manifest(tmp_path, 0, _swap_names_any, reseal=True)          # seal(d, None) drops the signature
    with pytest.raises(InputError, match="not signed"):
        DeltaReceiver(tmp_path, key=b"shared secret").apply(0)
    # unsigned manifests are refused when the key comes from the environment
    unsigned = tmp_path / "u"
    DeltaPublisher(unsigned).publish(s0)
    monkeypatch.setenv("SKYRL_NUMERICS_SYNC_KEY", "shared secret")
    held = {k: v.clone() for k, v in s0.items()}
    rec2 = DeltaReceiver(unsigned, held, version=None)
    with pytest.raises(InputError, match="not signed"):
        rec2.apply(0)
    assert_same_bytes(s0, rec2.state)
    signed = tmp_path / "s"
    DeltaPublisher(signed).publish(s0)                                 # env key: signed
    assert DeltaReceiver(signed).apply(0).version == 0
    with pytest.raises(InputError, match="key"):
        DeltaPublisher(tmp_path / "x", key=b"")


def _swap_names_any(d):
    ts = d["tensors"]
    ts[0]["name"], ts[1]["name"] = ts[1]["name"], ts[0]["name"]


def test_max_bytes(synced):
    root, _, rec, s0, _, _ = synced
    with pytest.raises(InputError, match="max_bytes"):
        DeltaReceiver(root, max_bytes=10).apply(0)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats()
                           | st.text(max_size=6), lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=4), c, max_size=2), max_leaves=6)


@settings(max_examples=120, deadline=None)
@given(data=st.data(), reseal=st.booleans(), full=st.booleans())
def test_any_single_field_edit_refused_or_bitwise_correct(tmp_path_factory, data, reseal, full):
    root = tmp_path_factory.mktemp("edit")
    rng = np.random.default_rng(5)
    s0 = make_state(5)
    s1 = {k: sparse_update(rng, v, 0.2) for k, v in s0.items()}
    pub = DeltaPublisher(root)
    pub.publish(s0)
    pub.publish(s1, full=full)
    d = json.loads((root / manifest_path(1)).read_text())
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(d["tensors"]) - 1))
        obj = d["tensors"][i]
    else:
        obj = d
    key = data.draw(st.sampled_from(sorted(obj)))
    obj[key] = data.draw(JSON_VALUES)
    if reseal:
        seal(d)
    (root / manifest_path(1)).write_text(json.dumps(d))
    held = {k: v.clone() for k, v in s0.items()}
    rec = DeltaReceiver(root, held, version=0)
    try:
        rec.apply(1)
    except InputError as e:
        assert "\n" not in str(e)
        assert rec.version == 0
        assert_same_bytes(s0, rec.state)
        return
    assert rec.version == 1
    assert_same_bytes(s1, rec.state)                 # accepted: then it is exactly version 1


@settings(max_examples=80, deadline=None)
@given(pos=st.integers(0, 10 ** 6), bit=st.integers(0, 7))
def test_any_manifest_bit_flip_refused_or_bitwise_correct(tmp_path_factory, pos, bit):
    root = tmp_path_factory.mktemp("mflip")
    rng = np.random.default_rng(6)
    s0 = make_state(6)
    s1 = {k: sparse_update(rng, v, 0.2) for k, v in s0.items()}
    pub = DeltaPublisher(root)
    pub.publish(s0)
    pub.publish(s1)
    p = root / manifest_path(1)
    b = bytearray(p.read_bytes())
    b[pos % len(b)] ^= 1 << bit
    p.write_bytes(bytes(b))
    rec = DeltaReceiver(root)
    rec.apply(0)
    try:
        rec.apply(1)
    except InputError:
        assert rec.version == 0
        assert_same_bytes(s0, rec.state)
        return
    assert_same_bytes(s1, rec.state)
