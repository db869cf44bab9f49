"""One response assembly for both engine clients (``engine/assemble.py``): ``VLLMGenerator`` over a
stand-in ``vllm.LLM`` and ``RemoteGenerator`` over a stand-in OpenAI client, both serving the same
samples, give the same ``Rollout`` (tokens, logprobs, groups, supports, top-K, routes or route
deltas, sampling); the meta differs by the server's URL only. No engine starts."""
from __future__ import annotations

import types
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from skyrl_numerics.engine.assemble import check_generate
from skyrl_numerics.engine.generator import EngineInfo, VLLMGenerator
from skyrl_numerics.engine.remote import JSON_NEG_INF, RemoteGenerator
from skyrl_numerics.replay import encode_vllm_routes

pytest.importorskip("vllm")   # VLLMGenerator.generate builds vllm.SamplingParams

V, E, L, K = 512, 8, 2, 2
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14]]


def _h(*xs) -> int:
    return zlib.crc32(repr(xs).encode())


def _routes(seq, start: int, rows: int) -> np.ndarray:
    """Deterministic ``[rows, L, K]`` routes of positions ``start ..`` of ``seq``."""
    return np.asarray([[[(_h(tuple(seq[:p + 1])) + 3 * l + j) % E for j in range(K)]
                        for l in range(L)] for p in range(start, start + rows)], np.uint8)


def _sample(prompt, seed, j, max_tokens, n_top, top_k):
    """Tokens and per token ``[(id, logprob, rank)]`` (ranks from 1; -inf past ``top_k``)."""
    rng = np.random.default_rng(_h(tuple(prompt), seed, j))
    toks, tops = [], []
    for _ in range(max_tokens - int(rng.integers(0, 3))):
        ids = rng.choice(V, size=max(n_top, 1) + 1, replace=False)
        lps = [float(x) for x in np.sort(-np.abs(rng.normal(2, 1, ids.size)))[::-1] - 0.01]
        if top_k > 0:
            lps = [x if r < top_k else -np.inf for r, x in enumerate(lps)]
        toks.append(int(ids[rng.integers(0, min(top_k, ids.size) if top_k > 0 else ids.size)]))
        tops.append([(int(i), x, r + 1) for r, (i, x) in enumerate(zip(ids, lps))])
    return toks, tops


