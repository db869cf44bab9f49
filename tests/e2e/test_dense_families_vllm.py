"""Engine == trainer, bit for bit, for the dense decoders (family ``dense``: Qwen3, Llama, Qwen2
with q/k/v biases, Mistral) and Qwen3-MoE with dense layers (``mlp_only_layers``): the real
vLLM CPU engine running the invariant model out of tree (continuous batching, chunked prefill,
prefix-cache hits) against the invariant trainer's packed forwards — every sampled token's
logprob, every full logits row (digest) and, for the MoE, every route. Nothing is mocked.

Engines cost ~30-60 s each, so the default suite starts two (dense Qwen3 and Llama); the other
cases run with ``SKYRL_NUMERICS_DENSE_ALL=1`` (each architecture's engine == trainer check, the
FP8 cache). Every architecture's vLLM registration and weight loading is checked without an
engine below (``test_vllm_runs_the_invariant_model_of_every_architecture``); its math against
HF transformers is in tests/invariant/test_invariant_families.py.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ALL = os.environ.get("SKYRL_NUMERICS_DENSE_ALL", "") == "1"
# case -> (builder family, overrides, KV-cache format)
CASES = {"qwen3": ("qwen3", {}, None), "llama": ("llama", {}, None),
         "qwen2": ("qwen2", {}, None), "mistral": ("mistral", {}, None),
         "qwen3_moe-dense": ("qwen3_moe", {"mlp_only_layers": [0], "num_hidden_layers": 3}, None),
         "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}, None),
         "qwen3-fp8": ("qwen3", {}, "fp8")}
DEFAULT = ("qwen3", "llama")
_OPT_IN = pytest.mark.skipif(not ALL, reason="one engine per case: set SKYRL_NUMERICS_DENSE_ALL=1")


def _model_dir(case):
    from skyrl_numerics.models import build_tiny_model

    family, over, _ = CASES[case]
    return build_tiny_model(family, **over)


@pytest.fixture(scope="module", params=[
    pytest.param(c, marks=() if c in DEFAULT else _OPT_IN) for c in CASES])
def engine(request):
    """One invariant engine per case with a 64-token step budget (long prompts are prefilled
    in chunks), closed before the next case's starts."""
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import VLLMGenerator

    case = request.param
    d, kv = _model_dir(case), CASES[case][2]
    gen = VLLMGenerator(d, batch_invariant=True, kv_cache=kv, max_num_batched_tokens=64,
                        capture_routes=case == "qwen3_moe-dense")
    yield case, d, kv, gen
    gen.close()


def _assert_bitwise(tl, ro, what):
    bad = np.flatnonzero(tl.logprobs.view(np.uint32) != ro.rollout_logprobs.view(np.uint32))
    assert len(bad) == 0, (f"{what}: {len(bad)}/{len(tl.logprobs)} tokens differ, first at "
                           f"{bad[0]}: {tl.logprobs[bad[0]]} vs {ro.rollout_logprobs[bad[0]]}")


def test_every_token_row_and_route_bitwise_under_chunked_prefill_and_prefix_hits(engine):
    case, d, kv, gen = engine
    shared = make_prompts(1, 150, gen.vocab_size, seed=51)[0]      # > 64: prefilled in chunks
    # seed=None: vLLM CPU 0.32 cannot combine per-request seeds with chunked prefill
    gen.generate([shared + [5, 6]], max_tokens=2, seed=None)        # warms the prefix cache
    prompts = [shared + t for t in make_prompts(3, 5, gen.vocab_size, seed=52)]
    prompts += make_prompts(3, 90, gen.vocab_size, seed=53)         # chunked, no cache hit
    prompts += make_prompts(4, 7, gen.vocab_size, seed=54)          # short: decode beside prefill
    ro = gen.generate(prompts, max_tokens=16, seed=None, temperature=0.8, logits_digest=True)
    assert min(ro.meta["num_cached_tokens"][:3]) >= 128, ro.meta["num_cached_tokens"]
    model = from_checkpoint(d, kv_cache=kv)
    moe = case == "qwen3_moe-dense"
    for bs in (1, 4, 10):
        tl = invariant_trainer_logprobs(model, ro, batch_size=bs, return_routes=moe)
        _assert_bitwise(tl, ro, f"{case} trainer batch {bs}")
        if moe:
            assert tl.routes == ro.routes and tl.routes.num_layers == 2
    digest = invariant_logits_digest(model, ro, batch_size=4)
    assert digest["frac_bitwise"] == 1.0 and digest["positions"] == ro.num_response_tokens, digest
    if kv is not None:   # the FP8 cache is really in effect: a trainer without it is off
        plain = invariant_trainer_logprobs(from_checkpoint(d), ro, batch_size=10)
        assert (plain.logprobs != ro.rollout_logprobs).mean() > 0.2


