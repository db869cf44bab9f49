"""STE gradients and apply_qat on a tiny random Qwen3-MoE (fused 3-D expert parameters)."""
import pytest
import torch
from torch.nn.utils import parametrize

from skyrl_numerics.errors import InputError
from qmodels import fake_quant_experts_, tiny_qwen3_moe

from skyrl_numerics.quant import QATRule, apply_qat, fake_quant, quantize, remove_qat, ste_fake_quant
from skyrl_numerics.quant.ste import representable_range


def test_plain_ste_is_identity_gradient():
    x = torch.randn(4, 64, requires_grad=True)
    g = torch.randn(4, 64)
    y = ste_fake_quant(x, "nvfp4", convention="te")
    assert torch.equal(y, fake_quant(x.detach(), "nvfp4", convention="te"))
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_clipped_ste_zeroes_saturated_elements():
    x = torch.tensor([[1.0, -2.0, 500.0, -900.0, 448.0]], requires_grad=True)
    y = ste_fake_quant(x, "fp8_tensor", clip=True, scale=1.0)     # representable range [-448, 448]
    y.sum().backward()
    assert x.grad.tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0]]
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 7.5, -7.5                                    # int4: s = 1, hi = 7, lo = -8
    w.requires_grad_(True)
    ste_fake_quant(w, "int4_g32", clip=True).sum().backward()
    assert w.grad[0, :2].tolist() == [0.0, 1.0]
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 7.0, -7.0, 3.0                     # kimi: s = 1, hi = 7, lo = -7
    w.requires_grad_(True)
    ste_fake_quant(w, "int4_g32_kimi", clip=True).sum().backward()
    assert w.grad[0, :3].tolist() == [1.0, 1.0, 1.0]
    lo, hi = representable_range(quantize(w.detach(), "int4_g32_kimi"))
    assert (float(lo[0, 0]), float(hi[0, 0])) == (-7.0, 7.0)
    static = quantize(w.detach(), "int4_g32_kimi", scale=torch.tensor([[0.5]]))
    assert static.codes[0, :3].tolist() == [7, -7, 6]             # static scales saturate at -7


RULES = [
    QATRule("model.layers.*.mlp.experts", "nvfp4", {"convention": "te"}),
    {"pattern": "model.layers.*.self_attn.*_proj", "recipe": "fp8_block", "opts": {"block": (128, 128)},
     "act_recipe": "fp8_block"},
]


def _manual_copy(model):
    """Reference: the same model with fake-quantized weights written in and activations quantized
    by explicit hooks — what apply_qat must reproduce bit for bit."""
    ref = tiny_qwen3_moe()
    ref.load_state_dict(model.state_dict())
    fake_quant_experts_(ref, "nvfp4", convention="te")
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if name.endswith("_proj") and ".self_attn." in name:
                mod.weight.copy_(fake_quant(mod.weight, "fp8_block", block=(128, 128)))
                mod.register_forward_pre_hook(lambda m, a: (ste_fake_quant(a[0], "fp8_block"),))
    return ref


@pytest.mark.slow
def test_apply_qat_matches_manual_fake_quant_bitwise_and_trains():
    model = tiny_qwen3_moe()
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    assert m.Qwen3MoeExperts is not None and model.model.layers[0].mlp.experts.gate_up_proj.dim() == 3
    ref = _manual_copy(model)
    done = apply_qat(model, RULES)
    assert sorted(done["model.layers.0.mlp.experts"]) == ["down_proj:nvfp4", "gate_up_proj:nvfp4"]
    assert done["model.layers.1.self_attn.q_proj"] == ["weight:fp8_block", "input:fp8_block"]
    assert len(done) == 2 * (1 + 4)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with parametrize.cached():
        out = model(ids).logits
    ref_out = ref(ids).logits
    assert torch.equal(out, ref_out)
    # gradients reach the full-precision originals (plain STE): equal to the reference's grads
    with parametrize.cached():
        model(ids).logits.float().pow(2).mean().backward()
    ref(ids).logits.float().pow(2).mean().backward()
    orig = model.model.layers[0].mlp.experts.parametrizations.gate_up_proj.original
    assert torch.equal(orig.grad, ref.model.layers[0].mlp.experts.gate_up_proj.grad)
    assert torch.equal(model.model.layers[1].self_attn.o_proj.parametrizations.weight.original.grad,
                       ref.model.layers[1].self_attn.o_proj.weight.grad)
    # one optimizer step moves the originals; remove_qat restores plain parameters and keys
    keys = set(tiny_qwen3_moe().state_dict())
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    remove_qat(model)
    assert set(model.state_dict()) == keys
    assert not parametrize.is_parametrized(model.model.layers[0].mlp.experts)


def test_apply_qat_rule_errors():
    model = tiny_qwen3_moe()
    with pytest.raises(InputError, match="matched no"):
        apply_qat(model, [("model.layers.*.mlp.expert", "nvfp4")])
    with pytest.raises(InputError, match="unknown recipe"):
        apply_qat(model, [("*", "fp5")])
    with pytest.raises(InputError, match="no option"):
        apply_qat(model, [{"pattern": "*", "recipe": "mxfp4", "opts": {"elem": "e4m3fn"}}])


def test_remove_qat_bake_keeps_quantized_weights():
    model = tiny_qwen3_moe()
    w = model.lm_head.weight.detach().clone()
    apply_qat(model, [("lm_head", "int4_g32")])
    remove_qat(model, bake=True)
    assert torch.equal(model.lm_head.weight, fake_quant(w, "int4_g32"))
