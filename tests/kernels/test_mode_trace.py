"""batch_invariant_mode() on unmodified HF models of every supported family (Qwen3-MoE,
DeepSeek-V3, Mixtral, a dense Llama), as a user's trainer runs them: right-padded batches.

* The trace: every aten op the forward and backward reach (a ``TorchDispatchMode``) is either
  one the mode overrides or one of ``STOCK`` — the ops ``kernels/mode.py``'s docstring says are
  exact or per element with the same bits in the vector body and the tail (that property is
  tested per op in ``test_cpu_isa.py``). A new op (another transformers release, another
  family) fails here until it is routed or shown to be safe.
* Each of 7 sequences alone and inside a right-padded batch of all 7: the same logprob bits and
  the same input-embedding gradient bits (fp32 and bf16; SDPA and eager attention).
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from skyrl_numerics.kernels import batch_invariant_mode, mode

pytestmark = [pytest.mark.isa, pytest.mark.slow]

STOCK = {
    # exact or order-free
    "_local_scalar_dense", "_to_copy", "_unsafe_view", "alias", "arange", "as_strided", "bitwise_and.Tensor",
    "bitwise_not", "cat", "clone", "copy_", "detach", "embedding", "empty_like", "eq.Scalar", "expand",
    "floor_divide", "gather", "histc", "index.Tensor", "index_put", "index_put_", "le.Tensor", "lift_fresh",
    "masked_fill.Scalar", "new_empty", "new_empty_strided", "new_ones", "new_zeros", "ones_like",
    "scalar_tensor", "scatter.src", "scatter_.value", "scatter_add", "slice.Tensor", "slice_backward",
    "sort", "split.Tensor", "split_with_sizes", "squeeze.dim", "t", "topk", "transpose.int", "unsqueeze",
    "view", "where.self", "zeros", "zeros_like", "cumsum", "select.int", "select_backward", "permute",
    "amax", "max", "neg", "fill_.Scalar", "masked_fill_.Scalar", "sub.Tensor", "add.Tensor", "add_.Tensor",
    "mul.Tensor", "mul.Scalar", "mul_.Tensor", "div.Tensor", "div.Scalar", "div_.Tensor",
    # per element, vector body = scalar tail (test_cpu_isa.py)
    "cos", "sin", "exp", "log", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "tanh", "tanh_backward",
    # parameter gradients: sums over tokens (agree to rounding across micro-batches; not per row)
    "embedding_dense_backward",
    # SDPA's math path for MLA's unequal head sizes: _softmax inside (overridden)
    "_safe_softmax",
}

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "llama")
LENS = [9, 13, 5, 11, 7, 15, 3]


def _model(family: str, dtype: torch.dtype, attn: str):
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        m = LlamaForCausalLM(cfg)
    else:
        from skyrl_numerics.models import build_tiny_model, load_hf_model

        m = load_hf_model(build_tiny_model(family), dtype="float32")
    m = m.to(dtype)
    m.config._attn_implementation = attn
    return m.train()


class _Trace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        self.ops[name if func._overloadname == "default" else f"{name}.{func._overloadname}"] += 1
        return func(*args, **(kwargs or {}))


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 500, (len(LENS), max(LENS)), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENS):
        mask[i, :n] = 1
    return ids, mask


def _logprobs_and_grads(m, ids, mask):
    """Per-token logprobs of the next token and d(sum of real logprobs)/d(input embeddings)."""
    emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = m(inputs_embeds=emb, attention_mask=mask).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = lp * mask[:, 1:]
    lp.sum().backward()
    return lp.detach(), emb.grad


@pytest.mark.parametrize("family", FAMILIES)
def test_every_op_reached_is_overridden_or_known_stock(family):
    claimed = set(mode.registered_ops("cpu"))
    seen = set()
    for dtype in (torch.float32, torch.bfloat16):
        for attn in ("sdpa", "eager"):
            m = _model(family, dtype, attn)
            ids, mask = _batch()
            with batch_invariant_mode(), _Trace() as t:
                _logprobs_and_grads(m, ids[:3], mask[:3])
            seen |= set(t.ops)
    assert seen - claimed - STOCK == set()
    assert "mm" in seen and "_log_softmax" in seen     # (the trace does see the mode's ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_of_a_right_padded_batch_equal_each_sequence_alone(family, attn, dtype):
    m = _model(family, dtype, attn)
    ids, mask = _batch()
    with batch_invariant_mode():
        lp, grad = _logprobs_and_grads(m, ids, mask)
        for i, n in enumerate(LENS):
            lp1, grad1 = _logprobs_and_grads(m, ids[i:i + 1, :n], mask[i:i + 1, :n])
            assert torch.equal(lp[i, :n - 1], lp1[0]), f"sequence {i}: logprobs"
            assert torch.equal(grad[i, :n], grad1[0]), f"sequence {i}: input-embedding gradient"
    assert lp.abs().sum() > 0 and grad.abs().sum() > 0
