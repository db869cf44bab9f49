"""GPT-OSS-style MXFP4 experts in ``qat-check --base``: ``mlp.experts.gate_up_proj_blocks`` uint8
``[E, 2I, H/32, 16]`` + ``_scales`` uint8 E8M0 ``[E, 2I, H/32]`` (down_proj alike), config
``quant_method: mxfp4`` with ``modules_to_not_convert``, against a bf16 base in the HF GptOss layout
``experts.gate_up_proj [E, H, 2I]`` (the transpose of the stored rows). The checkpoint is written
with our ``mxfp4`` recipe; transformers' own ``convert_moe_packed_tensors`` (the decoder its GptOss
loading uses) must decode it to our dequantized values bitwise."""
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from test_qat_bad_input import _apply, _refused_or_mismatch, tensor_edit

from skyrl_numerics.cli import main
from skyrl_numerics.errors import InputError
from skyrl_numerics.quant import dequantize, quantize
from skyrl_numerics.quant.checkpoint import qat_check
from skyrl_numerics.quant.vendor_check import qat_check_base

NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
GU = "model.layers.1.mlp.experts.gate_up_proj"


def tiny_gpt_oss(seed=0):
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_local_experts=4,
                       num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                       max_position_embeddings=64)
    torch.manual_seed(seed)
    m = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():                       # spread the expert magnitudes: many E8M0 exponents
        for n, p in m.named_parameters():
            if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(torch.randn(p.shape, dtype=torch.float32) * torch.exp(torch.randn(p.shape[0], 1, p.shape[2]) * 2))
    return m


def write_mxfp4(base_sd, out, scale_mode="floor"):
    """GPT-OSS layout from our recipe: per expert, the [out, in] matrix (HF param transposed)."""
    sd = {}
    for k, v in base_sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            qs = [quantize(v[e].t().contiguous(), "mxfp4", scale_mode=scale_mode) for e in range(v.shape[0])]
            o, i = qs[0].shape
            sd[k + "_blocks"] = torch.stack([q.codes.reshape(o, i // 32, 16) for q in qs])
            sd[k + "_scales"] = torch.stack([q.scales.view(torch.uint8) for q in qs])
        else:
            sd[k] = v.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERT}}))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    out = {}
    for seed in (0, 1):
        sd = {k: v.contiguous() for k, v in tiny_gpt_oss(seed).state_dict().items()}
        (root / f"base{seed}").mkdir()
        save_file(sd, str(root / f"base{seed}" / "model.safetensors"))
        out[f"base{seed}"] = root / f"base{seed}"
        if seed == 0:
            out["sd"] = sd
    out["floor"] = write_mxfp4(out["sd"], root / "floor")
    out["rceil"] = write_mxfp4(out["sd"], root / "rceil", "rceil")
    return out


