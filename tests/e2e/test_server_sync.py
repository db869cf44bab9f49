"""Weight updates of a real ``vllm serve`` through vLLM's own HTTP client and the ``skyrl_delta``
backend, and everything a refused update must leave alone.

One server per module (a subprocess on 127.0.0.1 started by ``VLLMServer``: dev mode, the
backend, ``--api-key``, a sync key in its environment). "Served weights unchanged" is checked by
what the server computes: token ids, sampled logprobs and prompt logprobs of fixed seeded
requests, bit for bit (vLLM's own ``/weight_checker`` digests the parameters, but on CPU the
linear layers compute from a prepacked copy, so a digest of ``weight`` does not see an update).
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
import requests

from skyrl_numerics.errors import InputError

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

API_KEY = "test-api-key"
SYNC_KEY = "test-sync-key"


@pytest.fixture(scope="module")
def model_dir():
    from skyrl_numerics.models import build_tiny_model

    return str(build_tiny_model("qwen3_moe"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from skyrl_numerics.engine.server import VLLMServer

    log = tmp_path_factory.mktemp("serve") / "vllm.log"
    srv = VLLMServer(model_dir, api_key=API_KEY, sync_key=SYNC_KEY, log_path=log,
                     extra_args=["--enable-prompt-tokens-details"])
    srv.start()
    srv.base = fingerprint(srv, model_dir)     # what the checkpoint computes, before any update
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def checkpoint(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def fingerprint(srv, model_dir) -> list:
    """Token ids, sampled logprobs and prompt logprobs of fixed seeded requests (floats exact)."""
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY)
    out = []
    for seed, prompt in ((1, [5, 6, 7, 8, 9]), (2, list(range(30, 70)))):
        r = client.completions.create(model=model_dir, prompt=[prompt], max_tokens=6, seed=seed,
                                      temperature=1.0, logprobs=1,
                                      extra_body={"prompt_logprobs": 1, "return_token_ids": True})
        ch = r.choices[0]
        prompt_lp = [None if d is None else {k: v["logprob"] for k, v in d.items()}
                     for d in ch.model_extra["prompt_logprobs"]]
        out.append((ch.model_extra["token_ids"], ch.logprobs.token_logprobs, prompt_lp))
    return out


def trainer_engine(srv, store, key=SYNC_KEY, **kw):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from skyrl_numerics.engine.transfer_backend import SkyrlDeltaTrainerInitInfo, http_client

    info = SkyrlDeltaTrainerInitInfo(store=str(store), rank=0, key=key, **kw)
    return WeightTransferTrainerFactory.trainer_init(info, client=http_client(srv.url, API_KEY))


def _capture(fn, *args):
    try:
        fn(*args)
    except Exception as e:   # the connection dies with the server: any transport error
        return e
    return None


def scaled(state, name_part, factor):
    out = dict(state)
    for k in out:
        if name_part in k:
            out[k] = (out[k].float() * factor).to(out[k].dtype)
    return out


# ---- the guard on the control routes --------------------------------------------------------
def test_control_routes_need_the_api_key(server):
    """Every route of the live app except the probes refuses a request without the key or with
    a wrong one (vLLM's own middleware guards only /v1, /v2, /inference, /cohere)."""
    from skyrl_numerics.engine.vllm_patches import OPEN_ROUTES

    spec = requests.get(server.url + "/openapi.json", headers=server.headers(), timeout=10).json()
    assert requests.get(server.url + "/openapi.json", timeout=10).status_code == 401
    checked = 0
    for path, ops in spec["paths"].items():
        if path in OPEN_ROUTES:
            continue
        url = server.url + path.replace("{response_id}", "x")
        for method in ops:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = requests.request(method.upper(), url, headers=headers, timeout=10)
                assert r.status_code == 401, (method, path, r.status_code, r.text[:200])
            checked += 1
    assert checked >= 30
    for path in ("/start_weight_update", "/update_weights", "/pause", "/collective_rpc",
                 "/skyrl_contract"):
        assert path in spec["paths"]
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_the_contract_route_needs_the_key_and_names_the_stock_forward(server, model_dir):
    """``GET /skyrl_contract`` on a stock server with a key: refused without it (the client's
    InputError names the key), and with it the stock worker's contract, which a bitwise trainer
    refuses naming ``forward`` first."""
    from skyrl_numerics.engine.remote import RemoteGenerator
    from skyrl_numerics.errors import ContractMismatch, InputError
    from skyrl_numerics.invariant import contract as C, from_checkpoint

    assert requests.get(server.url + "/skyrl_contract", timeout=10).status_code == 401
    remote = RemoteGenerator(server.url, api_key=API_KEY)
    got = remote.contract()
    assert got.forward == "vllm" and got.family == "Qwen3MoeForCausalLM" and got.numerics == "none"
    remote.api_key, remote._headers = None, {}
    with pytest.raises(InputError, match="field 'api_key'"):
        remote.contract()
    with pytest.raises(ContractMismatch) as e:
        C.check(C.of_model(from_checkpoint(model_dir)), got)
    assert e.value.fields[0] == "forward"


# ---- updates through vLLM's own client -------------------------------------------------------
def test_updates_apply_exact_bytes_and_record_the_version(server, model_dir, checkpoint, tmp_path):
    """Full snapshot of the checkpoint: outputs bit-identical; a delta changes them; the
    checkpoint pushed back as a delta restores them bit for bit; weight_version follows."""
    base = fingerprint(server, model_dir)
    eng = trainer_engine(server, tmp_path / "store")
    m0 = eng.send_weights(checkpoint)
    assert m0.is_full and fingerprint(server, model_dir) == base
    changed = scaled(checkpoint, "layers.0.self_attn.q_proj", 3.0)
    changed = scaled(changed, "layers.1.mlp.experts.2.", 2.0)
    m1 = eng.send_weights(changed)
    assert not m1.is_full and set(m1.changed) == {
        k for k in checkpoint if "layers.0.self_attn.q_proj" in k or "layers.1.mlp.experts.2." in k}
    assert fingerprint(server, model_dir) != base
    info = requests.get(server.url + "/weight_info", headers=server.headers(), timeout=10).json()
    assert info["weight_version"] == str(m1.version)
    eng.send_weights(checkpoint)
    assert fingerprint(server, model_dir) == base


def _refused(eng, server, model_dir, before, match, *, version=None, update_info=None):
    client = eng.client
    client.start_weight_update()
    with pytest.raises(requests.HTTPError) as ei:
        client.update_weights(update_info if update_info is not None else {"version": version})
    body = ei.value.response.text
    assert ei.value.response.status_code >= 400
    assert match in body, body[:500]
    with pytest.raises(requests.HTTPError):   # the failed update ended the session
        client.finish_weight_update()
    assert fingerprint(server, model_dir) == before
    return body


def test_refused_updates_leave_the_served_weights_unchanged(server, model_dir, checkpoint,
                                                           tmp_path):
    from skyrl_numerics.sync.manifest import manifest_path
    from skyrl_numerics.sync.weight_sync import DeltaPublisher

    store = tmp_path / "store"
    eng = trainer_engine(server, store)
    eng.send_weights(checkpoint)
    state = scaled(checkpoint, "layers.1.self_attn.o_proj", 1.5)
    eng.send_weights(state)
    before = fingerprint(server, model_dir)
    pub = eng.publisher

    # 1. a payload byte flipped
    m = pub.publish(scaled(state, "layers.0.mlp.gate", 2.0))
    payload = next(e.payload for e in m.tensors if e.payload is not None)
    path = os.path.join(store, payload)
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2] ^= 0x10
    open(path, "wb").write(bytes(blob))
    _refused(eng, server, model_dir, before, "is corrupt", version=m.version)

    # 2. a manifest field edited (its digest no longer matches)
    mpath = os.path.join(store, manifest_path(m.version))
    doc = json.loads(open(mpath).read())
    doc["tensors"][0]["shape"] = [1] + list(doc["tensors"][0]["shape"])
    open(mpath, "w").write(json.dumps(doc))
    _refused(eng, server, model_dir, before, "manifest digest mismatch", version=m.version)

    # 3. signed with another key, 4. not signed at all (fresh stores with a snapshot each)
    for key, match in (("another-key", "signature does not verify"), (None, "not signed")):
        other = tmp_path / f"store-{key}"
        DeltaPublisher(other, key=key).publish(checkpoint, full=True)
        eng.client.init_weight_transfer_engine({"store": str(other)})
        _refused(eng, server, model_dir, before, match, version=0)
        eng.client.init_weight_transfer_engine({"store": str(store)})   # back: version kept

    # 5. an older version replayed, 6. unknown update keys, 7. a version never published
    _refused(eng, server, model_dir, before, "out of order", version=0)
    _refused(eng, server, model_dir, before, "unknown key 'tensors'",
             update_info={"version": 9, "tensors": []})
    _refused(eng, server, model_dir, before, "not published", version=99)

    # 8. a snapshot whose tensor has another shape than the served checkpoint
    bad = dict(checkpoint)
    name = "model.layers.0.input_layernorm.weight"
    bad[name] = bad[name][:-1].clone()
    wrong = tmp_path / "store-shape"
    DeltaPublisher(wrong, key=SYNC_KEY).publish(bad, full=True)
    eng.client.init_weight_transfer_engine({"store": str(wrong)})
    _refused(eng, server, model_dir, before, "field 'shape'", version=0)

    # init_info itself is checked
    for init, match in (({"store": str(store), "weights_format": "nvfp5"}, "weights_format"),
                        ({"store": str(store), "endpoint": "x"}, "unknown key 'endpoint'"),
                        ({"store": ""}, "non-empty")):
        with pytest.raises(requests.HTTPError) as ei:
            eng.client.init_weight_transfer_engine(init)
        assert match in ei.value.response.text

    # and the server still takes a good update afterwards (the trainer engine's error path)
    eng.client.init_weight_transfer_engine({"store": str(store)})
    eng2 = trainer_engine(server, tmp_path / "store-fresh")
    eng2.send_weights(checkpoint)
    assert fingerprint(server, model_dir) != before    # checkpoint, not `state`
    eng2._call("start_weight_update")
    with pytest.raises(InputError, match="server refused update_weights: .*out of order"):
        eng2._call("update_weights", {"version": 0})


