"""Nemotron-H bitwise between the real vLLM CPU engine and the trainer: Mamba-2 + attention +
ReLU² MLP blocks (``nemotron_h``), and Nemotron 3's MoE blocks (``nemotron_h_moe``: sigmoid
group-limited router with ``e_score_correction_bias``, non-gated ReLU² experts, a shared
expert; and Super's LatentMoE, ``moe_latent_size``) with every route captured in the engine
equal to the trainer's.

As Qwen3-Next (tests/e2e/test_qwen3_next_vllm.py): the invariant out-of-tree model keeps each
request's Mamba-2 state (conv inputs + the fp32 SSM state) in vLLM's own Mamba state cache
(``engine/vllm_hybrid_state.py``) and runs the trainer's fixed-order recurrence on it. One engine
per config (prefix caching on, "align" mode) with a 64-token step budget. Nothing is mocked.
Opt-in (``SKYRL_NUMERICS_HYBRID_ALL=1``: one more engine than the suite's time budget holds; the
default suite runs the same state keeper on Qwen3-Next, tests/e2e/test_qwen3_next_vllm.py).
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
                                 reason="one engine more: set SKYRL_NUMERICS_HYBRID_ALL=1")]


# name -> (tiny family, overrides, KV cache format of the attention layers): one engine each,
# in turn; "fp8": E4M3 rows with per-layer scales (the GQA ``KVFormat``, engine and trainer)
CONFIGS = {"dense": ("nemotron_h", {}, None), "moe": ("nemotron_h_moe", {}, None),
           "latent_moe": ("nemotron_h_moe", {"moe_latent_size": 32}, None),
           "dense-fp8": ("nemotron_h", {}, "fp8"), "moe-fp8": ("nemotron_h_moe", {}, "fp8")}


@pytest.fixture(scope="module", params=list(CONFIGS))
def nh_case(request):
    """``(checkpoint dir, kv_cache)`` of one config."""
    from skyrl_numerics.models import build_tiny_model

    family, over, kv = CONFIGS[request.param]
    return build_tiny_model(family, **over), kv


@pytest.fixture(scope="module")
def nh_dir(nh_case):
    return nh_case[0]


def _is_moe(d) -> bool:
    import json

    return "moe" in json.loads((d / "config.json").read_text())["layers_block_type"]


@pytest.fixture(scope="module")
def nh_engine(nh_case):
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import VLLMGenerator

    nh_dir, kv = nh_case
    gen = VLLMGenerator(nh_dir, batch_invariant=True, max_num_batched_tokens=64,
                        capture_routes=_is_moe(nh_dir), kv_cache=kv)
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def nh_trainer(nh_case):
    return from_checkpoint(nh_case[0], kv_cache=nh_case[1])


def _assert_bitwise(tl, ro, what=""):
    bad = np.flatnonzero(tl.logprobs != ro.rollout_logprobs)
    assert len(bad) == 0, (f"{what}: {len(bad)}/{len(tl.logprobs)} tokens differ, first at "
                           f"{bad[0]}: {tl.logprobs[bad[0]]} vs {ro.rollout_logprobs[bad[0]]}")


def _trainer(model, ro, bs):
    """The trainer's logprobs; with routes (equal to the engine's) on an MoE config."""
    moe = model.route_info()["layers"] > 0
    tl = invariant_trainer_logprobs(model, ro, batch_size=bs, return_routes=moe)
    if moe:
        assert ro.routes is not None and tl.routes == ro.routes
        assert ro.routes.num_layers == model.route_info()["layers"]
    else:
        assert ro.routes is None
    return tl


def test_every_token_and_logits_row_bitwise_at_engine_and_trainer_batch_sizes(nh_engine,
                                                                              nh_trainer):
    gen = nh_engine
    prompts = make_prompts(5, 30, gen.vocab_size, seed=1) + make_prompts(2, 100, gen.vocab_size,
                                                                         seed=2)
    ro = gen.generate(prompts, max_tokens=16, seed=None, temperature=0.8, logits_digest=True)
    for bs in (1, 3):
        _assert_bitwise(_trainer(nh_trainer, ro, bs), ro, f"trainer batch {bs}")
    digest = invariant_logits_digest(nh_trainer, ro, batch_size=4)
    assert digest["frac_bitwise"] == 1.0 and digest["positions"] == ro.num_response_tokens, digest
    if nh_trainer.kv.format == "fp8":      # the FP8 rows are in effect: a bf16-cache trainer is off
        off = invariant_trainer_logprobs(from_checkpoint(gen.model_dir), ro, batch_size=3)
        assert (off.logprobs != ro.rollout_logprobs).mean() > 0.5


def test_bitwise_under_chunked_prefill_and_prefix_cache_hits(nh_engine, nh_trainer):
    """A 700-token prefix prefilled in 64-token chunks, then requests extending it hit the
    prefix cache (vLLM restores the Mamba-2 state saved at a block boundary) and still give the
    trainer's bits; so does a request alone vs the same one among others (greedy)."""
    gen = nh_engine
    shared = make_prompts(1, 700, gen.vocab_size, seed=31)[0]
    gen.generate([shared + [5, 6]], max_tokens=2, seed=None)
    prompts = [shared + t for t in make_prompts(3, 5, gen.vocab_size, seed=32)]
    prompts += make_prompts(2, 90, gen.vocab_size, seed=33)
    ro = gen.generate(prompts, max_tokens=10, seed=None, temperature=0.0)
    assert min(ro.meta["num_cached_tokens"][:3]) >= 512, ro.meta["num_cached_tokens"]
    _assert_bitwise(_trainer(nh_trainer, ro, 3), ro)
    alone = gen.generate([prompts[3]], max_tokens=10, seed=None, temperature=0.0)
    cu = ro.response_cu
    assert alone.response(0).tolist() == ro.response(3).tolist()
    assert np.array_equal(alone.rollout_logprobs, ro.rollout_logprobs[cu[3]:cu[4]])
