"""The per-version check of ``make compat`` (``benchmarks/compat.py`` runs it with each side
venv's Python): every piece of ours that touches vLLM internals, on the tiny Qwen3-MoE, one
engine at a time, nothing mocked. Writes one record per piece to the JSON file named by
``argv[1]``: ``{"piece", "ok", "error" (the exception's one line), "note", "seconds"}``.

1. ``start-up check``: ``check_vllm_version`` on the installed version; outside the supported
   range ``VLLMGenerator`` must refuse with ``UnsupportedVersion`` before starting anything.
   The other pieces then run with ``SKYRL_NUMERICS_UNTESTED_VLLM=1`` (to learn what works).
2. ``VLLMGenerator + route/support capture``: the plugin, the worker extension's route capture on
   vLLM's router hook and support capture on its sampler; routes replayed into the HF trainer.
3. ``batch-invariant engine == trainer``: the out-of-tree invariant model vs the invariant trainer,
   every logprob bitwise.
4. ``seeded sampling under chunked prefill``: the patch that lets vLLM rewind a CPU generator
   (``vllm_patches._rewindable_cpu_seeds``); seeded requests prefilled in 64-token chunks.
5. ``VLLMServer + routed_experts``: ``vllm serve`` with our plugin (``--api-key``, dev mode, the
   CPU runner patches for ``--enable-return-routed-experts`` from vLLM 0.31, vLLM's own V1
   capturer on 0.30), one completion, routes decoded; the prompt positions' routes equal those
   the in-process capture (piece 2) recorded for the same prompt.
6. ``skyrl_delta in-place update``: vLLM's own trainer-side client drives the backend: a full
   snapshot leaves outputs bit-identical, a delta changes them, the checkpoint sent back
   restores them; the control routes refuse a request without the key.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback

import numpy as np

API_KEY, SYNC_KEY = "compat-api-key", "compat-sync-key"
RECORDS: list[dict] = []
SERVER_PROMPT = list(range(10, 22))
# the prompt positions' routes of SERVER_PROMPT, captured in process (piece 2), for piece 5
IN_PROCESS: dict[str, np.ndarray] = {}


def _one_line(e: BaseException) -> str:
    """The exception as one line; for a message holding a log tail (``VLLMServer.start``), its
    last line that names an error."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if re.search(r"\w+(Error|Exception)\b", ln)]
    line = (named or lines or [repr(e)])[-1]
    line = re.sub(r"^ERROR [\d-]+ [\d:]+ \[[^]]*\] ", "", line)   # vLLM's log prefix
    return f"{type(e).__name__}: {line[:300]}"


def piece(name):
    def wrap(fn):
        def run(*args):
            t0 = time.monotonic()
            rec = {"piece": name, "ok": False, "error": None, "note": None}
            print(f"-- {name}", flush=True)
            try:
                rec["note"] = fn(*args)
                rec["ok"] = True
            except BaseException as e:   # a report of what broke, not a test: record every kind
                traceback.print_exc()
                rec["error"] = _one_line(e)
                if isinstance(e, KeyboardInterrupt):
                    raise
            rec["seconds"] = round(time.monotonic() - t0, 1)
            RECORDS.append(rec)
            return rec["ok"]
        return run
    return wrap


@piece("start-up check")
def startup_check(model_dir):
    from skyrl_numerics.engine.vllm_versions import UNTESTED_ENV, is_supported, supported_range
    from skyrl_numerics.errors import UnsupportedVersion
    from skyrl_numerics.host import vllm_version
    from skyrl_numerics.trainer import VLLMGenerator

    version = vllm_version()
    if is_supported(version):
        return f"accepted (supported {supported_range()})"
    try:
        VLLMGenerator(model_dir)
    except UnsupportedVersion as e:
        os.environ[UNTESTED_ENV] = "1"   # the pieces below: find out what works anyway
        return f"refused at start: {e}"
    raise AssertionError(f"vLLM {version} is outside {supported_range()} and was not refused")


