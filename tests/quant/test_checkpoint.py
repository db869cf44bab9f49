"""qat_check on quantized checkpoints written here from a tiny random Qwen3-MoE."""
import json

import pytest
import torch

from qmodels import tiny_qwen3_moe

from skyrl_numerics.errors import InputError
from skyrl_numerics.quant import quantize
from skyrl_numerics.quant.checkpoint import load_qtensors, qat_check, write_quantized_checkpoint


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    m = tiny_qwen3_moe().to(torch.bfloat16)
    m.save_pretrained(d)
    return d, m


@pytest.mark.parametrize("fmt,recipe", [("modelopt_nvfp4", "nvfp4"), ("ct_int4", "int4_g32")])
def test_qat_check_on_written_checkpoint(bf16_ckpt, tmp_path, fmt, recipe):
    src, model = bf16_ckpt
    names = write_quantized_checkpoint(src, tmp_path, fmt, lambda k: ".mlp.experts." in k)
    assert len(names) == 2 * 8 * 3
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" in cfg
    rep = qat_check(tmp_path)
    assert rep.ok and rep.summary()["tensors"] == 48 and all(r["recipe"] == recipe for r in rep.rows)
    assert "OK" in rep.to_text().splitlines()[0]
    # the stored codes are what the trainer's recipe gives for the same bf16 weight
    qts = load_qtensors(tmp_path)
    w = model.model.layers[1].mlp.experts.gate_up_proj[3].detach()
    gate = w.chunk(2, 0)[0]
    opts = {"convention": "modelopt"} if recipe == "nvfp4" else {}
    assert torch.equal(quantize(gate, recipe, **opts).codes, qts["model.layers.1.mlp.experts.3.gate_proj.weight"].codes)
    if recipe == "int4_g32":   # dynamic re-encoding of INT4 is not exact: +7.5 maxima saturate to 7
        assert rep.summary()["dynamic_exact"] < 48


def test_qat_check_detects_corrupted_codes(bf16_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    src, _ = bf16_ckpt
    write_quantized_checkpoint(src, tmp_path, "modelopt_nvfp4", lambda k: k.endswith("experts.0.down_proj.weight"))
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    k = "model.layers.0.mlp.experts.0.down_proj.weight_scale"
    s = t[k].view(torch.uint8).clone()
    s[0, 0] = 0x7F                                         # a NaN block scale: decodes to NaN
    t[k] = s.view(torch.float8_e4m3fn)
    save_file(t, str(f))
    rep = qat_check(tmp_path)
    bad = [r for r in rep.rows if not r["static_exact"]]
    assert not rep.ok and [r["name"] for r in bad] == ["model.layers.0.mlp.experts.0.down_proj.weight"]


def test_qat_check_errors(tmp_path, bf16_ckpt):
    with pytest.raises(InputError, match="safetensors"):
        qat_check(tmp_path)
    src, _ = bf16_ckpt
    with pytest.raises(InputError, match="no quantized weights"):
        qat_check(src)


def test_fake_quantized_checkpoint_matches_apply_qat(bf16_ckpt, tmp_path):
    from torch.nn.utils import parametrize
    from transformers import AutoModelForCausalLM

    from skyrl_numerics.quant import apply_qat
    from skyrl_numerics.quant.checkpoint import write_fake_quantized_checkpoint
    src, model = bf16_ckpt
    names = write_fake_quantized_checkpoint(src, tmp_path, "int4_g32", lambda k: ".mlp.experts." in k)
    assert len(names) == 48 and (tmp_path / "config.json").exists()
    served = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    trained = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    apply_qat(trained, [("model.layers.*.mlp.experts", "int4_g32")])
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
    with parametrize.cached():
        assert torch.equal(trained(ids).logits, served(ids).logits)