def test_prefix_cache_is_reset_after_an_update(server, model_dir, checkpoint, tmp_path):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 500, 600)]

    def cached():
        r = client.completions.create(model=model_dir, prompt=[prompt], max_tokens=2, seed=0)
        return r.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0          # the prefix cache is on and this prompt fills whole blocks
    eng = trainer_engine(server, tmp_path / "store")
    eng.send_weights(checkpoint)
    assert cached() == 0         # blocks computed with the old weights are gone
    assert cached() > 0


def test_a_client_that_disconnects_mid_request_leaves_the_server_serving(server, model_dir):
    before = fingerprint(server, model_dir)
    body = {"model": model_dir, "prompt": [1, 2, 3], "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with requests.post(server.url + "/v1/completions", json=body, headers=server.headers(),
                       stream=True, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    time.sleep(0.5)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert fingerprint(server, model_dir) == before


# ---- a server that cannot take an update ------------------------------------------------------
def test_an_unknown_backend_is_refused_before_the_server_starts(model_dir, tmp_path):
    from skyrl_numerics.engine.server import VLLMServer

    with pytest.raises(InputError, match="backend 'no_such_backend' is not one vLLM can create "
                                         r"\(known: .*skyrl_delta"):
        VLLMServer(model_dir, log_path=tmp_path / "bad.log",
                   extra_args=["--weight-transfer-config", '{"backend": "no_such_backend"}'])
    with pytest.raises(InputError, match="not a JSON object"):
        VLLMServer(model_dir, extra_args=["--weight-transfer-config=nope"])


# ---- a kill mid-update, the restart, and the restart's caller killed -------------------------
def test_a_server_killed_mid_update_never_serves_a_mix(server, model_dir, checkpoint, tmp_path):
    """SIGKILL while update_weights is in flight (the restart is the ``restarted`` fixture below).
    In flight for sure: one payload of the new version is a FIFO nobody writes, so the server's
    read of it blocks until the kill. Kills the module's server: later tests start their own."""
    srv = server
    eng = trainer_engine(srv, tmp_path / "store")
    eng.send_weights(checkpoint)            # the checkpoint again: the tests before changed it
    assert fingerprint(srv, model_dir) == srv.base
    m = eng.publisher.publish(scaled(checkpoint, "mlp.experts", 1.7))
    payload = os.path.join(tmp_path / "store", next(e.payload for e in m.tensors if e.payload))
    os.remove(payload)
    os.mkfifo(payload)
    outcome = {}

    def update():
        eng.client.start_weight_update()
        outcome["error"] = _capture(type(eng.client).update_weights, eng.client,
                                    {"version": m.version})

    t = threading.Thread(target=update)
    t.start()
    time.sleep(3.0)
    assert t.is_alive() and "error" not in outcome      # the server is inside the update
    srv.kill()
    t.join(60)
    assert not srv.alive() and outcome["error"] is not None


def _group(pgid: int) -> list[str]:
    """The live (not zombie) processes of process group ``pgid``."""
    import subprocess

    out = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines()
            if ln.split()[0] == str(pgid) and not ln.split()[1].startswith("Z")]