def test_layout_and_transformers_decode_equal_our_dequant(ckpts):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    t = load_file(str(ckpts["floor"] / "model.safetensors"))
    w = ckpts["sd"][GU]
    E, H, I2 = w.shape
    assert t[GU + "_blocks"].shape == (E, I2, H // 32, 16) and t[GU + "_scales"].shape == (E, I2, H // 32)
    for name in (GU, "model.layers.0.mlp.experts.down_proj"):
        theirs = convert_moe_packed_tensors(t[name + "_blocks"], t[name + "_scales"], dtype=torch.bfloat16)
        base = ckpts["sd"][name]
        assert theirs.shape == base.shape                    # [E, in, out]: the HF GptOss parameter
        ours = torch.stack([dequantize(quantize(base[e].t().contiguous(), "mxfp4"), torch.bfloat16).t()
                            for e in range(base.shape[0])])
        assert torch.equal(theirs.view(torch.int16), ours.view(torch.int16))
        assert len(torch.unique(t[name + "_scales"])) > 8     # many scale exponents exercised


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_qat_check_base_passes_and_finds_the_scale_mode(ckpts, mode, capsys):
    rep = qat_check_base(ckpts[mode], ckpts["base0"])
    assert rep.ok and rep.scheme == "gpt_oss_mxfp4" and rep.mx_scale_mode == mode, rep.to_text()
    assert len(rep.rows) == 2 * 2 * 4 and all(r["recipe"] == "mxfp4" for r in rep.rows)
    assert f"{GU}[3]" in [r["name"] for r in rep.rows]
    assert [r["base_name"] for r in rep.rows if r["name"] == f"{GU}[3]"] == [f"{GU}[3].T"]
    other = "rceil" if mode == "floor" else "floor"
    assert not qat_check_base(ckpts[mode], ckpts["base0"], mx_scale_mode=other).ok   # the modes differ here
    assert main(["qat-check", str(ckpts[mode]), "--base", str(ckpts["base0"]), "--mx-scale-mode", other]) == 1
    capsys.readouterr()
    assert main(["qat-check", str(ckpts[mode]), "--base", str(ckpts["base0"])]) == 0
    assert f"(scale mode {mode}): OK, 16 of 16 tensors exact" in capsys.readouterr().out
    self_rep = qat_check(ckpts[mode])                     # the self-consistency check reads the layout too
    assert self_rep.ok and len(self_rep.rows) == 16 and {r["recipe"] for r in self_rep.rows} == {"mxfp4"}


def test_one_scale_byte_edit_fails_naming_the_tensor(ckpts, tmp_path, capsys):
    d = tmp_path / "q"
    shutil.copytree(ckpts["floor"], d)
    t = load_file(str(d / "model.safetensors"))
    s = t[GU + "_scales"].clone()
    s[2, 5, 1] += 1                                        # the block scale doubles: still finite
    t[GU + "_scales"] = s
    save_file(t, str(d / "model.safetensors"))
    rc = main(["qat-check", str(d), "--base", str(ckpts["base0"])])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith(f"first mismatching tensor: {GU}[2] ") and "1 of 16 tensors mismatch" in last
    assert "0 of" not in last.split("scales differ")[0].split("and")[-1]
    assert not qat_check_base(ckpts["floor"], ckpts["base1"]).ok


def test_bad_mxfp4_input_exit_2(ckpts, tmp_path, capsys):
    cases = [(lambda t: t.update({GU + "_scales": t[GU + "_scales"][..., :-1].contiguous()}), GU + "_scales"),
             (lambda t: t[GU + "_scales"].view(-1).__setitem__(7, 255), GU + "_scales"),
             (lambda t: t.update({GU + "_blocks": t[GU + "_blocks"][..., :8].contiguous()}), GU + "_blocks"),
             (lambda t: t.pop(GU + "_scales"), GU + "_scales")]
    for i, (edit, field) in enumerate(cases):
        d = tmp_path / f"q{i}"
        shutil.copytree(ckpts["floor"], d)
        t = load_file(str(d / "model.safetensors"))
        edit(t)
        save_file(t, str(d / "model.safetensors"))
        with pytest.raises(InputError) as ei:
            qat_check_base(d, ckpts["base0"])
        assert ei.value.field == field and field in str(ei.value), str(ei.value)
        assert main(["qat-check", str(d), "--base", str(ckpts["base0"])]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    d = tmp_path / "cfg"
    shutil.copytree(ckpts["floor"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].append("model.layers.1.mlp.experts")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="model.layers.1.mlp.experts") as ei:
        qat_check_base(d, ckpts["base0"])
    assert ei.value.field == "modules_to_not_convert"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_tensor_corruption_is_refused_or_a_mismatch(ckpts, data, capsys):
    """The single-corruption property of tests/quant/test_qat_bad_input.py on the MXFP4 layout."""
    names = [k for k in load_file(str(ckpts["floor"] / "model.safetensors")) if k.endswith(("_blocks", "_scales"))]
    _, _, fn = data.draw(tensor_edit(names))
    with tempfile.TemporaryDirectory() as tmp:
        _apply(ckpts["floor"], Path(tmp) / "q", fn)
        _refused_or_mismatch(Path(tmp) / "q", ckpts["base0"], Path(tmp) / "out" / "r.json", capsys)
