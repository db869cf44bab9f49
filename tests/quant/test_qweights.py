"""A model run from a quantized checkpoint (codes + scales in memory, dequantized on the fly)
equals the source model with fake-quantized weights, bitwise; adapters train on top."""
import pytest
import torch
from torch.nn.utils import parametrize

from qmodels import fake_quant_experts_, tiny_qwen3_moe
from skyrl_numerics.quant import fake_quant
from skyrl_numerics.quant.checkpoint import write_quantized_checkpoint
from skyrl_numerics.quant.qweights import load_quantized_weights


@pytest.mark.slow
@pytest.mark.parametrize("fmt,recipe,opts", [("ct_int4", "int4_g32", {}),
                                             ("modelopt_nvfp4", "nvfp4", {"convention": "modelopt"}),
                                             ("ct_nvfp4", "nvfp4", {"convention": "compressed_tensors"})])
def test_run_from_quantized_checkpoint(tmp_path, fmt, recipe, opts):
    src = tiny_qwen3_moe().to(torch.bfloat16)
    src.save_pretrained(tmp_path / "bf16")
    pick = lambda k: ".mlp.experts." in k or k.endswith("self_attn.q_proj.weight")  # noqa: E731
    write_quantized_checkpoint(tmp_path / "bf16", tmp_path / "q", fmt, pick)

    ref = tiny_qwen3_moe().to(torch.bfloat16)
    ref.load_state_dict(src.state_dict())
    fake_quant_experts_(ref, recipe, **opts)
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if name.endswith("self_attn.q_proj"):
                mod.weight.copy_(fake_quant(mod.weight, recipe, **opts))

    model = tiny_qwen3_moe(seed=123).to(torch.bfloat16)          # different random init
    rep = load_quantized_weights(model, tmp_path / "q")
    assert len(rep["quantized"]) == 2 * 2 + 2 and rep["unused"] == []
    experts = model.model.layers[0].mlp.experts
    assert experts.parametrizations.gate_up_proj.original.numel() == 0   # no full-precision copy
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
    with parametrize.cached():
        out = model(ids).logits
    assert torch.equal(out, ref(ids).logits)

    # a LoRA-style adapter on q_proj trains; the quantized base has nothing to train
    q_proj = model.model.layers[0].self_attn.q_proj
    A = torch.nn.Parameter(torch.randn(4, 128, dtype=torch.bfloat16) * 0.01)
    B = torch.nn.Parameter(torch.zeros(128, 4, dtype=torch.bfloat16))
    h = q_proj.register_forward_hook(lambda m, a, o: o + a[0] @ A.t() @ B.t())
    model(ids).logits.float().pow(2).mean().backward()
    h.remove()
    assert B.grad is not None and B.grad.abs().sum() > 0
    assert not any(p.requires_grad for n, p in q_proj.named_parameters() if "original" in n)


def test_run_from_fused_3d_expert_checkpoint(tmp_path):
    """Experts stored fused (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and quantized per
    expert matrix load as stacked codes + scales; the model equals the source with each expert
    matrix fake-quantized on its own, bitwise."""
    from safetensors.torch import save_file
    src = tiny_qwen3_moe().to(torch.bfloat16)
    (tmp_path / "bf16").mkdir()
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "bf16" / "model.safetensors"))
    src.config.to_json_file(str(tmp_path / "bf16" / "config.json"))
    opts = {"convention": "compressed_tensors"}
    names = write_quantized_checkpoint(tmp_path / "bf16", tmp_path / "q", "ct_nvfp4", lambda k: ".mlp.experts." in k)
    assert len(names) == 4
    with torch.no_grad():
        for name, mod in src.named_modules():
            if name.endswith("mlp.experts"):
                for pname in ("gate_up_proj", "down_proj"):
                    p = getattr(mod, pname)
                    for e in range(p.shape[0]):
                        p[e] = fake_quant(p[e], "nvfp4", **opts)

    model = tiny_qwen3_moe(seed=123).to(torch.bfloat16)
    rep = load_quantized_weights(model, tmp_path / "q")
    assert sorted(rep["quantized"]) == names and rep["unused"] == []
    experts = model.model.layers[1].mlp.experts
    assert experts.parametrizations.down_proj.original.numel() == 0       # codes + scales only
    assert experts.parametrizations.down_proj[0].pieces[0].codes.dtype == torch.uint8
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
    with parametrize.cached():
        out = model(ids).logits
    assert torch.equal(out, src(ids).logits)
