"""Checkpoints written by compressed-tensors itself (its qparam calculation and ``ModelCompressor``,
on CPU), checked with ``qat_check_base``: INT4 ``pack-quantized`` g32 and ``nvfp4-pack-quantized``
on the attention projections of a tiny bf16 Qwen3-MoE. Statistics are taken on the bf16 weights,
as llm-compressor's observers do (so the NVFP4 global ``2688 / amax`` is rounded in bf16)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qmodels import tiny_qwen3_moe

from skyrl_numerics.cli import main
from skyrl_numerics.quant.vendor_check import qat_check_base

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.filterwarnings("ignore")
TARGET = r"re:.*self_attn\.[qkvo]_proj$"


def _ct_write(fmt: str, out, seed: int = 0):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    m = tiny_qwen3_moe(seed).to(torch.bfloat16)
    if fmt == "int4":
        args, cfmt = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32), \
            "pack-quantized"
    else:
        args, cfmt = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                                      group_size=16, scale_dtype=torch.float8_e4m3fn), "nvfp4-pack-quantized"
    apply_quantization_config(m, QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=[TARGET], weights=args)}))
    for _, mod in m.named_modules():
        if not hasattr(mod, "weight_scale"):
            continue
        w = mod.weight.data
        g = w.reshape(w.shape[0], -1, args.group_size)
        G = None
        if fmt == "nvfp4":
            G = generate_gparam(w.amin(), w.amax())
            mod.weight_global_scale.data.copy_(G)
        s, zp = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=G)
        mod.weight_scale.data.copy_(s.to(mod.weight_scale.dtype))
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data.copy_(zp.to(mod.weight_zero_point.dtype))
    comp = ModelCompressor.from_pretrained_model(m, quantization_format=cfmt)
    comp.compress_model(m)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(out / "model.safetensors"))
    m.config.to_json_file(str(out / "config.json"))
    comp.update_config(str(out))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    tiny_qwen3_moe(0).to(torch.bfloat16).save_pretrained(root / "base")
    tiny_qwen3_moe(1).to(torch.bfloat16).save_pretrained(root / "seed1")
    return {"base": root / "base", "seed1": root / "seed1",
            "int4": _ct_write("int4", root / "int4"), "nvfp4": _ct_write("nvfp4", root / "nvfp4")}


@pytest.mark.parametrize("fmt,kind", [("int4", "ct_int4"), ("nvfp4", "ct_nvfp4")])
def test_vendor_checkpoint_passes(ckpts, fmt, kind, capsys):
    qc = json.loads((ckpts[fmt] / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    rep = qat_check_base(ckpts[fmt], ckpts["base"])
    assert rep.ok and rep.scheme == kind and len(rep.rows) == 8, rep.to_text()
    if fmt == "nvfp4":
        assert rep.observer_dtype == "bfloat16"
    assert main(["qat-check", str(ckpts[fmt]), "--base", str(ckpts["base"])]) == 0
    assert "OK, 8 of 8 tensors exact" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_vendor_checkpoint_edit_and_other_seed_fail(ckpts, tmp_path, fmt):
    rep = qat_check_base(ckpts[fmt], ckpts["seed1"])
    assert not rep.ok and rep.summary()["exact"] == 0
    d = tmp_path / "q"
    d.mkdir()
    (d / "config.json").write_text((ckpts[fmt] / "config.json").read_text())
    t = load_file(str(ckpts[fmt] / "model.safetensors"))
    key = "model.layers.1.self_attn.v_proj.weight_scale"
    s = t[key].clone()
    if s.dtype == torch.float8_e4m3fn:
        b = s.view(torch.uint8)
        b[3, 1] = b[3, 1] + 1                          # the next E4M3 value: finite
    else:
        s[3, 1] = s[3, 1] * 2
    t[key] = s
    save_file(t, str(d / "model.safetensors"))
    rep = qat_check_base(d, ckpts["base"])
    assert not rep.ok and rep.first_mismatch["name"] == "model.layers.1.self_attn.v_proj.weight"
    assert [r["name"] for r in rep.rows if not r["exact"]] == ["model.layers.1.self_attn.v_proj.weight"]
