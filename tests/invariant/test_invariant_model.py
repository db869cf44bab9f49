"""The shared batch-invariant Qwen3-MoE forward: invariance properties without vLLM.

(The bitwise comparison against the real vLLM engine is in tests/e2e/test_batch_invariant_vllm.py.)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.models import load_hf_model
from skyrl_numerics.invariant.qwen3_moe import InvariantQwen3Moe, attend_one_sequence

pytestmark = pytest.mark.isa   # also run under each lower CPU capability (tests/test_isa_matrix.py)


@pytest.fixture(scope="module")
def model(qwen_moe_dir):
    return InvariantQwen3Moe.from_checkpoint(qwen_moe_dir)


def _ids(n, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(2, 512, n))


def test_prefill_then_decode_equals_full_prefill(model):
    ids = _ids(37, 0)
    cache = {}

    def attend(i, q, rows):
        cache[i] = torch.cat([cache.get(i, rows[:0]), rows])
        return model.attn_core(i, q[None], cache[i][None], None)[0]

    with torch.no_grad():
        full = model.sequence_hidden(ids)
        parts = [model.forward_tokens(ids[:20], torch.arange(20), attend)]
        parts += [model.forward_tokens(ids[t:t + 1], torch.tensor([t]), attend)
                  for t in range(20, 37)]
    assert torch.equal(torch.cat(parts), full)


def test_attend_one_sequence_is_the_family_attention(model):
    """The K/V helper kept for callers computes what ``attn_core`` computes on the cache row."""
    g = torch.Generator().manual_seed(0)
    d = model.attn_dims       # (heads, kv_heads, head_dim: the shared GQA attention's, gqa.py)
    q = torch.randn(9, d.heads, d.head_dim, generator=g).bfloat16()
    k = torch.randn(9, d.kv_heads, d.head_dim, generator=g).bfloat16()
    v = torch.randn(9, d.kv_heads, d.head_dim, generator=g).bfloat16()
    rows = torch.cat([k.reshape(9, -1), v.reshape(9, -1)], -1)
    assert torch.equal(attend_one_sequence(q, k, v, model.scale),
                       model.attn_core(0, q[None], rows[None], None)[0])


def test_packed_batch_equals_each_sequence_alone(model):
    seqs = [_ids(n, s) for s, n in enumerate([5, 23, 1, 40])]
    with torch.no_grad():
        packed = model.packed_hidden(seqs)
        alone = torch.cat([model.sequence_hidden(s) for s in seqs])
        reordered = model.packed_hidden(seqs[::-1])
    assert torch.equal(packed, alone)
    lens = [len(s) for s in seqs]
    back = torch.split(reordered, lens[::-1])[::-1]
    assert torch.equal(torch.cat(back), packed)


def test_close_to_hf_transformers(model, qwen_moe_dir):
    """Same weights, other kernels: logits agree to bf16 precision, not bitwise."""
    hf = load_hf_model(qwen_moe_dir)
    ids = _ids(30, 3)
    with torch.no_grad():
        ours = model.logits(model.sequence_hidden(ids)).float()
        ref = hf(ids[None]).logits[0].float()
    per_pos = (ours - ref).abs().amax(-1)
    # bf16-level everywhere except where a near-tie router picks another expert (R3's job)
    assert 0 < per_pos.median().item() < 0.05, per_pos
    assert per_pos.max().item() < 1.0, per_pos
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_unknown_weight_is_an_error(model):
    with pytest.raises(InputError, match="unexpected weight"):
        model.load_named([("model.layers.9.mlp.gate.weight", torch.zeros(1))])
