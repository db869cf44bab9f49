"""apply_qat on a fused experts module with an activation format: both GEMM inputs of every
expert are fake-quantized (W4A4 / W8A8 serving quantizes the down_proj input too), checked
against transformers' own eager experts loop (identity quantizer: bitwise) and against a
reference written with ``fake_quant`` (bitwise, gradients included)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.nn.utils import parametrize

from skyrl_numerics.quant import QATRule, apply_qat, remove_qat, ste_fake_quant
from skyrl_numerics.quant.hf_experts import experts_forward, standard_experts

H, I, E = 32, 16, 6


def _experts(kind: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts as C
        cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E)
    elif kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as C
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E)
    else:   # clamped SwiGLU through the class's own _apply_gate
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts as C
        cfg = DeepseekV4Config(hidden_size=H, intermediate_size=I, n_routed_experts=E, swiglu_limit=0.5)
    cfg._experts_implementation = "eager"     # what from_config sets; transformers' own loop
    m = C(cfg).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def _batch(T: int, k: int, seed: int, dtype=torch.float32, pad: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 2).to(dtype)
    idx = torch.stack([torch.randperm(E + int(pad), generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(dtype)
    return x, idx, w


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["deepseek_v3", "qwen3_moe", "deepseek_v4"]), T=st.integers(1, 9),
       k=st.integers(1, 3), seed=st.integers(0, 2**16), bf16=st.booleans(), pad=st.booleans())
def test_identity_quant_is_transformers_eager_loop_bitwise(kind, T, k, seed, bf16, pad):
    dtype = torch.bfloat16 if bf16 else torch.float32
    m = _experts(kind, dtype)
    assert standard_experts(m)
    x, idx, w = _batch(T, k, seed, dtype, pad)       # pad: id E is the padding expert (skipped)
    with torch.no_grad():
        assert torch.equal(experts_forward(m, x, idx, w), m(x, idx, w))


def _reference(m, x, idx, w, recipe, opts):
    """out[t] = sum over experts (ascending) of w * (Q(apply_gate(Q(x) W_gu^T)) W_down^T)."""
    out = torch.zeros_like(x)
    xq = ste_fake_quant(x, recipe, **opts)
    for e in sorted(set(idx.flatten().tolist())):
        pos, tok = torch.where((idx == e).T)
        h = m._apply_gate(nn.functional.linear(xq[tok], m.gate_up_proj[e]))
        y = nn.functional.linear(ste_fake_quant(h, recipe, **opts), m.down_proj[e]) * w[tok, pos, None]
        out.index_add_(0, tok, y)
    return out


@pytest.mark.parametrize("recipe,opts", [("fp8_token", {}),
                                         ("nvfp4", {"convention": "vllm", "global_amax": 6.0}),
                                         ("mxfp8", {})])
def test_both_expert_gemm_inputs_are_quantized_and_gradients_match(recipe, opts):
    if "global_amax" in opts:
        opts = {**opts, "global_amax": torch.tensor(opts["global_amax"])}
    m, ref = _experts("qwen3_moe"), _experts("qwen3_moe")
    done = apply_qat(nn.ModuleDict({"experts": m}), [QATRule("experts", None, act_recipe=recipe,
                                                             act_opts=opts)])
    assert done == {"experts": [f"input:{recipe}"]}
    x, idx, w = _batch(7, 2, 3)
    x.requires_grad_(True)
    out = m(x, idx, w)
    xr = x.detach().clone().requires_grad_(True)
    want = _reference(ref, xr, idx, w, recipe, opts)
    assert torch.equal(out, want)
    # the down_proj input is quantized: not what quantizing only the tokens gives
    gate_up_only = _experts("qwen3_moe")
    with torch.no_grad():
        assert not torch.equal(out, gate_up_only(ste_fake_quant(x, recipe, **opts), idx, w))
    out.square().sum().backward()
    want.square().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert torch.equal(m.down_proj.grad, ref.down_proj.grad)
    assert torch.equal(m.gate_up_proj.grad, ref.gate_up_proj.grad)
    remove_qat(m)
    assert "forward" not in m.__dict__
    with torch.no_grad():
        assert torch.equal(m(x, idx, w), ref(x, idx, w))


def test_weights_and_activations_together_read_each_weight_once():
    """With weight fake-quant too, the parametrized weights are read once per call (not once
    per expert) and the result is the reference on the fake-quantized weights."""
    m, ref = _experts("deepseek_v3"), _experts("deepseek_v3")
    opts = {"convention": "vllm", "global_amax": torch.tensor(6.0)}
    apply_qat(nn.ModuleDict({"experts": m}), [QATRule("experts", "nvfp4", {"convention": "vllm"},
                                                      act_recipe="nvfp4", act_opts=opts)])
    reads = []
    p = m.parametrizations.down_proj[0]
    p.register_forward_hook(lambda *a: reads.append(1))
    x, idx, w = _batch(9, 3, 5)
    out = m(x, idx, w)
    assert len(reads) == 1
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            getattr(ref, name).copy_(getattr(m, name))
    assert torch.equal(out, _reference(ref, x, idx, w, "nvfp4", opts))


def test_other_expert_layouts_keep_the_token_hook_and_say_so():
    m = _experts("qwen3_moe")
    m.has_bias = True            # a layout _experts_forward does not reproduce
    assert not standard_experts(m)
    done = apply_qat(nn.ModuleDict({"experts": m}), [QATRule("experts", None, act_recipe="fp8_token")])
    assert done == {"experts": ["input:fp8_token (gate_up only)"]}
    assert "forward" not in m.__dict__ and hasattr(m, "_qat_act_hook")
    assert parametrize.is_parametrized(m) is False
