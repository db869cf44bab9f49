"""Quantized serving numerics + LoRA in the invariant forward (invariant/numerics.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant import numerics as N

pytestmark = pytest.mark.isa

W4A4 = {"experts": {"weight": "nvfp4", "act": "nvfp4"},
        "attention": {"weight": "fp8_channel", "act": "fp8_token"}}
DS_EXTRA = {"shared": {"weight": "fp8_tensor_weight", "act": "fp8_token"},
            "dense": {"weight": "fp8_block", "act": "mxfp8"}}


def _plan(family, lora=True, **kw):
    ds = family == "deepseek_v3"
    formats = {**W4A4, **(DS_EXTRA if ds else {})}
    targets = ("attention", "experts") + (("shared", "dense") if ds else ())
    return N.NumericsPlan(formats=formats, lora_rank=8 if lora else 0, lora_alpha=16,
                          lora_targets=targets if lora else (), **kw)


def _dir(family, request):
    return request.getfixturevalue("qwen_moe_dir" if family == "qwen3_moe" else "deepseek_v3_dir")


def _seqs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 512, (n,), generator=g) for n in (5, 9, 3)]


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), k=st.sampled_from([32, 64, 96, 128, 256]),
       seed=st.integers(0, 2**31 - 1),
       act=st.sampled_from(["fp8_token", "fp8_tensor", "nvfp4", "nvfp4_global", "mxfp8", "fp8_group"]),
       mag=st.floats(1e-3, 1e3))
def test_activation_formats_are_row_local(rows, k, seed, act, mag):
    """A token's quantized activation is computed from its own row: the same bits alone and in
    any batch (what makes W4A4 / W8A8 batch-invariant)."""
    from hypothesis import assume

    assume(act != "fp8_group" or k % 128 == 0)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * mag).to(torch.bfloat16)
    f = N.LinearFormat(act="nvfp4" if act == "nvfp4_global" else act,
                       act_scale=0.05 if act == "fp8_tensor" else None,
                       act_global=0.0123 if act == "nvfp4_global" else None)
    whole = N.quantize_activation(x, f)
    for i in range(rows):
        assert torch.equal(whole[i:i + 1], N.quantize_activation(x[i:i + 1], f)), (act, i)
    assert whole.dtype == x.dtype and not torch.equal(whole, x)   # it did round
    # and it is the recipe's reference, dequantize(quantize(x)), with the format's options
    from skyrl_numerics.quant import dequantize, quantize

    opts = {"fp8_token": ("fp8_token", {}),
            "fp8_tensor": ("fp8_tensor", {"scale": torch.tensor(0.05)}),
            "nvfp4": ("nvfp4", {"convention": "vllm", "global_amax": torch.tensor(2688.0)}),
            "nvfp4_global": ("nvfp4", {"convention": "vllm", "global_scale": torch.tensor(0.0123)}),
            "fp8_group": ("fp8_block", {"block": (1, 128)}),
            "mxfp8": ("mxfp8", {})}[act]
    assert torch.equal(whole, dequantize(quantize(x, opts[0], **opts[1]), x.dtype))


def test_projection_is_the_formula():
    """``Projection(x)`` = linear(A(x), D(Q(W))) + s·linear(linear(x, A_l), B_l), from the quant
    API's own quantize / fake_quant (not from the projection's code path)."""
    from skyrl_numerics.quant import dequantize, fake_quant, quantize
    from skyrl_numerics.invariant.blocks import linear

    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(32, 64, generator=g) * 0.1).to(torch.bfloat16)
    a = (torch.randn(4, 64, generator=g) * 0.1).to(torch.bfloat16)
    b = (torch.randn(32, 4, generator=g) * 0.1).to(torch.bfloat16)

    packed = quantize(w, "nvfp4", convention="modelopt")

    class M:
        dtype = torch.bfloat16

        def served_weight(self, name):
            return dequantize(packed, torch.bfloat16)

        def w(self, name):
            return {"A": a, "B": b}[name]

    f = N.LinearFormat(weight="nvfp4", act="nvfp4", act_amax=20.0)
    y = N.Projection(M(), "w", f, ("A", "B"), 2.0)(x)
    xq = fake_quant(x, "nvfp4", convention="vllm", global_amax=torch.tensor(20.0))
    base = linear(xq, dequantize(quantize(w, "nvfp4", convention="modelopt"), torch.bfloat16))
    want = (base.float() + 2.0 * linear(linear(x, a), b).float()).to(torch.bfloat16)
    assert torch.equal(y, want)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_planned_forward_is_batch_invariant_and_grad_equal(family, request):
    d = _dir(family, request)
    m = from_checkpoint(d, numerics=_plan(family))
    base = from_checkpoint(d)
    g = torch.Generator().manual_seed(2)
    for n in m.adapter_names():        # non-zero adapters: the LoRA branch counts
        if n.endswith("lora_B.weight"):
            m.w(n).copy_((torch.randn(m.w(n).shape, generator=g) * 0.05).to(m.dtype))
    seqs = _seqs()
    with torch.no_grad():
        alone = m.sequence_hidden(seqs[1])
        packed = m.packed_hidden(seqs)
        assert torch.equal(alone, packed[5:14])
        assert not torch.equal(alone, base.sequence_hidden(seqs[1]))   # the plan changes numbers
    for n in m.adapter_names():
        m.w(n).requires_grad_(True)
    with torch.enable_grad():
        h = m.sequence_hidden(seqs[1])
        h.float().pow(2).mean().backward()
    assert torch.equal(h.detach(), alone)          # the training forward has the engine's bits
    got = [n for n in m.adapter_names() if m.w(n).grad is not None and m.w(n).grad.abs().sum() > 0]
    assert any("lora_A" in n for n in got) and any("experts" in n for n in got)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_packed_base_and_qat_base_compute_the_same(family, request):
    """Without adapters the trainer keeps bf16 weights and fake-quantizes them per call; an
    engine packs them (codes + scales). Same Q on the same values: the same bits — and the
    packed model holds no bf16 copy of a quantized weight."""
    d = _dir(family, request)
    plan = _plan(family, lora=False)
    qat = from_checkpoint(d, numerics=plan)                     # trainer: bf16 + fake-quant
    from transformers import AutoConfig

    packed = type(qat).from_config(AutoConfig.from_pretrained(str(d)), numerics=plan, pack=True)
    from skyrl_numerics.invariant.base import iter_checkpoint_tensors

    packed.load_named(iter_checkpoint_tensors(d))
    assert packed._packed and all(packed._names[n] not in packed.params for n in packed._packed)
    pbytes = sum(p.numel() * p.element_size() for p in packed.parameters())
    qbytes = sum(p.numel() * p.element_size() for p in qat.parameters())
    assert pbytes < 0.6 * qbytes
    with torch.no_grad():
        for s in _seqs():
            assert torch.equal(qat.sequence_hidden(s), packed.sequence_hidden(s))


def test_zero_adapters_leave_the_base_untouched(qwen_moe_dir):
    plan = N.NumericsPlan(lora_rank=4, lora_alpha=8, lora_targets=("attention", "experts"))
    m, base = from_checkpoint(qwen_moe_dir, numerics=plan), from_checkpoint(qwen_moe_dir)
    with torch.no_grad():
        for s in _seqs():
            assert torch.equal(m.sequence_hidden(s), base.sequence_hidden(s))
    # the same plan starts with the same adapters on every side (seeded by name)
    again = from_checkpoint(qwen_moe_dir, numerics=plan)
    assert all(torch.equal(m.w(n), again.w(n)) for n in m.adapter_names())
    assert any(m.w(n).abs().sum() > 0 for n in m.adapter_names() if "lora_A" in n)


def test_a_failed_update_keeps_the_adapters(qwen_moe_dir):
    m = from_checkpoint(qwen_moe_dir, numerics=N.NumericsPlan(lora_rank=4, lora_targets=("attention",)))
    names = m.adapter_names()
    before = {n: m.w(n).clone() for n in names}
    good = {n: torch.ones_like(before[n]) for n in names[:2]}
    bad_shape = {**good, names[2]: torch.ones(5, 5, dtype=torch.bfloat16)}
    with pytest.raises(InputError, match="adapter rank differs"):
        m.load_named(bad_shape.items())
    nan = {**good, names[3]: torch.full_like(before[names[3]], float("nan"))}
    with pytest.raises(InputError, match="non-finite"):
        m.load_named(nan.items())
    with pytest.raises(InputError, match="plan does not have"):
        m.load_named([*good.items(), ("model.layers.0.mlp.experts.0.up_proj.lora_A.weight",
                                      torch.ones(4, 128))])
    assert all(torch.equal(m.w(n), before[n]) for n in names)
    m.load_named(good.items())
    assert torch.equal(m.w(names[0]), good[names[0]])


@pytest.mark.parametrize("bad, field", [
    (dict(formats={"attention": {"act": "fp8_tensor"}}), "attention.act_scale"),
    (dict(formats={"mlp": {"weight": "nvfp4"}}), "formats"),
    (dict(formats={"experts": {"weight": "int3"}}), "experts.weight"),
    (dict(formats={"experts": {"act": "fp4"}}), "experts.act"),
    (dict(lora_rank=8), "lora_targets"),
    (dict(lora_rank=8, lora_targets=("router",)), "lora_targets"),
    (dict(lora_rank=-1), "lora_rank"),
    (dict(lora_rank=4, lora_targets=("attention",), lora_alpha=float("inf")), "lora_alpha"),
])
def test_bad_plans_are_refused(bad, field):
    with pytest.raises(InputError) as e:
        N.NumericsPlan(**bad)
    assert field in str(e.value)


def test_format_names_mean_what_the_quant_recipes_of_that_name_mean():
    """A plan format named like a quant recipe is that recipe (weights and activations); the
    per-tensor FP8 weight format is not quant's fp8_tensor (vLLM's activation quantizer, x * fl(1/s))
    and has a name of its own."""
    from skyrl_numerics.quant import RECIPES

    for name, (recipe, _) in N.WEIGHT_FORMATS.items():
        assert name not in RECIPES or recipe == name, name
    for name, recipe in N.ACT_RECIPES.items():
        assert name not in RECIPES or recipe == name, name
    assert N.WEIGHT_FORMATS["fp8_tensor_weight"] == ("fp8_channel", {"block": (-1, -1)})
    assert not set(N.RENAMED_WEIGHT_FORMATS) & set(N.WEIGHT_FORMATS)


def test_the_old_weight_format_name_is_refused_naming_the_new_one():
    with pytest.raises(InputError) as e:
        N.NumericsPlan(formats={"attention": {"weight": "fp8_tensor", "act": "fp8_token"}})
    assert e.value.field == "attention.weight" and "'fp8_tensor_weight'" in str(e.value)
    from skyrl_numerics.trainer.seed_recipes import get_recipe

    with pytest.raises(InputError, match="fp8_tensor_weight") as e:
        get_recipe("ml4", ["shared=fp8_tensor/fp8_token"])
    assert e.value.field == "shared.weight"


def test_plans_that_do_not_fit_the_model_are_refused(qwen_moe_dir):
    import json

    cfg = json.loads((qwen_moe_dir / "config.json").read_text())
    with pytest.raises(InputError, match="no 'dense' linears"):
        N.check_plan_for_config(N.NumericsPlan(formats={"dense": {"weight": "fp8_block"}}), cfg)
    with pytest.raises(InputError, match="LoRA target 'shared'"):
        N.check_plan_for_config(N.NumericsPlan(lora_rank=2, lora_targets=("shared",)), cfg)
    odd = {**cfg, "moe_intermediate_size": 72}     # down_proj input 72: not a multiple of 32
    with pytest.raises(InputError, match=r"down_proj.weight: int4_g32 weights need .* multiple of 32"):
        N.check_plan_for_config(N.NumericsPlan(formats={"experts": {"weight": "int4_g32"}}), odd)
    N.check_plan_for_config(_plan("qwen3_moe"), cfg)        # fits


def test_plan_json_round_trip():
    p = _plan("deepseek_v3")
    assert N.NumericsPlan.from_json(p.to_json()) == p
    assert N.NumericsPlan.from_json(None) is None
