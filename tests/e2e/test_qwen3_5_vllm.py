"""Qwen3.5's text models (``Qwen3_5ForCausalLM`` dense, ``Qwen3_5MoeForCausalLM``) bitwise
between the real vLLM CPU engine and the trainer.

The families reuse Qwen3-Next's module (``invariant/qwen3_5.py``), so the engine path is Qwen3-Next's:
each request's Gated DeltaNet state in vLLM's own Mamba state cache
(``engine/vllm_hybrid_state.py``), the full-attention layers on the paged rows. One engine per
family and cache format, each for its tests (module-scoped, parametrized: one is closed before
the next starts), prefix caching on ("align" mode) and a 64-token step budget, so long prompts are
prefilled in chunks; the ``-fp8`` params store the full-attention rows as E4M3
(tests/invariant/test_hybrid_kv_fp8.py checks those rows without an engine). Nothing is mocked.
Opt-in (``SKYRL_NUMERICS_HYBRID_ALL=1``): four engines more than the suite's time budget holds;
the default suite runs their trainer side (tests/invariant/test_qwen3_5.py) and the same engine
path on Qwen3-Next (tests/e2e/test_qwen3_next_vllm.py).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("SKYRL_NUMERICS_HYBRID_ALL", "") != "1",
                                 reason="four engines more: set SKYRL_NUMERICS_HYBRID_ALL=1")]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_5-fp8", "qwen3_5_moe-fp8"])
def q35(request):
    """``(family, checkpoint dir, engine, trainer)`` of one Qwen3.5 text model; ``-fp8``: the
    full-attention layers' cache rows in E4M3 (``kv_cache="fp8"``, the trainer likewise)."""
    pytest.importorskip("vllm")
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.trainer import VLLMGenerator

    family, _, kv = request.param.partition("-")
    kv = kv or None
    d = build_tiny_model(family)
    gen = VLLMGenerator(d, batch_invariant=True, capture_routes=family == "qwen3_5_moe",
                        max_num_batched_tokens=64, kv_cache=kv)
    yield family, d, gen, from_checkpoint(d, kv_cache=kv)
    gen.close()


def _assert_bitwise(tl, ro, what=""):
    bad = np.flatnonzero(tl.logprobs != ro.rollout_logprobs)
    assert len(bad) == 0, (f"{what}: {len(bad)}/{len(tl.logprobs)} tokens differ, first at "
                           f"{bad[0]}: {tl.logprobs[bad[0]]} vs {ro.rollout_logprobs[bad[0]]}")


def test_every_token_route_and_logits_row_bitwise_at_engine_and_trainer_batch_sizes(q35):
    """Seven requests decoding together (two prefilled in chunks of the 64-token budget): every
    sampled token's logprob, every route (MoE) and every full logits row is the trainer's, at
    trainer batch sizes 1 and 3."""
    family, _, gen, trainer = q35
    moe = family == "qwen3_5_moe"
    prompts = make_prompts(5, 30, gen.vocab_size, seed=1) + make_prompts(2, 100, gen.vocab_size,
                                                                         seed=2)
    ro = gen.generate(prompts, max_tokens=16, seed=None, temperature=0.8, logits_digest=True)
    for bs in (1, 3):
        tl = invariant_trainer_logprobs(trainer, ro, batch_size=bs, return_routes=moe)
        _assert_bitwise(tl, ro, f"{family}, trainer batch {bs}")
        if moe:
            assert ro.routes is not None and tl.routes == ro.routes
    digest = invariant_logits_digest(trainer, ro, batch_size=4)
    assert digest["frac_bitwise"] == 1.0 and digest["positions"] == ro.num_response_tokens, digest
    if trainer.kv.format == "fp8":         # the FP8 rows are in effect: a bf16-cache trainer is off
        off = invariant_trainer_logprobs(from_checkpoint(gen.model_dir), ro, batch_size=3)
        assert (off.logprobs != ro.rollout_logprobs).mean() > 0.5


def test_bitwise_under_chunked_prefill_and_prefix_cache_hits(q35):
    """A 700-token prefix prefilled in 64-token chunks, then three requests that extend it hit
    the prefix cache for a whole block (vLLM restores the Gated DeltaNet state saved at that
    block boundary) and still give the trainer's bits; a request alone gets the bits it got
    among the others (greedy)."""
    family, _, gen, trainer = q35
    moe = family == "qwen3_5_moe"
    shared = make_prompts(1, 700, gen.vocab_size, seed=31)[0]
    gen.generate([shared + [5, 6]], max_tokens=2, seed=None)
    prompts = [shared + t for t in make_prompts(3, 5, gen.vocab_size, seed=32)]
    prompts += make_prompts(2, 90, gen.vocab_size, seed=33)     # chunked, no cache hit
    ro = gen.generate(prompts, max_tokens=10, seed=None, temperature=0.0)
    assert min(ro.meta["num_cached_tokens"][:3]) >= 512, ro.meta["num_cached_tokens"]
    tl = invariant_trainer_logprobs(trainer, ro, batch_size=3, return_routes=moe)
    _assert_bitwise(tl, ro, family)
    if moe:
        assert tl.routes == ro.routes
    alone = gen.generate([prompts[3]], max_tokens=10, seed=None, temperature=0.0)
    cu = ro.response_cu
    assert alone.response(0).tolist() == ro.response(3).tolist()
    assert np.array_equal(alone.rollout_logprobs, ro.rollout_logprobs[cu[3]:cu[4]])


def test_the_separate_projections_are_in_effect(q35):
    """A trainer whose ``in_proj_a`` (Qwen3.5's own decay projection) is scaled gives other
    logprobs: the engine computes with the separately stored projections."""
    import torch

    _, d, gen, _ = q35
    ro = gen.generate(make_prompts(2, 40, gen.vocab_size, seed=7), max_tokens=8, seed=None)
    other = from_checkpoint(d)
    with torch.no_grad():
        other.w("model.layers.0.linear_attn.in_proj_a.weight").mul_(4.0)
    diff = np.abs(invariant_trainer_logprobs(other, ro, batch_size=2).logprobs
                  - ro.rollout_logprobs)
    assert (diff > 0).mean() > 0.5, (diff > 0).mean()