@pytest.fixture(scope="module")
def restarted(server, model_dir, tmp_path_factory):
    """The server started again after the kill, from the same checkpoint, by a caller process of
    its own (so the last test can SIGKILL that caller), with dev mode off (so it also shows a
    server that cannot take an update). One engine start for three checks."""
    import subprocess
    import sys
    from types import SimpleNamespace

    server.kill()                      # (already dead when the kill test ran first)
    tmp = tmp_path_factory.mktemp("restart")
    script = tmp / "caller.py"
    script.write_text(
        "import time\n"
        "from skyrl_numerics.engine.server import VLLMServer\n"
        f"srv = VLLMServer({model_dir!r}, api_key={API_KEY!r}, sync_key={SYNC_KEY!r}, "
        f"log_path={str(tmp / 'v.log')!r}, env={{'VLLM_SERVER_DEV_MODE': '0'}}).start()\n"
        "print(srv.proc.pid, srv.url, flush=True)\n"
        "time.sleep(900)\n")
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = caller.stdout.readline().split()
    if len(line) != 2:
        caller.kill()
        pytest.fail(f"the caller did not start a server; log:\n{(tmp / 'v.log').read_text()[-3000:]}")
    yield SimpleNamespace(url=line[1], group=int(line[0]), caller=caller)
    if caller.poll() is None:
        caller.kill()
        caller.wait()


