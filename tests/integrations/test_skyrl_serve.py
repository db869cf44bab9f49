"""SkyRL 0.4's own, unchanged ``RemoteInferenceClient`` against our server (one keyed, batch-invariant
``VLLMServer`` on the tiny Qwen3-MoE for the module: ``skyrl_server`` in conftest.py).

- plain generation goes through vLLM's ``/inference/v1/generate`` (served without extra flags) and equals
  our own ``RemoteGenerator`` on the same requests bit for bit; the invariant trainer reproduces it;
- R3 + supports go through ``/skyrl/v1/generate`` (``engine/skyrl_route.py``); what SkyRL decodes, and
  what its own ``RoutedExpertTrace`` assembles over two turns, equals our capture of the same requests bit
  for bit, supports in rank order;
- pause / resume through SkyRL's client; without the key every call is 401, with
  ``integrations.skyrl.keyed_client`` it works; malformed ``/skyrl/v1/generate`` bodies get a 400 naming
  the field.

SkyRL's client detokenizes every response: it is given a real (tiny, word-level) HF fast tokenizer over
the model's vocabulary, since the test model has none (the server runs ``--skip-tokenizer-init``).
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
import requests

from conftest import SKYRL_API_KEY
from skyrl_numerics.errors import InputError
from skyrl_numerics.replay import PackedRoutes, PackedSupport
from skyrl_numerics.replay.skyrl_wire import support_from_skyrl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RIC = "backends.skyrl_train.inference_servers.remote_inference_client"
VOCAB, E, MOE_LAYERS, TOP_K = 512, 8, [0, 1], 16


@pytest.fixture(scope="module")
def sk(skyrl):
    import importlib

    return SimpleNamespace(ric=skyrl(RIC), trace=skyrl("backends.skyrl_train.utils.routed_experts"),
                           support=skyrl("backends.skyrl_train.utils.sample_support"),
                           integ=importlib.import_module("skyrl_numerics.integrations.skyrl"))


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def ours(skyrl_server):
    from skyrl_numerics.engine.remote import RemoteGenerator

    return RemoteGenerator(skyrl_server.url, api_key=SKYRL_API_KEY)


def client(sk, srv, tokenizer, key: str | None = SKYRL_API_KEY, **kw):
    base = sk.ric.RemoteInferenceClient(proxy_url=srv.url, server_urls=[srv.url], data_parallel_size=1,
                                        model_name=srv.model_dir, tokenizer=tokenizer, **kw)
    return base if key is None else sk.integ.keyed_client(base, key)


def run(c, make):
    """``make()``'s coroutine on a fresh event loop, the client's session closed afterwards."""
    async def main():
        try:
            return await make()
        finally:
            await c.teardown()
    return asyncio.run(main())


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def test_generate_through_inference_v1_generate_equals_ours_bitwise(sk, skyrl_server, tokenizer, ours,
                                                                   qwen_moe_dir):
    from skyrl_numerics.rollout import Rollout
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.trainer.invariant_trainer import InvariantTrainer

    prompts = make_prompts(3, 9, VOCAB, 21)
    sp = {"temperature": 1.0, "max_tokens": 8, "seed": 5, "logprobs": 0, "ignore_eos": True}
    c = client(sk, skyrl_server, tokenizer)
    out = run(c, lambda: c.generate({"prompt_token_ids": prompts, "sampling_params": sp}))
    ref = ours.generate(prompts, temperature=1.0, max_tokens=8, seeds=[5] * 3)
    assert out["response_ids"] == [ref.response(i).tolist() for i in range(3)]
    assert np.array_equal(bits(np.concatenate(out["response_logprobs"])), bits(ref.rollout_logprobs))
    assert out["responses"][0].split() == [f"t{t}" for t in out["response_ids"][0]]
    ro = Rollout.from_lists(prompts, out["response_ids"], out["response_logprobs"])
    assert np.array_equal(bits(InvariantTrainer(str(qwen_moe_dir)).logprobs(ro)), bits(ro.rollout_logprobs))


def test_r3_and_supports_through_skyrl_v1_generate_equal_our_capture(sk, skyrl_server, tokenizer, ours):
    from skyrl_numerics.rollout.prompts import make_prompts

    prompts = make_prompts(3, 7, VOCAB, 5)
    sp = {"temperature": 1.0, "top_k": TOP_K, "max_tokens": 6, "seed": 3, "logprobs": 0, "ignore_eos": True}
    c = client(sk, skyrl_server, tokenizer, enable_return_routed_experts=True,
               enable_return_sample_support_set=True)
    out = run(c, lambda: c.generate({"prompt_token_ids": prompts, "sampling_params": sp,
                                     "return_sample_support": True}))
    ref = ours.generate(prompts, temperature=1.0, top_k=TOP_K, max_tokens=6, seeds=[3] * 3,
                        capture_support=True, capture_routes=True, topk_logprobs=TOP_K)
    resp = out["response_ids"]
    assert resp == [ref.response(i).tolist() for i in range(3)]
    assert np.array_equal(bits(np.concatenate(out["response_logprobs"])), bits(ref.rollout_logprobs))
    routes = out["rollout_expert_indices"]
    assert [r.dtype for r in routes] == [np.uint8] * 3 and routes[0].shape == (7 + 6 - 1, 2, 2)
    assert PackedRoutes.from_vllm(routes, E, prompt_lens=[7] * 3, response_lens=[6] * 3,
                                  moe_layers=MOE_LAYERS) == ref.routes
    sup = out["rollout_sample_support"]
    assert all(s.dtype == np.int32 and s.shape == (6, 2 * TOP_K) for s in sup)   # K fixed per top_k
    got = [support_from_skyrl(s, VOCAB) for s in sup]
    assert PackedSupport.from_sets([g.row(t) for g in got for t in range(g.num_tokens)], VOCAB) == ref.support
    # rank order: highest processed logprob first (vLLM's ranks, as SkyRL's own server sends them);
    # the values from our top-K (ties: either order)
    for t, row in enumerate(np.concatenate(sup)):
        n = int((row >= 0).sum())
        if n <= TOP_K:
            value = dict(zip(ref.topk.ids[t].tolist(), ref.topk.values[t].tolist()))
            lp = [value[i] for i in row[:n].tolist()]
            assert lp == sorted(lp, reverse=True), t
    # a second turn with SkyRL's routed_experts_prompt_starts; SkyRL's RoutedExpertTrace joins the
    # deltas, which equal our capture of the whole second request
    traces = [sk.trace.RoutedExpertTrace() for _ in prompts]
    for tr, p, r, a in zip(traces, prompts, resp, routes):
        tr.record_generation(prompt_token_count=len(p), generated_token_count=len(r), routed_experts=a)
    p2 = [p + r + [11, 12, 13] for p, r in zip(prompts, resp)]
    sp2 = {**sp, "max_tokens": 5, "seed": 4}
    out2 = run(c, lambda: c.generate({"prompt_token_ids": p2, "sampling_params": sp2, "return_sample_support": True,
                                      "routed_experts_prompt_starts": [t.prompt_start for t in traces]}))
    full, supports = [], []
    for tr, p, r, a, s1, s2 in zip(traces, p2, out2["response_ids"], out2["rollout_expert_indices"], sup,
                                   out2["rollout_sample_support"]):
        tr.record_generation(prompt_token_count=len(p), generated_token_count=len(r), routed_experts=a)
        full.append(tr.finalize(token_count=len(p) + len(r), loss_mask=[0] * len(p) + [1] * len(r)))
        st = sk.support.SampleSupportTrace()      # SkyRL's multi-turn support trace: one width per trajectory
        st.append(s1, expected_rows=6)
        st.append_padding(3)
        st.append(s2, expected_rows=5)
        supports.append(st.finalize(token_count=14, extra_rows=0)[9:])
    ref2 = ours.generate(p2, temperature=1.0, top_k=TOP_K, max_tokens=5, seeds=[4] * 3, capture_routes=True,
                         capture_support=True)
    assert out2["response_ids"] == [ref2.response(i).tolist() for i in range(3)]
    assert PackedRoutes.from_vllm(full, E, prompt_lens=[len(p) for p in p2], response_lens=[5] * 3,
                                  moe_layers=MOE_LAYERS) == ref2.routes
    assert PackedSupport.from_sets([r[r >= 0] for s in supports for r in s], VOCAB) == ref2.support


def test_pause_and_resume_through_skyrls_client(sk, skyrl_server, tokenizer):
    c = client(sk, skyrl_server, tokenizer)
    url, h = skyrl_server.url, skyrl_server.headers()

    async def body():
        await c.pause(mode="keep")
        assert requests.get(url + "/is_paused", headers=h, timeout=10).json()["is_paused"] is True
        task = asyncio.ensure_future(c.generate({"prompt_token_ids": [[5, 6, 7]], "sampling_params": {
            "temperature": 1.0, "max_tokens": 4, "seed": 1, "ignore_eos": True}}))
        done, _ = await asyncio.wait({task}, timeout=2.0)
        assert not done                      # held while paused
        await c.resume()
        out = await asyncio.wait_for(task, 60)
        assert requests.get(url + "/is_paused", headers=h, timeout=10).json()["is_paused"] is False
        return out

    assert len(run(c, body)["response_ids"][0]) == 4


def test_without_the_key_every_call_is_401(sk, skyrl_server, tokenizer, monkeypatch):
    import aiohttp

    req = {"prompt_token_ids": [[5, 6, 7]], "sampling_params": {"max_tokens": 2, "top_k": 4}}
    for key, kw in ((None, {}), ("wrong", {}), (None, {"enable_return_routed_experts": True})):
        c = client(sk, skyrl_server, tokenizer, key=key, **kw)
        for call in (lambda: c.generate(req), lambda: c.pause(), lambda: c.resume()):
            with pytest.raises(aiohttp.ClientResponseError) as e:
                run(c, call)
            assert e.value.status == 401
    # every route but the probes, from the live app's schema, the two generate routes included
    from skyrl_numerics.engine.vllm_patches import OPEN_ROUTES

    spec = requests.get(skyrl_server.url + "/openapi.json", headers=skyrl_server.headers(), timeout=10).json()
    assert {"/skyrl/v1/generate", "/inference/v1/generate"} <= set(spec["paths"])
    for path, ops in spec["paths"].items():
        if path not in OPEN_ROUTES:
            for method in ops:
                r = requests.request(method.upper(), skyrl_server.url + path.replace("{response_id}", "x"),
                                     timeout=10)
                assert r.status_code == 401, (method, path, r.status_code)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(InputError, match="api_key"):
        sk.integ.keyed_client(client(sk, skyrl_server, tokenizer, key=None))


MALFORMED = [
    (b"{not json", "body"),
    (b"[1, 2]", "body"),
    ({"sampling_params": {"max_tokens": 2}}, "token_ids"),
    ({"token_ids": "abc"}, "token_ids"),
    ({"token_ids": [1, 2], "return_sample_support": "yes"}, "return_sample_support"),
    ({"token_ids": [1, 2], "return_sample_support": True, "sampling_params": {"top_k": 1}},
     "sampling_params.top_k"),
    ({"token_ids": [1, 2], "return_sample_support": True, "sampling_params": {"top_k": 64}},
     "sampling_params.top_k"),
    ({"token_ids": [1, 2], "return_sample_support": True,
      "sampling_params": {"top_k": 8, "temperature": 0.0}}, "sampling_params.temperature"),
    ({"token_ids": [1, 2], "sampling_params": [1]}, "sampling_params"),
    ({"token_ids": [1, 2], "stream": True}, "stream"),
    ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
]


@pytest.mark.parametrize("body,field", MALFORMED, ids=[f for _, f in MALFORMED])
def test_a_malformed_skyrl_body_gets_a_400_naming_the_field(skyrl_server, body, field):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(skyrl_server.url + "/skyrl/v1/generate", data=data, timeout=30,
                      headers={**skyrl_server.headers(), "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_skyrls_client_reports_the_field_of_a_refused_request(sk, skyrl_server, tokenizer):
    import aiohttp

    c = client(sk, skyrl_server, tokenizer, enable_return_sample_support_set=True)
    with pytest.raises(aiohttp.ClientResponseError, match=r"sampling_params\.temperature") as e:
        run(c, lambda: c.generate({"prompt_token_ids": [[5, 6]], "return_sample_support": True,
                                   "sampling_params": {"top_k": 8, "temperature": -1.0, "max_tokens": 2}}))
    assert e.value.status == 400
