"""``qat_check_base`` / ``qat-check QUANT_DIR --base BASE_DIR``: scheme detection, base matching
(per-expert and fused 3-D experts), bitwise codes + scales, shared NVFP4 globals, bad input."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qmodels import tiny_qwen3_moe

from skyrl_numerics.cli import main
from skyrl_numerics.errors import InputError
from skyrl_numerics.quant import quantize
from skyrl_numerics.quant.checkpoint import FORMATS, qat_check, write_quantized_checkpoint
from skyrl_numerics.quant.vendor_check import detect_scheme, qat_check_base

EXPERTS = ".mlp.experts."
ATTN = lambda k: ".self_attn." in k and k.endswith("_proj.weight")  # noqa: E731


def _save_fused(m, d):
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(d / "model.safetensors"))
    m.config.to_json_file(str(d / "config.json"))
    return d


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """seed 0 per-expert (save_pretrained), seed 0 fused 3-D, seed 1 per-expert."""
    root = tmp_path_factory.mktemp("bases")
    m0 = tiny_qwen3_moe(0).to(torch.bfloat16)
    m0.save_pretrained(root / "per")
    _save_fused(m0, root / "fused")
    tiny_qwen3_moe(1).to(torch.bfloat16).save_pretrained(root / "seed1")
    return {"per": root / "per", "fused": root / "fused", "seed1": root / "seed1"}


def _pick(k):
    return EXPERTS in k or ATTN(k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_base_check_passes_on_written_checkpoint(bases, tmp_path, fmt):
    names = write_quantized_checkpoint(bases["per"], tmp_path, fmt, _pick)
    rep = qat_check_base(tmp_path, bases["per"])
    assert rep.ok, rep.to_text()
    assert len(rep.rows) == len(names) and rep.summary()["code_mismatches"] == 0
    # a base stored with fused 3-D experts matches the per-expert quantized tensors
    rep = qat_check_base(tmp_path, bases["fused"])
    assert rep.ok, rep.to_text()
    assert any("gate_up_proj[0][:64]" in r["base_name"] for r in rep.rows)


@pytest.mark.parametrize("fmt", ["modelopt_nvfp4", "ct_nvfp4", "ct_int4", "ct_fp8_block"])
def test_fused_quantized_vs_per_expert_base(bases, tmp_path, fmt):
    write_quantized_checkpoint(bases["fused"], tmp_path, fmt, lambda k: EXPERTS in k)
    rep = qat_check_base(tmp_path, bases["per"])
    assert rep.ok, rep.to_text()
    assert "model.layers.0.mlp.experts.gate_up_proj[3]" in [r["name"] for r in rep.rows]
    assert qat_check_base(tmp_path, bases["fused"]).ok


def _edit_first_scale(qdir, key_end):
    f = qdir / "model.safetensors"
    t = load_file(str(f))
    key = next(k for k in sorted(t) if k.endswith(key_end))
    s = t[key]
    if s.dtype == torch.float8_e4m3fn:
        b = s.view(torch.uint8).clone()
        b.view(-1)[0] = b.view(-1)[0] + 1 if b.view(-1)[0] < 0x7E else b.view(-1)[0] - 1   # next finite E4M3
        t[key] = b.view(torch.float8_e4m3fn)
    else:
        s = s.clone()
        s.view(-1)[0] = s.view(-1)[0] * 2                                          # still finite
        t[key] = s
    save_file(t, str(f))
    return key


@pytest.mark.parametrize("fmt,suffix", [("modelopt_nvfp4", "_scale"), ("ct_nvfp4", "_scale"), ("ct_int4", "_scale"),
                                        ("ct_fp8_channel", "_scale"), ("modelopt_fp8", "_scale"),
                                        ("deepseek_fp8", "_scale_inv")])
def test_finite_scale_edit_fails_and_names_the_tensor(bases, tmp_path, fmt, suffix, capsys):
    qdir = tmp_path / "q"
    write_quantized_checkpoint(bases["per"], qdir, fmt, lambda k: k.endswith("experts.2.down_proj.weight")
                               or k.endswith("experts.5.up_proj.weight"))
    key = _edit_first_scale(qdir, "experts.2.down_proj.weight" + suffix)
    name = key[: -len(suffix)]
    if fmt in ("modelopt_nvfp4", "ct_nvfp4", "ct_int4"):
        assert qat_check(qdir).ok                  # the self-consistency check cannot see it
    rep = qat_check_base(qdir, bases["per"])
    assert not rep.ok and rep.first_mismatch["name"] == name
    assert [r["name"] for r in rep.rows if not r["exact"]] == [name]
    rc = main(["qat-check", str(qdir), "--base", str(bases["per"]), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"first mismatching tensor: {name} ") and "1 of 4 tensors mismatch" in last
    r = json.loads((tmp_path / "r.json").read_text())
    assert not r["ok"] and r["first_mismatch"]["name"] == name and r["summary"]["tensors"] == 4


@pytest.mark.parametrize("fmt", ["modelopt_nvfp4", "ct_nvfp4", "ct_int4", "ct_fp8_block", "deepseek_fp8"])
def test_base_from_another_seed_fails(bases, tmp_path, fmt):
    write_quantized_checkpoint(bases["per"], tmp_path, fmt, lambda k: EXPERTS in k)
    rep = qat_check_base(tmp_path, bases["seed1"])
    assert not rep.ok and rep.summary()["exact"] == 0
    assert rep.first_mismatch["name"] == sorted(r["name"] for r in rep.rows)[0]


def test_shared_nvfp4_global_taken_from_checkpoint(bases, tmp_path):
    """Writers share one global across gate/up (and q/k/v); recomputing it per tensor would fail."""
    src = load_file(str(next(bases["per"].glob("*.safetensors"))))
    out = dict(src)
    pre = "model.layers.0.mlp.experts.1."
    g, u = src[pre + "gate_proj.weight"], src[pre + "up_proj.weight"]
    A = torch.maximum(g.float().abs().amax(), u.float().abs().amax())
    own = {}
    for k, w in (("gate_proj", g), ("up_proj", u)):
        q = quantize(w, "nvfp4", convention="modelopt", global_amax=A)
        own[k] = quantize(w, "nvfp4", convention="modelopt")
        n = pre + k + ".weight"
        out.update({n: q.codes, n + "_scale": q.scales, n + "_scale_2": q.global_scale.reshape(())})
    assert not all(torch.equal(own[k].global_scale, (A / 2688.0).reshape(())) for k in own)
    d = tmp_path / "q"
    d.mkdir()
    save_file(out, str(d / "model.safetensors"))
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    assert detect_scheme(d).kind == "modelopt_nvfp4"
    rep = qat_check_base(d, bases["per"])
    assert rep.ok and len(rep.rows) == 2, rep.to_text()


def test_ct_nvfp4_observer_in_weight_dtype(bases, tmp_path):
    """llm-compressor observes bf16 weights in bf16: block scales from G * bf16(a/6). auto finds it."""
    src = load_file(str(next(bases["per"].glob("*.safetensors"))))
    out, hit = dict(src), 0
    for k in [k for k in src if EXPERTS in k]:
        w = src[k]
        q = quantize(w, "nvfp4", convention="compressed_tensors", stats_dtype=torch.bfloat16)
        hit += not torch.equal(q.scales.view(torch.uint8),
                               quantize(w, "nvfp4", convention="compressed_tensors").scales.view(torch.uint8))
        del out[k]
        out.update({k + "_packed": q.codes, k + "_scale": q.scales, k + "_global_scale": q.global_scale.reshape(1)})
    assert hit > 0                                  # the observer dtype is visible in the scales
    d = tmp_path / "q"
    write_quantized_checkpoint(bases["per"], d, "ct_nvfp4", lambda k: EXPERTS in k)   # its config and ignore
    save_file(out, str(d / "model.safetensors"))
    rep = qat_check_base(d, bases["per"])
    assert rep.ok and rep.observer_dtype == "bfloat16", rep.to_text()
    assert not qat_check_base(d, bases["per"], observer="float32").ok


# ---------------------------------------------------------------------------------------- bad input
def _cfg(d, qc):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "x", **({"quantization_config": qc} if qc else {})}))
    return d


def test_detect_scheme_from_configs(tmp_path):
    ct = lambda w, fmt="pack-quantized": {"quant_method": "compressed-tensors", "format": fmt,  # noqa: E731
                                          "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}}
    assert detect_scheme(_cfg(tmp_path / "a", ct({"num_bits": 4, "type": "int", "strategy": "group",
                                                  "group_size": 128}))).kind == "ct_int4"
    s = detect_scheme(_cfg(tmp_path / "b", ct({"num_bits": 8, "type": "float", "strategy": "block",
                                               "block_structure": [128, 128]}, "float-quantized")))
    assert s.kind == "ct_fp8" and s.block == (128, 128)
    assert detect_scheme(_cfg(tmp_path / "c", {"quant_method": "fp8", "weight_block_size": [128, 128]})).block == (128, 128)
    assert detect_scheme(_cfg(tmp_path / "d", {"quant_method": "modelopt", "quant_algo": "FP8"})).kind == "modelopt_fp8"
    with pytest.raises(InputError, match="no quantization config"):
        detect_scheme(_cfg(tmp_path / "e", None))
    with pytest.raises(InputError, match="unknown compressed-tensors scheme"):
        detect_scheme(_cfg(tmp_path / "f", ct({"num_bits": 8, "type": "int", "strategy": "channel"})))
    with pytest.raises(InputError, match="unknown modelopt quant_algo 'W4A8_AWQ'"):
        detect_scheme(_cfg(tmp_path / "g", {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}))
    with pytest.raises(InputError, match="unknown quant_method 'gptq'"):
        detect_scheme(_cfg(tmp_path / "h", {"quant_method": "gptq"}))


def _cli_bad(capsys, *argv):
    rc = main(["qat-check", *map(str, argv)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_cli_bad_input_exits_2(bases, tmp_path, capsys):
    _cfg(tmp_path / "noq", None)
    save_file({"a.weight": torch.zeros(2, 2)}, str(tmp_path / "noq" / "model.safetensors"))
    assert "no quantization config" in _cli_bad(capsys, tmp_path / "noq", "--base", bases["per"])
    # base tensor missing / of another shape
    q = tmp_path / "q"
    write_quantized_checkpoint(bases["per"], q, "ct_int4", lambda k: k.endswith("experts.0.down_proj.weight"))
    other = tmp_path / "other"
    other.mkdir()
    save_file({"x.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(other / "model.safetensors"))
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in _cli_bad(capsys, q, "--base", other)
    save_file({"model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(64, 128, dtype=torch.bfloat16)},
              str(other / "model.safetensors"))
    assert "has shape (64, 128)" in _cli_bad(capsys, q, "--base", other)
    # a non-finite stored scale
    t = load_file(str(q / "model.safetensors"))
    k = "model.layers.0.mlp.experts.0.down_proj.weight_scale"
    t[k] = t[k].clone()
    t[k][0, 0] = float("inf")
    save_file(t, str(q / "model.safetensors"))
    assert "non-finite" in _cli_bad(capsys, q, "--base", bases["per"])


def test_help_says_what_self_check_cannot_detect(capsys):
    with pytest.raises(SystemExit):
        main(["qat-check", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "cannot detect" in out and "--base" in out