@piece("VLLMGenerator + route/support capture + R3 replay")
def generator_capture(model_dir):
    from skyrl_numerics.gap import measure
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.trainer import VLLMGenerator, trainer_logprobs

    gen = VLLMGenerator(model_dir, capture_routes=True)
    try:
        ro = gen.generate(make_prompts(4, 12, gen.vocab_size, seed=3), temperature=1.0, top_p=0.9,
                          top_k=16, max_tokens=24, seed=3, capture_support=True)
        one = gen.generate([SERVER_PROMPT], max_tokens=8, seed=0)
        IN_PROCESS["prompt_routes"] = one.routes.seq(0)[:len(SERVER_PROMPT)]
    finally:
        gen.close()
    r, s = ro.routes, ro.support
    assert r is not None and (r.num_layers, r.k, r.num_experts) == (2, 2, 8), r
    np.testing.assert_array_equal(r.seq_lens, ro.prompt_lens + ro.response_lens - 1)
    assert s is not None and s.num_tokens == ro.num_response_tokens, s
    hf = load_hf_model(model_dir)
    gaps = {}
    for use_routes in (False, True):
        tl = trainer_logprobs(hf, ro, use_support=True, use_routes=use_routes)
        gaps[use_routes] = measure(tl.logprobs, ro.rollout_logprobs, cu_seqlens=ro.response_cu)
    plain, r3 = gaps[False].max_abs, gaps[True].max_abs
    assert r3 <= plain, (plain, r3)
    return f"{ro.num_response_tokens} tokens; max |dlogprob| {plain:.3g} -> {r3:.3g} with R3"


@piece("batch-invariant engine == invariant trainer")
def invariant(model_dir):
    from skyrl_numerics.invariant.qwen3_moe import InvariantQwen3Moe
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.trainer import VLLMGenerator
    from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

    gen = VLLMGenerator(model_dir, batch_invariant=True)
    try:
        ro = gen.generate(make_prompts(3, 12, gen.vocab_size, seed=3), max_tokens=24, seed=3,
                          temperature=0.8)
    finally:
        gen.close()
    tl = invariant_trainer_logprobs(InvariantQwen3Moe.from_checkpoint(model_dir), ro, batch_size=2)
    bad = int(np.count_nonzero(tl.logprobs != ro.rollout_logprobs))
    assert bad == 0, f"{bad}/{len(tl.logprobs)} logprobs differ"
    return f"{len(tl.logprobs)}/{len(tl.logprobs)} logprobs bitwise equal"


@piece("seeded sampling under chunked prefill")
def seeded_chunked(model_dir):
    """Seeded requests whose prompts are prefilled in 64-token chunks (vLLM rewinds a discarded
    draw's generator with ``set_offset``, which a CPU generator refuses: our patch
    ``_rewindable_cpu_seeds``): the engine lives, a request alone samples what it samples among
    others, and the invariant trainer's logprobs equal the engine's."""
    from skyrl_numerics.invariant.qwen3_moe import InvariantQwen3Moe
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.trainer import VLLMGenerator
    from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

    gen = VLLMGenerator(model_dir, batch_invariant=True, max_num_batched_tokens=64)
    try:
        prompts = make_prompts(3, 150, gen.vocab_size, seed=44) + make_prompts(2, 20, gen.vocab_size, seed=45)
        ro = gen.generate(prompts, max_tokens=8, seed=7, temperature=1.0)
        alone = gen.generate(prompts[:1], max_tokens=8, seed=7, temperature=1.0)
    finally:
        gen.close()
    n = len(alone.response_tokens)
    assert np.array_equal(alone.response_tokens, ro.response_tokens[:n]), "alone != among others"
    tl = invariant_trainer_logprobs(InvariantQwen3Moe.from_checkpoint(model_dir), ro, batch_size=2)
    bad = int(np.count_nonzero(tl.logprobs != ro.rollout_logprobs))
    assert bad == 0, f"{bad}/{len(tl.logprobs)} logprobs differ"
    return f"{len(prompts)} seeded requests, 3 of them chunked: alone == among others, {len(tl.logprobs)} logprobs bitwise"


