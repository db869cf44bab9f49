"""Bitwise-identical logprobs between the real vLLM CPU engine and the trainer, every token.

Both run ``invariant/qwen3_moe.py``: vLLM as an out-of-tree model over its paged KV cache
(continuous batching, prefill + token-by-token decode, prefix caching on), the trainer as packed
full-sequence forwards. Nothing is mocked.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs
from skyrl_numerics.invariant.qwen3_moe import InvariantQwen3Moe

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def trainer_model(qwen_moe_dir):
    return InvariantQwen3Moe.from_checkpoint(qwen_moe_dir)


@pytest.mark.isa   # also under each lower CPU capability: the engine's workers inherit the cap
@pytest.mark.parametrize("n_prompts", [1, 3, 8])
def test_every_token_bitwise_equal_at_engine_batch_sizes(vllm_qwen_invariant, trainer_model,
                                                         n_prompts):
    gen = vllm_qwen_invariant
    # the engine's workers run the ISA this process runs (under tests/test_isa_matrix.py: the cap)
    assert gen.engine_host["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    ro = gen.generate(make_prompts(n_prompts, 12, gen.vocab_size, seed=n_prompts),
                      max_tokens=24, seed=n_prompts, temperature=0.8)
    for bs in (1, 4):
        tl = invariant_trainer_logprobs(trainer_model, ro, batch_size=bs)
        bad = np.flatnonzero(tl.logprobs != ro.rollout_logprobs)
        assert len(bad) == 0, (f"{len(bad)}/{len(tl.logprobs)} tokens differ, first at {bad[0]}: "
                               f"{tl.logprobs[bad[0]]} vs {ro.rollout_logprobs[bad[0]]}")


def test_bitwise_with_prefix_cache_hits_and_ragged_lengths(vllm_qwen_invariant, trainer_model):
    gen = vllm_qwen_invariant
    shared = make_prompts(1, 260, gen.vocab_size, seed=21)[0]   # > 2 KV blocks of 128
    tails = make_prompts(4, 7, gen.vocab_size, seed=22)
    gen.generate([shared + tails[0]], max_tokens=4, seed=0)      # warms the prefix cache
    prompts = [shared + t[: 2 + i] for i, t in enumerate(tails)]
    ro = gen.generate(prompts, max_tokens=16, seed=5)
    assert min(ro.meta["num_cached_tokens"]) >= 256, ro.meta["num_cached_tokens"]
    tl = invariant_trainer_logprobs(trainer_model, ro, batch_size=3)
    np.testing.assert_array_equal(tl.logprobs, ro.rollout_logprobs)


@pytest.mark.parametrize("sampling", [dict(temperature=0.8), dict(temperature=1.0, top_k=16,
                                                                   capture_support=True)])
def test_the_whole_top_k_distribution_is_bitwise(vllm_qwen_invariant, trainer_model, sampling):
    """Not only the sampled token: the engine's top-40 processed logprobs at every position equal
    the invariant trainer's log-softmax at the same ids, bit for bit, and are its top-40 (with
    top-k 16, entries 17.. are -inf on both sides)."""
    from skyrl_numerics.invariant.rollout_forward import invariant_topk

    gen = vllm_qwen_invariant
    ro = gen.generate(make_prompts(5, 10, gen.vocab_size, seed=31), max_tokens=12, seed=2,
                      topk_logprobs=40, **sampling)
    assert ro.topk.ids.shape == (ro.num_response_tokens, 40)
    d = invariant_topk(trainer_model, ro, use_support="top_k" in sampling)
    assert d["frac_bitwise"] == 1.0 and d["positions"] == ro.num_response_tokens, d
    assert d["first_mismatch"] is None and d["tv_mean"] == 0.0
