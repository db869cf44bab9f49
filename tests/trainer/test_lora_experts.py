"""Per-expert LoRA on transformers' fused experts (fsdp.lora + hf_experts): the adapted forward
is the merged-weight forward, a token trains only the experts it was routed to, and the served
names and shapes are exactly the ones the invariant engine holds for the same plan."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qmodels import tiny_qwen3_moe
from skyrl_numerics.quant import hf_experts
from skyrl_numerics.errors import InputError
from skyrl_numerics.trainer.fsdp.lora import apply_lora, merge_lora_state_dict

TARGETS = ("*.q_proj", "model.layers.*.mlp.experts")


def _tiny64():
    """The tiny Qwen3-MoE in float64 on transformers' eager experts loop (its grouped_mm default
    has no float64)."""
    m = tiny_qwen3_moe().double()
    for mod in m.modules():
        if hasattr(mod, "config"):
            mod.config._experts_implementation = "eager"
    return m


def _randomize_adapters(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.05)


def test_start_is_the_base_model_and_only_adapters_train():
    base = _tiny64()
    model = _tiny64()
    done = apply_lora(model, rank=4, alpha=8.0, patterns=TARGETS)
    assert "model.layers.0.mlp.experts" in done and "model.layers.1.self_attn.q_proj" in done
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)       # B = 0: a no-op start
    train = {n for n, p in model.named_parameters() if p.requires_grad}
    assert train and all(".lora" in n for n in train)
    assert {n for n in train if ".experts." in n} == {
        f"model.layers.{i}.mlp.experts.lora.{p}_{ab}" for i in (0, 1) for p in ("gate", "up", "down")
        for ab in "AB"}


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), rank=st.integers(1, 6))
def test_adapted_forward_is_the_merged_weights_forward(seed, rank):
    """float64: the per-expert adapters computed beside the base equal ``W + s·B A`` merged in
    (merge_lora_state_dict), so the layout of A/B per expert and gate/up/down is the merge's."""
    model = _tiny64()
    apply_lora(model, rank=rank, alpha=2.0 * rank + 1, patterns=TARGETS)
    _randomize_adapters(model, seed)
    merged = _tiny64()
    sd = merge_lora_state_dict(dict(model.state_dict()))
    assert set(sd) == set(merged.state_dict())
    merged.load_state_dict(sd)
    ids = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a, b = model(ids).logits, merged(ids).logits
    assert (a - b).abs().max() < 1e-9 and (a - _tiny64()(ids).logits).abs().max() > 1e-4


def test_a_token_trains_only_the_experts_it_was_routed_to():
    model = _tiny64()
    apply_lora(model, rank=2, alpha=4.0, patterns=TARGETS)
    _randomize_adapters(model, 1)
    exp = model.model.layers[0].mlp.experts
    routed = {}
    exp.register_forward_hook(lambda m, args, out: routed.update(ids=args[1].clone()) and None)
    model(torch.tensor([[5]])).logits.sum().backward()
    used = set(routed["ids"].flatten().tolist())
    assert len(used) == 2
    for p in ("gate", "up", "down"):
        for ab in "AB":
            g = getattr(exp.lora, f"{p}_{ab}").grad
            for e in range(g.shape[0]):
                assert (g[e].abs().sum() > 0) == (e in used), (p, ab, e)


def test_served_names_and_shapes_are_the_engines(deepseek_v3_dir):
    """The published trainer's adapters under plain names == the invariant engine's adapter set
    for the same plan (tiny DeepSeek-V3: MLA attention, a dense layer, shared + routed experts)."""
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.invariant.numerics import NumericsPlan, plan_adapter_shapes
    from skyrl_numerics.trainer.published import plain_names, published_trainer_kwargs

    plan = NumericsPlan(formats={}, lora_rank=4, lora_alpha=8.0,
                        lora_targets=("attention", "dense", "shared", "experts"))
    hf = load_hf_model(deepseek_v3_dir, dtype="float32")
    kw = published_trainer_kwargs(plan, hf)
    apply_lora(hf, rank=kw["lora_rank"], alpha=kw["lora_alpha"], patterns=kw["lora_patterns"])
    got = {k: tuple(v.shape) for k, v in plain_names(dict(hf.state_dict())).items() if ".lora_" in k}
    want = plan_adapter_shapes(plan, json.loads((deepseek_v3_dir / "config.json").read_text()))
    assert got == {k: tuple(v) for k, v in want.items()}


def test_another_experts_layout_is_refused_naming_the_module():
    model = tiny_qwen3_moe()
    model.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(InputError, match=r"model\.layers\.1\.mlp\.experts.*standard fused experts"):
        apply_lora(model, rank=2, patterns=TARGETS)
    assert not any(".lora" in n for n, _ in model.named_parameters())
    assert "forward" not in model.model.layers[0].mlp.experts.__dict__


def test_lora_and_activation_quant_together_and_removed_in_any_order():
    from skyrl_numerics.quant import QATRule, apply_qat, remove_qat

    model = tiny_qwen3_moe()
    apply_qat(model, [QATRule("model.layers.*.mlp.experts", "nvfp4", {"convention": "vllm"},
                              act_recipe="fp8_token")])
    apply_lora(model, rank=2, patterns=TARGETS)
    exp = model.model.layers[0].mlp.experts
    assert "_act_quant" in exp.__dict__ and "lora" in exp._modules
    remove_qat(model)
    assert "forward" in exp.__dict__           # the adapters still need the loop
    hf_experts.uninstall(exp, lora=True)
    assert "forward" not in exp.__dict__


def test_a_frozen_qat_base_is_quantized_once_bitwise():
    """Under LoRA the QAT base is frozen: ``bake_frozen`` replaces its parametrizations by their
    value (quantized once) — logits bitwise those of the parametrized model, adapters still
    trained, the activation quantizers kept."""
    from torch.nn.utils import parametrize

    from skyrl_numerics.quant import QATRule, apply_qat
    from skyrl_numerics.quant.qat import bake_frozen

    rules = [QATRule("model.layers.*.mlp.experts", "nvfp4", {"convention": "vllm"},
                     act_recipe="fp8_token"),
             QATRule("model.layers.*.self_attn.q_proj", "fp8_tensor", {}, act_recipe="fp8_token")]
    a, b = tiny_qwen3_moe(), tiny_qwen3_moe()
    for m in (a, b):
        apply_qat(m, rules)
        apply_lora(m, rank=2, patterns=TARGETS)
        _randomize_adapters(m, 4)
    done = bake_frozen(b)
    assert "model.layers.0.mlp.experts.gate_up_proj" in done and \
        "model.layers.1.self_attn.q_proj.base.weight" in done
    assert not any(parametrize.is_parametrized(m) for m in b.modules())
    assert "_act_quant" in b.model.layers[0].mlp.experts.__dict__
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    assert {n for n, p in b.named_parameters() if p.requires_grad} == \
        {n for n, p in a.named_parameters() if p.requires_grad}
