"""Engine == trainer, bit for bit, for the MoE families Mixtral (``mixtral``) and GLM-4.5/4.7
(``glm4_moe``: partial RoPE, q/k RMSNorm, q/k/v biases, sigmoid group-limited router with
``e_score_correction_bias`` and ``routed_scaling_factor``, a shared expert, a dense first layer):
the real vLLM CPU engine running the invariant model out of tree (continuous batching, chunked
prefill, prefix-cache hits) against the invariant trainer's packed forwards — every sampled
token's logprob, every full logits row (digest) and every route. Nothing is mocked.

One engine per family (~30-60 s each); the FP8-KV case runs with ``SKYRL_NUMERICS_MOE_ALL=1``.
The tiny checkpoints are written by transformers' own ``MixtralConfig`` / ``Glm4MoeConfig``
(``skyrl_numerics.models.build_tiny_model``); the families' math against HF transformers is in
tests/invariant/test_invariant_families.py.
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

ALL = os.environ.get("SKYRL_NUMERICS_MOE_ALL", "") == "1"
# case -> (builder family, KV-cache format, MoE layers)
CASES = {"mixtral": ("mixtral", None, 2), "glm4_moe": ("glm4_moe", None, 1),
         "glm4_moe-fp8": ("glm4_moe", "fp8", 1)}
DEFAULT = ("mixtral", "glm4_moe")
_OPT_IN = pytest.mark.skipif(not ALL, reason="one engine per case: set SKYRL_NUMERICS_MOE_ALL=1")


def _model_dir(case):
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model(CASES[case][0])


@pytest.fixture(scope="module", params=[
    pytest.param(c, marks=() if c in DEFAULT else _OPT_IN) for c in CASES])
def engine(request):
    """One invariant engine per case capturing routes, with a 64-token step budget (long prompts
    are prefilled in chunks), closed before the next case's starts."""
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import VLLMGenerator

    case = request.param
    d, kv = _model_dir(case), CASES[case][1]
    gen = VLLMGenerator(d, batch_invariant=True, kv_cache=kv, max_num_batched_tokens=64,
                        capture_routes=True)
    yield case, d, kv, gen
    gen.close()


def _assert_bitwise(tl, ro, what):
    bad = np.flatnonzero(tl.logprobs.view(np.uint32) != ro.rollout_logprobs.view(np.uint32))
    assert len(bad) == 0, (f"{what}: {len(bad)}/{len(tl.logprobs)} tokens differ, first at "
                           f"{bad[0]}: {tl.logprobs[bad[0]]} vs {ro.rollout_logprobs[bad[0]]}")


def test_every_token_row_and_route_bitwise_under_chunked_prefill_and_prefix_hits(engine):
    case, d, kv, gen = engine
    shared = make_prompts(1, 150, gen.vocab_size, seed=61)[0]      # > 64: prefilled in chunks
    # seed=None: vLLM CPU 0.32 cannot combine per-request seeds with chunked prefill
    gen.generate([shared + [5, 6]], max_tokens=2, seed=None)        # warms the prefix cache
    prompts = [shared + t for t in make_prompts(3, 5, gen.vocab_size, seed=62)]
    prompts += make_prompts(3, 90, gen.vocab_size, seed=63)         # chunked, no cache hit
    prompts += make_prompts(4, 7, gen.vocab_size, seed=64)          # short: decode beside prefill
    ro = gen.generate(prompts, max_tokens=16, seed=None, temperature=0.8, logits_digest=True)
    assert min(ro.meta["num_cached_tokens"][:3]) >= 128, ro.meta["num_cached_tokens"]
    model = from_checkpoint(d, kv_cache=kv)
    for bs in (1, 4, 10):
        tl = invariant_trainer_logprobs(model, ro, batch_size=bs, return_routes=True)
        _assert_bitwise(tl, ro, f"{case} trainer batch {bs}")
        assert ro.routes is not None and tl.routes == ro.routes
        assert tl.routes.num_layers == CASES[case][2] and tl.routes.k == 2
    digest = invariant_logits_digest(model, ro, batch_size=4)
    assert digest["frac_bitwise"] == 1.0 and digest["positions"] == ro.num_response_tokens, digest
    if kv is not None:   # the FP8 cache is really in effect: a trainer without it is off
        plain = invariant_trainer_logprobs(from_checkpoint(d), ro, batch_size=10)
        assert (plain.logprobs != ro.rollout_logprobs).mean() > 0.2


def test_a_prompt_has_the_same_bits_and_routes_at_any_engine_batch(engine):
    """The same prompt alone and among 7 others: the same tokens, logprob bits and routes
    (greedy: vLLM CPU 0.32 refuses per-request seeds beside chunked prefill)."""
    case, d, kv, gen = engine
    prompts = make_prompts(8, 12, gen.vocab_size, seed=65)
    together = gen.generate(prompts, max_tokens=20, seed=None, temperature=0.0)
    alone = gen.generate(prompts[5:6], max_tokens=20, seed=None, temperature=0.0)
    a, b = together.response_cu[5], together.response_cu[6]
    assert together.response(5).tolist() == alone.response(0).tolist()
    assert together.rollout_logprobs[a:b].tobytes() == alone.rollout_logprobs.tobytes()
    assert np.array_equal(together.routes.seq(5), alone.routes.seq(0))


@pytest.mark.parametrize("case", list(DEFAULT))
def test_vllm_runs_the_invariant_model_of_each_family(case):
    """Without an engine: the config gets the invariant override, vLLM's registry (after our
    plugin registered) knows the architecture, and the model built as the engine builds it
    loads every checkpoint weight through the engine's ``load_weights`` naming."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from skyrl_numerics.engine import vllm_invariant_model as vim
    from skyrl_numerics.engine.vllm_plugin import register
    from skyrl_numerics.invariant import family_class
    from skyrl_numerics.invariant.base import iter_checkpoint_tensors

    d = _model_dir(case)
    hf_cfg = json.loads((d / "config.json").read_text())
    over = vim.engine_overrides(hf_cfg, "fp8")
    arch = over["architectures"][0]
    assert arch == f"SkyrlInvariant{hf_cfg['architectures'][0]}" and "model_type" not in over
    register()
    assert arch in ModelRegistry.get_supported_archs()
    cfg = AutoConfig.from_pretrained(str(d))
    for k, v in over.items():
        setattr(cfg, k, v)
    core = family_class(over["skyrl_base_arch"]).from_config(cfg, kv_cache=json.loads(
        over["skyrl_kv_cache"]), pack=True)
    assert core.kv.row_bytes == 2 * cfg.num_key_value_heads * cfg.head_dim   # [K | V] in E4M3
    loaded = core.load_named(iter_checkpoint_tensors(d))
    assert loaded == set(core.hf_names())