def _fingerprint(srv, model_dir):
    import requests

    out = []
    for seed, prompt in ((1, [5, 6, 7, 8, 9]), (2, list(range(30, 70)))):
        r = requests.post(srv.url + "/v1/completions", headers=srv.headers(), timeout=60, json={
            "model": model_dir, "prompt": [prompt], "max_tokens": 6, "seed": seed,
            "temperature": 1.0, "logprobs": 1, "prompt_logprobs": 1, "return_token_ids": True})
        r.raise_for_status()
        ch = r.json()["choices"][0]
        out.append((ch["token_ids"], ch["logprobs"]["token_logprobs"], ch["prompt_logprobs"]))
    return out


@piece("VLLMServer + routed_experts")
def server_request(held, model_dir, log_path):
    import requests

    from skyrl_numerics.engine.server import VLLMServer
    from skyrl_numerics.replay import PackedRoutes

    srv = held["srv"] = VLLMServer(model_dir, api_key=API_KEY, sync_key=SYNC_KEY,
                                   log_path=log_path)
    srv.start()
    prompt = SERVER_PROMPT
    r = requests.post(srv.url + "/v1/completions", headers=srv.headers(), timeout=60, json={
        "model": model_dir, "prompt": [prompt], "max_tokens": 8, "seed": 0, "temperature": 1.0,
        "logprobs": 0, "return_token_ids": True})
    r.raise_for_status()
    ch = r.json()["choices"][0]
    assert len(ch["token_ids"]) == 8, ch
    routes = PackedRoutes.from_vllm([ch["routed_experts"]], 8, prompt_lens=[len(prompt)],
                                    response_lens=[8])
    assert routes.num_tokens == len(prompt) + 8 - 1, routes
    note = f"8 tokens; routes {routes.num_tokens} x {routes.num_layers} x {routes.k}"
    if "prompt_routes" in IN_PROCESS:   # the prompt's routes do not depend on sampling
        served = np.sort(routes.seq(0)[:len(prompt)], axis=-1)
        np.testing.assert_array_equal(served, np.sort(IN_PROCESS["prompt_routes"], axis=-1))
        note += f"; the {len(prompt)} prompt positions' routes equal the in-process capture"
    return note


@piece("skyrl_delta in-place update (vLLM's trainer client)")
def delta_update(srv, model_dir, store):
    import requests
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from skyrl_numerics.engine.transfer_backend import SkyrlDeltaTrainerInitInfo, http_client

    assert srv.alive(), "no server (the piece before failed to start it)"
    assert requests.post(srv.url + "/pause", timeout=10).status_code == 401
    ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
    base = _fingerprint(srv, model_dir)
    info = SkyrlDeltaTrainerInitInfo(store=store, rank=0, key=SYNC_KEY)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=http_client(srv.url, API_KEY))
    assert eng.send_weights(ckpt).is_full and _fingerprint(srv, model_dir) == base
    changed = {k: (v.float() * 3.0).to(v.dtype) if "layers.0.self_attn.q_proj" in k else v
               for k, v in ckpt.items()}
    m1 = eng.send_weights(changed)
    assert not m1.is_full and _fingerprint(srv, model_dir) != base
    eng.send_weights(ckpt)
    assert _fingerprint(srv, model_dir) == base
    return "full snapshot, delta, restore: outputs as expected, bit for bit"


def main(out_path: str) -> int:
    import tempfile

    from skyrl_numerics.models import build_tiny_model

    model_dir = str(build_tiny_model("qwen3_moe"))
    try:
        startup_check(model_dir)
        generator_capture(model_dir)
        invariant(model_dir)
        seeded_chunked(model_dir)
        tmp = tempfile.mkdtemp(prefix="skyrl_compat_")
        held = {}
        try:
            if server_request(held, model_dir, os.path.join(tmp, "vllm.log")):
                delta_update(held["srv"], model_dir, os.path.join(tmp, "store"))
            elif "srv" in held:
                print(held["srv"].tail(60), flush=True)
        finally:
            if "srv" in held:
                held["srv"].stop()
    finally:
        with open(out_path, "w") as f:
            json.dump(RECORDS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