class FakeLLM:
    """``generate`` and the worker extension's route fetch, as ``vllm.LLM`` answers them."""

    def __init__(self):
        self.seen, self.count = {}, 0

    def generate(self, inputs, params, use_tqdm=False):
        outs = []
        for inp, sp in zip(inputs, params):
            rid, prompt, comps = str(self.count), inp["prompt_token_ids"], []
            self.count += 1
            for j in range(sp.n):
                toks, tops = _sample(prompt, sp.seed, j, sp.max_tokens, sp.logprobs,
                                     sp.top_k if sp.top_k and sp.top_k > 0 else 0)
                self.seen[rid if sp.n == 1 else f"{j}_{rid}"] = list(prompt) + toks
                lps = [{i: types.SimpleNamespace(logprob=x, rank=r) for i, x, r in t} for t in tops]
                comps.append(types.SimpleNamespace(token_ids=tuple(toks), logprobs=lps))
            outs.append(types.SimpleNamespace(request_id=rid, prompt_token_ids=list(prompt),
                                              num_cached_tokens=len(prompt) // 2, outputs=comps))
        return outs

    def collective_rpc(self, method, args=()):
        assert method == "skyrl_route_capture_fetch"
        ext, lengths, _, starts = args
        got = []
        for k, e in enumerate(ext):
            a = 0 if starts is None else starts[k]
            rows = _routes(self.seen[e], a, lengths[k] - a)
            got.append({"data": rows.tobytes(), "dtype": str(rows.dtype), "shape": rows.shape})
        return [got]


def _create(**kw):
    """``client.completions.create``: vLLM's JSON (top logprobs by ``token_id:``, -inf as
    -9999.0, no ranks; choices in any order; routes from the prompt start on)."""
    prompt, extra = kw["prompt"][0], kw["extra_body"]
    start, choices = extra.get("routed_experts_prompt_start", 0), []
    for j in range(kw["n"]):
        toks, tops = _sample(prompt, kw["seed"], j, kw["max_tokens"], kw["logprobs"],
                             extra.get("top_k", 0))
        lp = types.SimpleNamespace(
            token_logprobs=[dict((i, x) for i, x, _ in t)[tok] for tok, t in zip(toks, tops)],
            top_logprobs=[{f"token_id:{i}": JSON_NEG_INF if x == -np.inf else x
                           for i, x, _ in t} for t in tops])
        seq = list(prompt) + toks
        routes = encode_vllm_routes(_routes(seq, start, len(seq) - 1 - start))
        choices.append(types.SimpleNamespace(
            index=j, logprobs=lp, model_extra={"token_ids": toks, "routed_experts": routes}))
    details = types.SimpleNamespace(cached_tokens=len(prompt) // 2)
    return types.SimpleNamespace(usage=types.SimpleNamespace(prompt_tokens_details=details),
                                 choices=choices[::-1])


def _engines():
    local = VLLMGenerator.__new__(VLLMGenerator)
    local.llm, local.route_info = FakeLLM(), {"num_experts": E}
    remote = RemoteGenerator.__new__(RemoteGenerator)
    remote.client = types.SimpleNamespace(completions=types.SimpleNamespace(create=_create))
    remote.model, remote.url, remote.hf_config = "m", "http://fake", {"num_hidden_layers": L,
                                                                       "num_experts": E}
    remote._pool = ThreadPoolExecutor(2)
    for g, name in ((local, "vllm (cpu)"), (remote, "vllm server (http://fake)")):
        g.model_dir, g.dtype, g.max_model_len, g.vocab_size = "/m", "bfloat16", 1024, V
        g.max_logprobs, g.info = 20, EngineInfo(name, "0")
    return local, remote


@pytest.mark.parametrize("kw", [
    dict(n=2, seed=3, max_tokens=7),
    dict(seeds=[5, 6, 7], top_k=8, capture_support=True, topk_logprobs=4),
    dict(seed=None, top_p=0.9, topk_logprobs=3, n=2),
    dict(route_starts=[2, 0, 4], n=2, top_k=6, capture_support="logprobs"),
])
def test_both_clients_assemble_the_same_rollout(kw):
    local, remote = _engines()
    a, b = local.generate(PROMPTS, **kw), remote.generate(PROMPTS, **kw)
    for f in ("prompt_tokens", "prompt_cu", "response_tokens", "response_cu", "group_ids"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert np.array_equal(a.rollout_logprobs.view(np.uint32), b.rollout_logprobs.view(np.uint32))
    assert a.sampling == b.sampling and a.support == b.support
    assert (a.support is not None) == bool(kw.get("capture_support"))
    assert (a.topk is None) == (b.topk is None)
    if a.topk is not None:
        assert np.array_equal(a.topk.ids, b.topk.ids) and np.array_equal(a.topk.values,
                                                                          b.topk.values)
    ma, mb = dict(a.meta), dict(b.meta)
    assert mb.pop("server") == "http://fake"
    for m in (ma, mb):
        m.pop("generate_s"), m.pop("tokens_per_s")
    da, db = ma.pop("route_deltas", None), mb.pop("route_deltas", None)
    assert ma == mb
    if "route_starts" in kw:
        assert a.routes is None and b.routes is None
        assert [s for s, _ in da] == [s for s, _ in db] == [2, 2, 0, 0, 4, 4]
        assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(da, db))
    else:
        assert a.routes is not None and a.routes == b.routes


def test_request_seeds_and_params():
    base = dict(vocab_size=V, max_model_len=64, max_logprobs=20, temperature=1.0, top_p=1.0,
                max_tokens=4, n=1, ignore_eos=True, topk_logprobs=0, route_starts=None)
    req = check_generate(PROMPTS, top_k=8, seed=10, seeds=None, capture_support=True, **base)
    assert not req.in_engine and req.n_logprobs == 17 and req.support_from_logprobs
    assert [req.seed_of(i) for i in range(3)] == [10, 11, 12]
    assert req.params(1) == dict(temperature=1.0, top_p=1.0, max_tokens=4, n=1, logprobs=17,
                                 ignore_eos=True, top_k=8, seed=11)
    req = check_generate(PROMPTS, top_k=0, seed=None, seeds=[4, 5, 6], capture_support=False,
                         **base)
    assert req.seed_of(2) == 6 and "top_k" not in req.params(0)
    assert "seed" not in check_generate(PROMPTS, top_k=0, seed=None, seeds=None,
                                        capture_support=False, **base).params(0)


def test_multiturn_over_both_clients():
    """``generate_multiturn`` (one ``Trajectory`` per row) gives the same trajectories through
    either client; ``options=`` and keywords are the same call; deltas assemble into the routes
    a full-prefix resend records."""
    from skyrl_numerics.engine.multiturn import KeyValueEnv, MultiTurnOptions, generate_multiturn

    local, remote = _engines()
    kw = dict(max_turns=3, max_tokens=5, n=2, seed=1, top_k=8, capture_support=True,
              topk_logprobs=3)
    prompts = [p * 3 for p in PROMPTS]
    a = generate_multiturn(local, prompts, KeyValueEnv, **kw)
    b = generate_multiturn(remote, prompts, KeyValueEnv,
                           options=MultiTurnOptions(**{**kw, "max_turns": 2}), max_turns=3)
    full = generate_multiturn(local, prompts, KeyValueEnv, route_deltas=False, **kw)
    assert a.is_multi_turn and a.num_turns.max() == 3 and list(a.group_ids) == [0, 0, 1, 1, 2, 2]
    for f in ("prompt_tokens", "response_tokens", "response_cu", "loss_mask", "turns"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert np.array_equal(a.rollout_logprobs, b.rollout_logprobs, equal_nan=True)
    assert a.support == b.support and a.routes == b.routes == full.routes
    assert np.array_equal(a.topk.ids, b.topk.ids)
    assert a.meta["env_reward"] == b.meta["env_reward"] and a.sampling == b.sampling
    rb = a.meta["route_bytes"]
    assert rb == b.meta["route_bytes"] and 0 < rb["delta"] < rb["full_resend"]
