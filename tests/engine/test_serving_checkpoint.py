"""The fake-quant serving checkpoint holds exactly the grid that apply_qat reproduces."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from skyrl_numerics.models import build_tiny_model, load_hf_model
from skyrl_numerics.quant import apply_qat, fake_quant
from skyrl_numerics.engine.serving_checkpoint import cached_fake_quant_checkpoint, qat_rules


@pytest.mark.parametrize("recipe", ["nvfp4", "int4_g32"])
def test_served_experts_equal_qat_weights_bitwise(tmp_path, recipe):
    src = build_tiny_model("qwen3_moe", cache_dir=tmp_path, num_hidden_layers=1)
    out = cached_fake_quant_checkpoint(src, recipe)
    assert cached_fake_quant_checkpoint(src, recipe) == out  # cached
    served = load_file(str(out / "model.safetensors"))
    orig = load_file(str(src / "model.safetensors"))
    qat = load_hf_model(src)
    apply_qat(qat, qat_rules(recipe))
    experts = qat.model.layers[0].mlp.experts
    E = experts.down_proj.shape[0]
    inter = experts.down_proj.shape[2]
    n_changed = 0
    for e in range(E):
        gate_up = experts.gate_up_proj[e]  # parametrized read: the fake-quantized weight
        for name, w in (("gate_proj", gate_up[:inter]), ("up_proj", gate_up[inter:]),
                        ("down_proj", experts.down_proj[e])):
            key = f"model.layers.0.mlp.experts.{e}.{name}.weight"
            assert torch.equal(served[key], w.detach()), key
            assert torch.equal(served[key], fake_quant(orig[key], recipe)), key
            n_changed += int(not torch.equal(served[key], orig[key]))
    assert n_changed == 3 * E  # every expert matrix moved onto the grid
    # everything that is not an expert weight is untouched
    for key, v in orig.items():
        if ".experts." not in key:
            assert torch.equal(served[key], v), key
