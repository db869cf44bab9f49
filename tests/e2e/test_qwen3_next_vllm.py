"""Qwen3-Next (Gated DeltaNet + gated full attention, MoE) bitwise between the real vLLM CPU
engine and the trainer.

The invariant out-of-tree model keeps each request's recurrent state (conv inputs + the fp32
delta-rule state) in vLLM's own Mamba state cache (``engine/vllm_hybrid_state.py``) and runs the
trainer's fixed-order recurrence on it; the full-attention layers use the paged rows as every
family does. One engine for the module (prefix caching on: vLLM's "align" Mamba cache mode,
block size raised to 640 tokens so an attention page holds a state page) with a 64-token step
budget, so long prompts are prefilled in chunks. Nothing is mocked. The FP8-cache case starts its
own engine: opt-in (``SKYRL_NUMERICS_HYBRID_ALL=1``).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def qn_dir():
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model("qwen3_next")


@pytest.fixture(scope="module")
def qn_engine(qn_dir):
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import VLLMGenerator

    gen = VLLMGenerator(qn_dir, batch_invariant=True, capture_routes=True,
                        max_num_batched_tokens=64)
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def qn_trainer(qn_dir):
    return from_checkpoint(qn_dir)


def _assert_bitwise(tl, ro, what=""):
    bad = np.flatnonzero(tl.logprobs != ro.rollout_logprobs)
    assert len(bad) == 0, (f"{what}: {len(bad)}/{len(tl.logprobs)} tokens differ, first at "
                           f"{bad[0]}: {tl.logprobs[bad[0]]} vs {ro.rollout_logprobs[bad[0]]}")


def test_every_token_route_and_logits_row_bitwise_at_engine_and_trainer_batch_sizes(
        qn_engine, qn_trainer):
    """Seven requests decoding together (two prefilled in chunks of the 64-token budget): every
    sampled token's logprob, every route and every full logits row is the trainer's, at
    trainer batch sizes 1 and 3."""
    gen = qn_engine
    prompts = make_prompts(5, 30, gen.vocab_size, seed=1) + make_prompts(2, 100, gen.vocab_size,
                                                                         seed=2)
    ro = gen.generate(prompts, max_tokens=16, seed=None, temperature=0.8, logits_digest=True)
    for bs in (1, 3):
        tl = invariant_trainer_logprobs(qn_trainer, ro, batch_size=bs, return_routes=True)
        _assert_bitwise(tl, ro, f"trainer batch {bs}")
        assert ro.routes is not None and tl.routes == ro.routes
    digest = invariant_logits_digest(qn_trainer, ro, batch_size=4)
    assert digest["frac_bitwise"] == 1.0 and digest["positions"] == ro.num_response_tokens, digest


def test_bitwise_under_chunked_prefill_and_prefix_cache_hits(qn_engine, qn_trainer):
    """A 700-token prefix prefilled in 64-token chunks, then three requests that extend it:
    they hit the prefix cache for a whole 640-token block (vLLM restores the Gated DeltaNet
    state saved at that block boundary, "align" mode) and still give the trainer's bits; and a
    request alone gets the bits it got among the others (greedy: vLLM CPU's seeded sampling
    under chunked prefill fails on its own, 'CPU Generator does not use offset')."""
    gen = qn_engine
    shared = make_prompts(1, 700, gen.vocab_size, seed=31)[0]
    gen.generate([shared + [5, 6]], max_tokens=2, seed=None)
    prompts = [shared + t for t in make_prompts(3, 5, gen.vocab_size, seed=32)]
    prompts += make_prompts(2, 90, gen.vocab_size, seed=33)     # chunked, no cache hit
    ro = gen.generate(prompts, max_tokens=10, seed=None, temperature=0.0)
    assert min(ro.meta["num_cached_tokens"][:3]) >= 640, ro.meta["num_cached_tokens"]
    tl = invariant_trainer_logprobs(qn_trainer, ro, batch_size=3, return_routes=True)
    _assert_bitwise(tl, ro)
    assert tl.routes == ro.routes
    alone = gen.generate([prompts[3]], max_tokens=10, seed=None, temperature=0.0)
    cu = ro.response_cu
    assert alone.response(0).tolist() == ro.response(3).tolist()
    assert np.array_equal(alone.rollout_logprobs, ro.rollout_logprobs[cu[3]:cu[4]])


def test_the_recurrent_state_is_in_effect(qn_engine, qn_dir):
    """A trainer whose delta rule forgets faster (A_log + 1 in the linear layer) gives other
    logprobs: the engine's numbers depend on the state it carries."""
    import torch

    gen = qn_engine
    ro = gen.generate(make_prompts(2, 40, gen.vocab_size, seed=7), max_tokens=8, seed=None)
    other = from_checkpoint(qn_dir)
    with torch.no_grad():
        other.w("model.layers.0.linear_attn.A_log").add_(1.0)
    diff = np.abs(invariant_trainer_logprobs(other, ro, batch_size=2).logprobs
                  - ro.rollout_logprobs)
    assert (diff > 0).mean() > 0.5, (diff > 0).mean()


@pytest.mark.skipif(os.environ.get("SKYRL_NUMERICS_HYBRID_ALL", "") != "1",
                    reason="one engine more: set SKYRL_NUMERICS_HYBRID_ALL=1")
def test_fp8_kv_cache_on_the_full_attention_layers_is_bitwise(qn_dir):
    """``kv_cache="fp8"``: the full-attention layers' rows stored as E4M3 in the paged cache (the
    GQA ``KVFormat``; tests/invariant/test_hybrid_kv_fp8.py checks those rows without an engine).
    Tokens, routes and full logits rows equal the fp8 trainer's, under chunked prefill and a
    640-token prefix-cache hit; a bf16-cache trainer is off. Its own engine (opt-in: the module's
    engine cannot switch cache format), closed at the end."""
    from skyrl_numerics.trainer import VLLMGenerator

    trainer = from_checkpoint(qn_dir, kv_cache="fp8")
    gen = VLLMGenerator(qn_dir, batch_invariant=True, capture_routes=True,
                        max_num_batched_tokens=64, kv_cache="fp8")
    try:
        prompts = make_prompts(5, 30, gen.vocab_size, seed=1) + make_prompts(2, 100, gen.vocab_size,
                                                                             seed=2)
        ro = gen.generate(prompts, max_tokens=16, seed=None, temperature=0.8, logits_digest=True)
        tl = invariant_trainer_logprobs(trainer, ro, batch_size=3, return_routes=True)
        _assert_bitwise(tl, ro, "fp8")
        assert tl.routes == ro.routes
        digest = invariant_logits_digest(trainer, ro, batch_size=4)
        assert digest["frac_bitwise"] == 1.0, digest
        off = invariant_trainer_logprobs(from_checkpoint(qn_dir), ro, batch_size=3)
        assert (off.logprobs != ro.rollout_logprobs).mean() > 0.5
        shared = make_prompts(1, 700, gen.vocab_size, seed=31)[0]
        gen.generate([shared + [5, 6]], max_tokens=2, seed=None)
        hit = gen.generate([shared + t for t in make_prompts(3, 5, gen.vocab_size, seed=32)],
                           max_tokens=8, seed=None, temperature=0.0)
        assert min(hit.meta["num_cached_tokens"]) >= 640, hit.meta["num_cached_tokens"]
        tl = invariant_trainer_logprobs(trainer, hit, batch_size=3, return_routes=True)
        _assert_bitwise(tl, hit, "fp8 prefix hit")
        assert tl.routes == hit.routes
    finally:
        gen.close()
