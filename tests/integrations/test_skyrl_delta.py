"""SkyRL 0.4's checkpoint-delta weight sync and ours, both directions, with SkyRL's own code.

Store level (no server): SkyRL's ``DeltaCheckpointPublisher`` writes, our ``SkyrlDeltaReceiver``
applies (bitwise, against SkyRL's own ``LocalCheckpointStore``); our ``SkyrlLayoutPublisher``
writes SkyRL's exact bytes and SkyRL's reader applies them; bad stores are refused naming the
file, tensor and version, with nothing applied; a receiver that requires signatures refuses the
format.

Server level: ONE ``skyrl-numerics serve``-equivalent server for the module (:func:`delta_server`:
``VLLMServer`` on 127.0.0.1 with ``--api-key``, the tiny Qwen3-MoE). No sync key: SkyRL's publisher
cannot sign, so a server with one refuses SkyRL's stores at init — that refusal is checked at the
receiver the backend uses (``test_a_sync_key_refuses_skyrls_unsigned_store``). SkyRL's unchanged
``DeltaTrainerWeightTransferEngine`` and ``SkyrlWeightSyncClient`` sync it (the client's session is
given the key: it sends no ``Authorization`` of its own). "Served weights" are checked by what the
server computes (token ids, sampled and prompt logprobs of fixed seeded requests, bit for bit, as
tests/e2e/test_server_sync.py does). Every server test leaves the server serving the checkpoint's
own weights.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import requests
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.skyrl_publisher import SkyrlLayoutPublisher
from skyrl_numerics.sync.skyrl_receiver import SkyrlDeltaReceiver

API_KEY = "delta-api-key"
CHECKPOINT = "backends.skyrl_train.weight_sync.delta.checkpoint"


# ---- store level ------------------------------------------------------------------------------
def _base(tmp_path, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {"model.a.weight": torch.randn(8, 16, generator=g).bfloat16(),
         "model.b.bias": torch.randn(16, generator=g),
         "model.c.weight": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
         "model.d.weight": torch.randn(6, generator=g).bfloat16()}
    base = tmp_path / "base"
    base.mkdir()
    save_file(w, str(base / "model.safetensors"))
    return base, w


def _steps(w, n=3):
    """``n`` trainer versions: small moves of a and b, c every other step, d never."""
    out = []
    for i in range(n):
        w = dict(w)
        w["model.a.weight"] = (w["model.a.weight"].float() + 0.01 * (i + 1)).bfloat16()
        w["model.b.bias"] = w["model.b.bias"] * 1.001
        if i % 2 == 0:
            w["model.c.weight"] = (w["model.c.weight"].float() * 1.25).to(torch.float8_e4m3fn)
        out.append(w)
    return out


def _skyrl_publish(skyrl, base, root, staging, states):
    pub = skyrl(CHECKPOINT).DeltaCheckpointPublisher(str(base), str(root), str(staging),
                                                      publish_num_workers=1)
    for s in states:
        pub.publish(pub.create_delta_files(list(s.items())))


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k


def test_skyrls_store_applies_bitwise(skyrl, tmp_path):
    """SkyRL's publisher writes 3 versions; ours applies them one by one and all at once, equal to
    the trainer's tensors and to SkyRL's own reader, bit for bit (fp8 and unchanged tensors too)."""
    base, w = _base(tmp_path)
    states = _steps(w)
    _skyrl_publish(skyrl, base, tmp_path / "sync", tmp_path / "staging", states)
    r = SkyrlDeltaReceiver(tmp_path / "sync", base)
    for v, s in enumerate(states, 1):
        p = r.commit(r.prepare(v))
        assert r.version == v and p.manifests[0].version == v
        _same(r.state, s)
    assert "model.d.weight" not in p.manifests[0].changed      # unchanged: omitted by SkyRL
    r2 = SkyrlDeltaReceiver(tmp_path / "sync", base)
    assert r2.sync().version == 3 and r2.sync() is None
    _same(r2.state, states[-1])
    ref = skyrl(CHECKPOINT).LocalCheckpointStore(str(base), str(tmp_path / "local"))
    ref.fetch(target_version=3, sync_dir=str(tmp_path / "sync"))
    _same(load_file(str(tmp_path / "local" / "weights" / "model.safetensors")), r2.state)


def test_our_publish_is_skyrls_bytes_and_skyrls_reader_applies_it(skyrl, tmp_path):
    """Same trainer versions through SkyRL's publisher and ours: the same manifests and payload
    bytes; SkyRL's LocalCheckpointStore applies ours to the trainer's tensors, bit for bit."""
    base, w = _base(tmp_path)
    states = _steps(w)
    _skyrl_publish(skyrl, base, tmp_path / "theirs", tmp_path / "staging", states)
    pub = SkyrlLayoutPublisher(tmp_path / "ours", base)
    for s in states:
        pub.publish(s)
    for v in (1, 2, 3):
        d = f"delta-{v:08d}"
        assert (json.loads((tmp_path / "ours" / d / "manifest.json").read_text())
                == json.loads((tmp_path / "theirs" / d / "manifest.json").read_text()))
        name = "delta-rank00000-file000000.safetensors"
        _same(load_file(str(tmp_path / "ours" / d / name)), load_file(str(tmp_path / "theirs" / d / name)))
    for v in (1, 3):
        ref = skyrl(CHECKPOINT).LocalCheckpointStore(str(base), str(tmp_path / f"local{v}"))
        ref.fetch(target_version=v, sync_dir=str(tmp_path / "ours"))
        _same(load_file(str(tmp_path / f"local{v}" / "weights" / "model.safetensors")),
              states[v - 1])


_DT = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


@settings(max_examples=12)
@given(st.data())
def test_round_trip_any_bits_through_skyrls_reader(skyrl, tmp_path_factory, data):
    """Arbitrary bit patterns (NaN payloads, -0.0, every fp8 code), sparse and empty updates: our
    publisher -> SkyRL's reader and our receiver, both byte-exact."""
    tmp = tmp_path_factory.mktemp("prop")
    shapes = {f"t{i}": (data.draw(st.sampled_from(list(_DT))), data.draw(st.integers(1, 40)))
              for i in range(data.draw(st.integers(1, 3)))}

    def rand(dt, n):
        raw = data.draw(st.binary(min_size=n * torch.empty((), dtype=_DT[dt]).element_size(),
                                  max_size=n * torch.empty((), dtype=_DT[dt]).element_size()))
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(_DT[dt]).clone()

    base = {k: rand(dt, n) for k, (dt, n) in shapes.items()}
    (tmp / "base").mkdir()
    save_file(base, str(tmp / "base" / "model.safetensors"))
    pub = SkyrlLayoutPublisher(tmp / "sync", tmp / "base")
    states, cur = [], dict(base)
    for _ in range(data.draw(st.integers(1, 3))):
        cur = {k: (rand(*shapes[k]) if data.draw(st.booleans()) else v) for k, v in cur.items()}
        pub.publish(cur)
        states.append(cur)
    r = SkyrlDeltaReceiver(tmp / "sync", tmp / "base")
    r.sync()
    _same(r.state, states[-1])
    ref = skyrl(CHECKPOINT).LocalCheckpointStore(str(tmp / "base"), str(tmp / "local"))
    ref.fetch(target_version=len(states), sync_dir=str(tmp / "sync"))
    ref.validate_ready(len(states))
    # what SkyRL's engine loads: its mutable copy, or the base when no version changed a byte
    folder = ref.weights_dir if ref.weights_dir.exists() else tmp / "base"
    _same(load_file(str(folder / "model.safetensors")), states[-1])