def test_a_prompt_has_the_same_bits_at_any_engine_batch(engine):
    """The same prompt alone and among 7 others: the same tokens and logprob bits (greedy:
    vLLM CPU 0.32 refuses per-request seeds in an engine with chunked prefill, "CPU Generator
    does not use offset", and the engine dies)."""
    case, d, kv, gen = engine
    prompts = make_prompts(8, 12, gen.vocab_size, seed=55)
    together = gen.generate(prompts, max_tokens=20, seed=None, temperature=0.0)
    alone = gen.generate(prompts[5:6], max_tokens=20, seed=None, temperature=0.0)
    a, b = together.response_cu[5], together.response_cu[6]
    assert together.response(5).tolist() == alone.response(0).tolist()
    assert together.rollout_logprobs[a:b].tobytes() == alone.rollout_logprobs.tobytes()


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2] is None])
def test_vllm_runs_the_invariant_model_of_every_architecture(case):
    """Without an engine: the checkpoint's config gets the invariant override, vLLM's model
    registry (after our plugin registered) knows the architecture, and the invariant model built
    the way the engine builds it (the overridden HF config, weights packed) loads every weight
    of the checkpoint through the engine's own ``load_weights`` naming."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from skyrl_numerics.engine import vllm_invariant_model as vim
    from skyrl_numerics.engine.vllm_plugin import register
    from skyrl_numerics.invariant import family_class
    from skyrl_numerics.invariant.base import iter_checkpoint_tensors

    d = _model_dir(case)
    hf_cfg = json.loads((d / "config.json").read_text())
    over = vim.engine_overrides(hf_cfg)
    arch = over["architectures"][0]
    assert arch == f"SkyrlInvariant{hf_cfg['architectures'][0]}"
    register()
    assert arch in ModelRegistry.get_supported_archs()
    assert getattr(vim, arch).hf_arch == hf_cfg["architectures"][0]
    cfg = AutoConfig.from_pretrained(str(d))
    for k, v in over.items():
        setattr(cfg, k, v)
    core = family_class(over["skyrl_base_arch"]).from_config(cfg, kv_cache=json.loads(
        over["skyrl_kv_cache"]), pack=True)
    loaded = core.load_named(iter_checkpoint_tensors(d))
    assert loaded == set(core.hf_names())


def test_train_bitwise_on_a_dense_model_is_exact_every_step(tmp_path):
    """``skyrl-numerics train --model DIR --configs bitwise`` on the tiny dense Qwen3 (its own
    engine, in the CLI's process): the engine is asked for no routes (a dense model has no router),
    and every step's gap is 0 with the execution contracts equal."""
    import subprocess
    import sys

    out = tmp_path / "train"
    proc = subprocess.run([sys.executable, "-m", "skyrl_numerics.cli", "train", "--model", _model_dir("qwen3"),
                           "--configs", "bitwise", "--steps", "2", "--prompts", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((out / "train.json").read_text())
    steps = rec["history"]["bitwise"]
    assert len(steps) == 2
    for s in steps:
        assert s["gap_max_abs"] == 0.0 and s["gap_frac_bitwise_equal"] == 1.0, s
    assert rec["contracts"]["bitwise"]["equal"] is True
