"""Trainer logprobs: chunking never changes a bit; agreement with a dense full-logits reference;
support replay over the whole vocabulary equals the plain path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.models import load_hf_model
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.logprobs import token_logprobs_from_hidden, trainer_logprobs


@pytest.fixture(scope="module")
def model(qwen_moe_dir):
    return load_hf_model(qwen_moe_dir)


@pytest.fixture(scope="module")
def rollout():
    rng = np.random.default_rng(1)
    lens = [7, 3, 12]
    prompts = [rng.integers(2, 512, 5).tolist() for _ in lens]
    resp = [rng.integers(2, 512, n).tolist() for n in lens]
    return Rollout.from_lists(prompts, resp, [[-1.0] * n for n in lens],
                              sampling={"temperature": 0.8})


def test_chunking_is_bitwise_neutral():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g).bfloat16()
    w = torch.randn(300, 16, generator=g).bfloat16()
    t = torch.randint(0, 300, (37,), generator=g)
    a = token_logprobs_from_hidden(h, w, t, temperature=0.7, token_chunk=1024)
    b = token_logprobs_from_hidden(h, w, t, temperature=0.7, token_chunk=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_matches_dense_model_logits(model, rollout):
    """Against the HF model's own full logits, one sequence at a time. Unpadded (batch_size=1) the
    two agree to float32 rounding; in a right-padded batch bf16 padding noise moves some tokens."""
    tl = trainer_logprobs(model, rollout, batch_size=1)
    padded = trainer_logprobs(model, rollout, batch_size=8)
    np.testing.assert_allclose(padded.logprobs, tl.logprobs, atol=3e-2)
    assert tl.logprobs.dtype == np.float32 and tl.logprobs.shape == (rollout.num_response_tokens,)
    for i in range(len(rollout)):
        ids = torch.tensor(np.concatenate([rollout.prompt(i), rollout.response(i)]))[None].long()
        with torch.no_grad():
            logits = model(ids).logits[0].float() / 0.8
        p = int(rollout.prompt_lens[i])
        logp = torch.log_softmax(logits[p - 1:-1], -1)
        ref = logp.gather(-1, torch.tensor(rollout.response(i)).long()[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        s = slice(rollout.response_cu[i], rollout.response_cu[i + 1])
        np.testing.assert_allclose(tl.logprobs[s], ref.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(tl.entropy[s], ent.numpy(), rtol=0, atol=1e-5)


def test_full_vocab_support_equals_plain(model, rollout):
    from skyrl_numerics.replay import PackedSupport

    full = PackedSupport.full(rollout.num_response_tokens, 512)
    d = {f: getattr(rollout, f) for f in rollout.__dataclass_fields__}
    with_support = Rollout(**{**d, "support": full})
    a = trainer_logprobs(model, rollout)
    b = trainer_logprobs(model, with_support, use_support=True)
    # the support path upcasts before the lm-head matmul; the plain path matmuls in bf16 like vLLM
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-2)
    np.testing.assert_allclose(b.entropy, a.entropy, atol=2e-2)


def test_support_missing_is_an_error(model, rollout):
    with pytest.raises(InputError, match="support"):
        trainer_logprobs(model, rollout, use_support=True)