def test_the_restarted_server_serves_the_checkpoint_it_was_started_from(server, restarted, model_dir):
    """Nothing of the killed update persisted anywhere the server reads: bit for bit."""
    assert fingerprint(restarted, model_dir) == server.base


def test_a_server_without_dev_mode_refuses_the_transfer_engine(restarted, tmp_path):
    with pytest.raises(InputError, match="server refused init_weight_transfer_engine: .*Not Found"):
        trainer_engine(restarted, tmp_path / "store")


def test_a_caller_killed_by_sigkill_leaves_no_server_behind(restarted):
    """The process that started the server dies without cleanup: the reaper takes the server's
    whole process group (API process, engine core, workers) with it."""
    assert len(_group(restarted.group)) >= 3          # API process, engine core, worker
    restarted.caller.kill()
    restarted.caller.wait()
    deadline = time.monotonic() + 20
    while _group(restarted.group) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _group(restarted.group) == []


def test_a_serving_format_update_reaches_an_int4_server(model_dir, tmp_path):
    """ct_int4 payloads (codes + scales, as deltas) through skyrl_delta into a server running
    vLLM's INT4 kernel: afterwards it computes exactly what a fresh engine on the quantized
    checkpoint of the new weights computes (one prompt per request on both sides, so batch
    composition is the same). One engine: the server starts on the new weights' INT4
    checkpoint (its outputs are the fresh engine's), is sent the old weights (full: its outputs
    change) and then the new ones as a delta (its outputs are the fresh engine's again)."""
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    from skyrl_numerics.host import missing_kernel_reason
    from skyrl_numerics.engine.remote import RemoteGenerator
    from skyrl_numerics.engine.server import VLLMServer
    from skyrl_numerics.engine.serving_checkpoint import write_int4_checkpoint

    why = missing_kernel_reason("w4a16")
    if why:
        pytest.skip(str(why))
    src = Path(model_dir)
    s0 = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    s1 = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) if v.dim() >= 2
          else v for k, v in s0.items()}
    new = tmp_path / "new"
    new.mkdir()
    save_file({k: v.contiguous() for k, v in s1.items()}, str(new / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy2(f, new / f.name)
    int4_new = write_int4_checkpoint(new, out_dir=tmp_path / "int4-new")
    prompts = [[3, 4, 5, 6], [40, 41, 42, 43, 44, 45]]

    def one_by_one(generate):
        return [generate([p], max_tokens=8, seed=i) for i, p in enumerate(prompts)]

    def same(xs, ys):
        return all(np.array_equal(a.response_tokens, b.response_tokens)
                   and np.array_equal(a.rollout_logprobs.view(np.uint32), b.rollout_logprobs.view(np.uint32))
                   for a, b in zip(xs, ys))

    with VLLMServer(int4_new, api_key=API_KEY, sync_key=SYNC_KEY, log_path=tmp_path / "s.log") as srv:
        remote = RemoteGenerator(srv.url, api_key=API_KEY)
        want = one_by_one(remote.generate)            # a fresh engine on the new INT4 checkpoint
        eng = trainer_engine(srv, tmp_path / "store", weights_format="ct_int4",
                             quantize=["*.self_attn.*_proj.weight"])
        m0 = eng.send_weights(s0)
        assert m0.is_full and m0.weights_format == "ct_int4"
        old = one_by_one(remote.generate)
        m1 = eng.send_weights(s1)
        assert not m1.is_full and m1.weights_format == "ct_int4"
        got = one_by_one(remote.generate)
    assert not same(old, want), "sending the old weights changed nothing the server computes"
    assert same(got, want)