def test_a_sync_key_refuses_skyrls_unsigned_store(skyrl, tmp_path, monkeypatch):
    base, w = _base(tmp_path)
    _skyrl_publish(skyrl, base, tmp_path / "sync", tmp_path / "staging", _steps(w, 1))
    with pytest.raises(InputError, match="no manifest digest or signature.*requires signed") as e:
        SkyrlDeltaReceiver(tmp_path / "sync", base, key="k")
    assert e.value.field == "signature"
    monkeypatch.setenv("SKYRL_NUMERICS_SYNC_KEY", "k")   # the server's way: its environment
    with pytest.raises(InputError, match="SKYRL_NUMERICS_SYNC_KEY"):
        SkyrlDeltaReceiver(tmp_path / "sync", base)


def test_our_receiver_names_skyrls_store_and_its_reader(skyrl, tmp_path):
    from skyrl_numerics.sync.weight_sync import DeltaReceiver

    base, w = _base(tmp_path)
    _skyrl_publish(skyrl, base, tmp_path / "sync", tmp_path / "staging", _steps(w, 2))
    with pytest.raises(InputError, match=r"SkyRL checkpoint-delta store .*2 version\(s\).*"
                                         r"SkyrlDeltaReceiver") as e:
        DeltaReceiver(tmp_path / "sync").sync()
    assert e.value.field == "root"
    with pytest.raises(InputError, match="no version under .*delta-%08d/manifest.json"):
        SkyrlDeltaReceiver(tmp_path / "empty", base).sync()


