"""Indexer replay in the trainer's DSA forward (replay/index_replay.py) without an engine: the
tiny DeepSeek-V3.2 (index_topk 16 < the sequences) records its own choices; replaying them is
bitwise its own forward, and a trainer whose indexer disagrees computes other logprobs until it
replays them. The engine side: tests/e2e/test_deepseek_v32_vllm.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs


@pytest.fixture(scope="module")
def v32_dir():
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model("deepseek_v32")


def test_replay_restores_the_recorded_forward_under_a_disagreeing_indexer(v32_dir):
    ref = from_checkpoint(v32_dir)
    V = int(ref.w("lm_head.weight").shape[0])
    prompts = make_prompts(2, 26, V, seed=1) + make_prompts(1, 6, V, seed=2)
    responses = make_prompts(3, 5, V, seed=3)
    ro = Rollout.from_lists(prompts, responses, [[0.0] * 5] * 3)
    with pytest.raises(InputError, match="capture_index"):
        invariant_trainer_logprobs(ref, ro, use_index=True)
    base = invariant_trainer_logprobs(ref, ro, batch_size=2, return_index=True)
    assert base.index.rows.num_tokens == 2 * (26 + 5 - 1 - 16)   # the short row stores none
    ro.index = base.index
    ro.validate()
    same = invariant_trainer_logprobs(ref, ro, batch_size=3, use_index=True, compare_index=True,
                                      return_index=True)
    assert np.array_equal(same.logprobs, base.logprobs) and same.index == base.index
    assert same.index_mismatch["differ"] == 0 and same.index_mismatch["rows"] > 0

    off = from_checkpoint(v32_dir)
    for i in range(off.dims.layers):
        w = off.w(f"model.layers.{i}.self_attn.indexer.wk.weight")
        g = torch.Generator().manual_seed(i)
        w.copy_(w + (torch.randn(w.shape, generator=g) * 2 * w.float().std()).to(w.dtype))
    own = invariant_trainer_logprobs(off, ro, batch_size=2, compare_index=True,
                                     return_index=True)
    assert own.index != base.index and own.index_mismatch["differ"] > 0
    assert not np.array_equal(own.logprobs, base.logprobs)
    rep = invariant_trainer_logprobs(off, ro, batch_size=2, use_index=True, return_index=True)
    assert rep.index == base.index and np.array_equal(rep.logprobs, base.logprobs)