def _edit_manifest(root, v, fn):
    p = root / f"delta-{v:08d}" / "manifest.json"
    d = json.loads(p.read_text())
    fn(d)
    p.write_text(json.dumps(d))


def _flip_payload(root, v):
    p = root / f"delta-{v:08d}" / "delta-rank00000-file000000.safetensors"
    b = bytearray(p.read_bytes())
    b[-3] ^= 0x5A                      # inside the last tensor's compressed bytes
    p.write_bytes(bytes(b))


def _rename(d, new="model.zzz.weight"):
    d["tensors"][0]["name"] = new


def _reshape(d):
    t = d["tensors"][0]                # model.a.weight bf16 [8, 16] -> [16, 8]: same byte count
    t["shape"] = [16, 8]


BAD = {
    "unknown tensor": (lambda root: _edit_manifest(root, 2, _rename),
                       r"delta-00000002/manifest.json.*version 2: unknown tensor 'model.zzz.weight'"),
    "wrong shape": (lambda root: _edit_manifest(root, 2, _reshape),
                    r"version 2, tensor 'model.a.weight', field 'shape': shape \[16, 8\], the model "
                    r"holds \[8, 16\]"),
    "corrupt payload": (lambda root: _flip_payload(root, 2),
                        r"delta-00000002/delta-rank00000-file000000.safetensors.*version 2, tensor "
                        r"'model\.\w\.(weight|bias)': (payload does not decode|checksum mismatch)"),
    "version gap": (lambda root: shutil.rmtree(root / "delta-00000002"),
                    r"version gap: delta-00000002/manifest.json is missing"),
    "base_version": (lambda root: _edit_manifest(root, 2, lambda d: d.update(base_version=0)),
                     r"delta-00000002/manifest.json.*base_version 0; SkyRL deltas chain"),
    "unknown field": (lambda root: _edit_manifest(root, 2, lambda d: d.update(signature="x")),
                      r"field 'signature': unknown field"),
    "totals": (lambda root: _edit_manifest(root, 2, lambda d: d.update(total_compressed_num_bytes=1)),
               r"total_compressed_num_bytes 1 is not the sum"),
    "path traversal": (lambda root: _edit_manifest(root, 2, lambda d: d.update(payload_files=["../x"])),
                       r"payload_files \['../x'\] is not a list of distinct"),
    "byte count": (lambda root: _edit_manifest(
        root, 2, lambda d: d["tensors"][0].update(uncompressed_num_bytes=7)),
        r"field 'uncompressed_num_bytes': 7 does not match bfloat16\[8, 16\] \(256\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_skyrl_versions_are_refused_with_nothing_applied(skyrl, tmp_path, case):
    base, w = _base(tmp_path)
    states = _steps(w)
    _skyrl_publish(skyrl, base, tmp_path / "sync", tmp_path / "staging", states)
    r = SkyrlDeltaReceiver(tmp_path / "sync", base)
    r.commit(r.prepare(1))
    held = {k: v.clone() for k, v in r.state.items()}
    spoil, match = BAD[case]
    spoil(tmp_path / "sync")
    with pytest.raises(InputError, match=match):
        r.commit(r.prepare(3))
    assert r.version == 1
    _same(r.state, held)


def test_fetch_weights_route_only_with_our_worker_extension():
    """The route is attached where our worker method exists; on another server (SkyRL's own, with
    its own /fetch_weights) it is not."""
    from argparse import Namespace

    from fastapi import FastAPI

    from skyrl_numerics.engine.server import WORKER_EXTENSION
    from skyrl_numerics.engine.skyrl_route import SkyrlEndpoints

    for ext, attached in ((WORKER_EXTENSION, True), ("skyrl.backends.skyrl_train.inference_servers."
                                                     "new_inference_worker_wrap.NewInferenceWorkerWrap", False)):
        app = FastAPI()
        app.state.args = Namespace(worker_extension_cls=ext)
        SkyrlEndpoints().attach_router(app)
        assert ("/fetch_weights" in {r.path for r in app.routes}) == attached


# ---- server level -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def delta_server(qwen_moe_dir, tmp_path_factory):
    """The module's one server: ``VLLMServer`` (dev mode, ``skyrl_delta``, our routes) on
    127.0.0.1 with ``--api-key``, no sync key (see the module docstring)."""
    from skyrl_numerics.engine.server import VLLMServer

    log = tmp_path_factory.mktemp("serve") / "vllm.log"
    srv = VLLMServer(qwen_moe_dir, api_key=API_KEY, sync_key="", log_path=log,
                     env={"SKYRL_NUMERICS_SYNC_KEY": ""})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def checkpoint(qwen_moe_dir):
    return load_file(os.path.join(qwen_moe_dir, "model.safetensors"))


def fingerprint(srv) -> list:
    """Token ids, sampled logprobs and prompt logprobs of fixed seeded requests (floats exact)."""
    out = []
    for seed, prompt in ((1, [5, 6, 7, 8, 9]), (2, list(range(30, 70)))):
        r = requests.post(srv.url + "/v1/completions", headers=srv.headers(), timeout=120, json={
            "model": srv.model_dir, "prompt": prompt, "max_tokens": 6, "seed": seed,
            "temperature": 1.0, "logprobs": 1, "prompt_logprobs": 1, "return_token_ids": True})
        ch = r.json()["choices"][0]
        prompt_lp = [None if d is None else {k: v["logprob"] for k, v in d.items()}
                     for d in ch["prompt_logprobs"]]
        out.append((ch["token_ids"], ch["logprobs"]["token_logprobs"], prompt_lp))
    return out


def weight_version(srv) -> str:
    return requests.get(srv.url + "/weight_info", headers=srv.headers(), timeout=30).json()["weight_version"]


def served_version(srv) -> int:
    """The SkyRL version the server serves (vLLM says "default" before any update)."""
    v = weight_version(srv)
    return 0 if v in (None, "default") else int(v)


def skyrl_client(skyrl, srv, key=API_KEY):
    """SkyRL's own control-plane client: keyed through ``integrations.skyrl.KeyedWeightSyncClient``
    (SkyRL's class; it sends no key itself), or SkyRL's plain one for ``key=None``."""
    if key:
        skyrl("backends.skyrl_train.weight_sync.control_plane")     # skyrl importable from here on
        from skyrl_numerics.integrations.skyrl import KeyedWeightSyncClient

        return KeyedWeightSyncClient([srv.url], api_key=key)
    return skyrl("backends.skyrl_train.weight_sync.control_plane").SkyrlWeightSyncClient([srv.url])


def skyrl_init(srv, tmp):
    return {"base_model_path": srv.model_dir, "local_checkpoint_dir": str(tmp / "local"),
            "cloud_download_workers": 2, "checkpoint_load_format": "vllm_multi_thread_safetensors",
            "multi_thread_safetensors_max_workers": 2}


def perturbed(state, parts, factor):
    return {k: ((v.float() * factor).to(v.dtype) if any(p in k for p in parts) else v)
            for k, v in state.items()}


@pytest.mark.vllm
@pytest.mark.slow
def test_skyrls_trainer_engine_syncs_our_server(skyrl, delta_server, checkpoint, tmp_path):
    """SkyRL's unchanged DeltaTrainerWeightTransferEngine + SkyrlWeightSyncClient: version 1
    (two blocks changed) is served — the same outputs as our own backend serving those weights
    as a full snapshot — and /weight_info says 1; version 2 (the checkpoint back) restores every
    output bit for bit and says 2."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from skyrl_numerics.engine.transfer_backend import SkyrlDeltaTrainerInitInfo, http_client
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    class Source(WeightSource):      # the trainer's weights, as a SkyRL worker hands them over
        def __init__(self):
            self.state = {}

        def metadata(self):
            return [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in self.state.items()]

        def __iter__(self):
            return iter(list(self.state.items()))

    trainer = skyrl("backends.skyrl_train.weight_sync.delta.trainer")
    srv, src = delta_server, Source()
    base = fingerprint(srv)
    start = served_version(srv)
    info = trainer.DeltaTrainerInitInfo(**skyrl_init(srv, tmp_path), sync_dir=str(tmp_path / "sync"),
                                        publish_staging_dir=str(tmp_path / "staging"),
                                        publish_num_workers=1, rank=0)
    if start:   # an earlier test of this module left the stream at `start`: continue from there
        pytest.skip("needs the server's SkyRL stream at version 0 (run this test first)")
    client = skyrl_client(skyrl, srv)
    eng = trainer.DeltaTrainerWeightTransferEngine.trainer_init(info, client=client, source=src)
    s1 = perturbed(checkpoint, ("layers.0.self_attn.q_proj", "layers.1.mlp.experts.2."), 1.5)
    src.state = s1
    eng.send_weights()
    m1 = json.loads((tmp_path / "sync" / "delta-00000001" / "manifest.json").read_text())
    assert {t["name"] for t in m1["tensors"]} == {
        k for k in checkpoint if "layers.0.self_attn.q_proj" in k or "layers.1.mlp.experts.2." in k}
    served_1 = fingerprint(srv)
    assert served_1 != base and weight_version(srv) == "1"
    # our own backend, full snapshot of the same weights: the same outputs
    ours = WeightTransferTrainerFactory.trainer_init(
        SkyrlDeltaTrainerInitInfo(store=str(tmp_path / "ours"), rank=0),
        client=http_client(srv.url, API_KEY))
    ours.send_weights(s1, full=True)
    assert fingerprint(srv) == served_1
    client.init_weight_transfer_engine(skyrl_init(srv, tmp_path))   # back to SkyRL's stream
    src.state = checkpoint
    eng.send_weights()
    assert fingerprint(srv) == base and weight_version(srv) == "2"


@pytest.mark.vllm
@pytest.mark.slow
def test_fetch_weights_needs_the_key(skyrl, delta_server, tmp_path):
    srv = delta_server
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(srv.url + "/fetch_weights", json={"target_version": 1}, headers=headers,
                          timeout=30)
        assert r.status_code == 401, r.text
    with pytest.raises(RuntimeError, match=r"/fetch_weights .*\[401\]"):
        skyrl_client(skyrl, srv, key=None).fetch_weights(1, sync_dir=str(tmp_path))
    r = requests.post(srv.url + "/fetch_weights", json={"target_version": "1"},
                      headers=srv.headers(), timeout=30)
    assert r.status_code == 400 and "target_version" in r.text


@pytest.mark.vllm
@pytest.mark.slow
def test_bad_skyrl_versions_are_refused_by_the_server(skyrl, delta_server, checkpoint, tmp_path):
    """Versions written by our SkyRL-layout publisher (SkyRL's bytes), then spoiled: SkyRL's
    client's fetch is refused naming the file / tensor / version, the served outputs and version
    stay; an unspoiled version then applies, and the checkpoint back restores the outputs."""
    srv = delta_server
    client = skyrl_client(skyrl, srv)
    client.init_weight_transfer_engine(skyrl_init(srv, tmp_path))
    held = served_version(srv)   # the server serves the checkpoint's weights at `held`
    before = fingerprint(srv)
    s1 = perturbed(checkpoint, ("layers.1.self_attn.o_proj",), 2.0)
    cases = {
        "unknown tensor": (lambda d: _rename_named(d, "model.layers.0.mlp.nope.weight"),
                           "unknown tensor 'model.layers.0.mlp.nope.weight'"),
        "wrong shape": (lambda d: d["tensors"][0].update(shape=[256, 128]),
                        "field 'shape': shape [256, 128], the model holds [128, 256]"),
        "corrupt payload": (None, "tensor 'model.layers.1.self_attn.o_proj.weight': "),
    }
    for case, (edit, match) in cases.items():
        root = tmp_path / case.replace(" ", "_")
        pub = SkyrlLayoutPublisher(root, checkpoint, version=held)   # the server's stream: next is held + 1
        pub.publish(s1)
        v = held + 1
        if edit is None:
            _flip_payload(root, v)
        else:
            _edit_manifest(root, v, edit)
        with pytest.raises(RuntimeError, match=r"\[400\]") as e:
            client.fetch_weights(v, sync_dir=str(root))
        assert match in str(e.value) and f"delta-{v:08d}" in str(e.value), str(e.value)[:600]
    # a gap: v + 1 published, v missing
    root = tmp_path / "gap"
    pub = SkyrlLayoutPublisher(root, checkpoint, version=held)
    pub.publish(s1)
    pub.publish(checkpoint)
    shutil.rmtree(root / f"delta-{held + 1:08d}")
    with pytest.raises(RuntimeError, match=rf"version gap: delta-{held + 1:08d}/manifest.json"):
        client.fetch_weights(held + 2, sync_dir=str(root))
    # an update without a fetch reads the store itself: refused the same way, nothing loaded
    with pytest.raises(RuntimeError, match="version gap"):
        client.start_weight_update()
        client.update_weights({"target_version": held + 2, "version": held + 2,
                               "sync_dir": str(root), "uri": None})
    assert fingerprint(srv) == before and served_version(srv) == held
    # unspoiled versions from our publisher, through SkyRL's client sequence
    root = tmp_path / "good"
    pub = SkyrlLayoutPublisher(root, checkpoint, version=held)
    for state, expect_same in ((s1, False), (checkpoint, True)):
        m = pub.publish(state)
        client.fetch_weights(m.version, sync_dir=str(root))
        client.pause_generation()
        try:
            client.start_weight_update()
            client.update_weights({"target_version": m.version, "version": m.version,
                                   "sync_dir": str(root), "uri": f"{root}/delta-{m.version:08d}"})
            client.finish_weight_update()
        finally:
            client.resume_generation()
        assert (fingerprint(srv) == before) == expect_same
        assert weight_version(srv) == str(m.version)


def _rename_named(d, new):
    d["tensors"][0]["name"] = new
