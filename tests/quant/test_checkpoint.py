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


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory):
    """A checkpoint that stores the MoE experts fused, as transformers >= 5 holds them in memory:
    ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``."""
    from safetensors.torch import save_file
    d = tmp_path_factory.mktemp("fused")
    m = tiny_qwen3_moe().to(torch.bfloat16)
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 128)
    assert sd["model.layers.0.mlp.experts.down_proj"].shape == (8, 128, 64)
    save_file(sd, str(d / "model.safetensors"))
    m.config.to_json_file(str(d / "config.json"))
    return d, m


FMTS = [("modelopt_nvfp4", "nvfp4", {"convention": "modelopt"}),
        ("ct_nvfp4", "nvfp4", {"convention": "compressed_tensors"}),
        ("ct_int4", "int4_g32", {})]


@pytest.mark.parametrize("fmt,recipe,opts", FMTS)
def test_qat_check_on_written_checkpoint(bf16_ckpt, tmp_path, fmt, recipe, opts):
    src, model = bf16_ckpt
    names = write_quantized_checkpoint(src, tmp_path, fmt, lambda k: ".mlp.experts." in k)
    assert len(names) == 2 * 8 * 3
    cfg = json.loads((tmp_path / "config.json").read_text())
    qc = cfg["quantization_config"]   # what vLLM dispatches on: modelopt vs compressed-tensors
    assert qc["quant_method"] == ("modelopt" if fmt.startswith("modelopt") else "compressed-tensors"), qc
    rep = qat_check(tmp_path)
    assert rep.ok and rep.summary()["tensors"] == 48 and all(r["recipe"] == recipe for r in rep.rows)
    assert "OK" in rep.to_text().splitlines()[0]
    # the stored codes are what the trainer's recipe gives for the same bf16 weight
    qts = load_qtensors(tmp_path)
    w = model.model.layers[1].mlp.experts.gate_up_proj[3].detach()
    gate = w.chunk(2, 0)[0]
    assert torch.equal(quantize(gate, recipe, **opts).codes, qts["model.layers.1.mlp.experts.3.gate_proj.weight"].codes)
    if recipe == "int4_g32":   # dynamic re-encoding of INT4 is not exact: +7.5 maxima saturate to 7
        assert rep.summary()["dynamic_exact"] < 48


@pytest.mark.parametrize("fmt", ["modelopt_nvfp4", "ct_nvfp4"])
def test_qat_check_detects_corrupted_scale(bf16_ckpt, tmp_path, fmt):
    from safetensors.torch import load_file, save_file
    src, _ = bf16_ckpt
    write_quantized_checkpoint(src, tmp_path, fmt, lambda k: k.endswith("experts.0.down_proj.weight"))
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    k = "model.layers.0.mlp.experts.0.down_proj.weight_scale"
    s = t[k].view(torch.uint8).clone()
    s[0, 1] = 0x7F                                         # a NaN block scale: refused, naming it
    t[k] = s.view(torch.float8_e4m3fn)
    save_file(t, str(f))
    with pytest.raises(InputError, match="non-finite") as ei:
        qat_check(tmp_path)
    assert ei.value.field == k and ei.value.index == 1 and k in str(ei.value)


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


def test_ct_nvfp4_tensors_match_compressed_tensors_compressor():
    """Our ct_nvfp4 tensors are what compressed-tensors' own NVFP4PackedCompressor writes for the
    same weight and qparams (computed by its generate_gparam / calculate_qparams on float32
    statistics), bit for bit; its decompress equals our dequantize of the stored tensors."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    from skyrl_numerics.quant import codecs as C
    from skyrl_numerics.quant import dequantize
    from skyrl_numerics.quant.checkpoint import quantize_weight_tensors
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 2)).to(torch.bfloat16)
    w[0, :16] = 0                                                # zero block: scale 0.125
    w[1, :16] = -0.0
    ours = quantize_weight_tensors("x.weight", w, "ct_nvfp4")
    assert sorted(ours) == ["x.weight_global_scale", "x.weight_packed", "x.weight_scale"]

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    wf = w.float()
    G = generate_gparam(wf.amin(), wf.amax())
    blocks = wf.reshape(64, 16, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=G)
    ref = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": G}, scheme)
    assert ours["x.weight_global_scale"].dtype == ref["weight_global_scale"].dtype == torch.float32
    assert torch.equal(ours["x.weight_global_scale"], ref["weight_global_scale"])   # G = 2688/amax (encode)
    assert ours["x.weight_scale"].dtype == ref["weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(ours["x.weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert ours["x.weight_packed"].dtype == ref["weight_packed"].dtype == torch.uint8
    assert torch.equal(ours["x.weight_packed"], ref["weight_packed"])
    assert torch.equal(C.decode(C.unpack_fp4(ours["x.weight_packed"]), "e2m1"),
                       unpack_fp4_from_uint8(ref["weight_packed"], 64, 256, dtype=torch.float32))

    dec = NVFP4PackedCompressor.decompress(dict(ref), scheme)["weight"]
    q = _nvfp4_from(ours, "x.weight")
    assert dec.dtype == torch.bfloat16 and torch.equal(dequantize(q, torch.bfloat16), dec)


def _nvfp4_from(tensors, name):
    from skyrl_numerics.quant.checkpoint import _nvfp4_qtensors
    return _nvfp4_qtensors(name, tensors[f"{name}_packed"], tensors[f"{name}_scale"],
                           tensors[f"{name}_global_scale"], "compressed_tensors", torch.bfloat16,
                           f"{name}_global_scale")[name]


@pytest.mark.parametrize("fmt,recipe,opts", FMTS)
def test_qat_check_on_fused_3d_experts(fused_ckpt, tmp_path, fmt, recipe, opts):
    src, model = fused_ckpt
    names = write_quantized_checkpoint(src, tmp_path, fmt, lambda k: ".mlp.experts." in k)
    assert sorted(names) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
    rep = qat_check(tmp_path)
    assert rep.ok and rep.summary()["tensors"] == 2 * 2 * 8, rep.to_text()
    qts = load_qtensors(tmp_path)
    assert "model.layers.1.mlp.experts.down_proj[7]" in qts
    for pname in ("gate_up_proj", "down_proj"):
        w = getattr(model.model.layers[1].mlp.experts, pname).detach()
        for e in (0, 5):
            q = qts[f"model.layers.1.mlp.experts.{pname}[{e}]"]
            ref = quantize(w[e], recipe, **opts)      # each expert matrix quantized on its own
            assert q.shape == tuple(w[e].shape) and torch.equal(q.codes, ref.codes)
            assert torch.equal(q.scales.view(torch.uint8) if q.scales.dtype.itemsize == 1 else q.scales,
                               ref.scales.view(torch.uint8) if ref.scales.dtype.itemsize == 1 else ref.scales)
            if ref.global_scale is not None:
                assert torch.equal(q.global_scale, ref.global_scale)


def test_fused_3d_corrupted_and_malformed(fused_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    src, _ = fused_ckpt
    write_quantized_checkpoint(src, tmp_path, "ct_nvfp4", lambda k: k.endswith("layers.0.mlp.experts.down_proj"))
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    k = "model.layers.0.mlp.experts.down_proj_scale"
    assert t[k].shape == (8, 128, 4) and t["model.layers.0.mlp.experts.down_proj_global_scale"].shape == (8,)
    orig = t[k]
    s = t[k].view(torch.uint8).clone()
    s[3, 0, 0] = 0x00                                     # zero block scale in expert 3 only: DIFF
    t[k] = s.view(torch.float8_e4m3fn)
    save_file(t, str(f))
    rep = qat_check(tmp_path)
    assert not rep.ok and [r["name"] for r in rep.rows if not r["static_exact"]] == \
        ["model.layers.0.mlp.experts.down_proj[3]"]
    s[3, 0, 0] = 0xFF                                     # -NaN: refused, naming the tensor and index
    t[k] = s.view(torch.float8_e4m3fn)
    save_file(t, str(f))
    with pytest.raises(InputError, match="non-finite") as ei:
        load_qtensors(tmp_path)
    assert ei.value.field == k and ei.value.index == 3 * 128 * 4
    t[k] = orig
    t["model.layers.0.mlp.experts.down_proj_global_scale"] = torch.ones(7)   # one global per expert needed
    save_file(t, str(f))
    with pytest.raises(InputError, match=r"expected \(8,\)"):
        load_qtensors(tmp_path)


# ---- finite-scale corruption ---------------------------------------------------------------------
# The self-consistency check (no --base) re-encodes dequantize(q) with q's own scales. A scale
# edited to another finite value is visible to it only where the edit breaks that round trip in
# the trainer dtype (bf16): a zero block or global scale (the block dequantizes to 0 / inf and
# cannot re-encode its codes), or a global scale that pushes the dequantized weights out of bf16's range (overflow
# to inf, underflow to subnormals/0). Any edit that keeps code * scale representable is a fixed
# point of dequantize -> re-encode and passes — by construction, not by accident (docs/quant.md,
# "qat_check_base"): the `--base` check, which recomputes codes and scales from the base weights,
# catches those (tests/quant/test_qat_base.py; asserted below for the same edits).
TARGET = "model.layers.0.mlp.experts.0.down_proj.weight"


@pytest.fixture(scope="module")
def written(bf16_ckpt, tmp_path_factory):
    """One pristine quantized checkpoint per format (expert 0's down_proj of every layer)."""
    src, _ = bf16_ckpt
    out = {}
    for fmt in ("modelopt_nvfp4", "ct_nvfp4", "ct_int4"):
        d = tmp_path_factory.mktemp(fmt)
        write_quantized_checkpoint(src, d, fmt, lambda k: k.endswith("experts.0.down_proj.weight"))
        assert qat_check(d).ok
        out[fmt] = d
    return out


def _edited(written, fmt, suffix, edit, tmp_path):
    """A copy of the pristine ``fmt`` checkpoint with ``TARGET + suffix`` replaced by ``edit(t)``."""
    import shutil

    from safetensors.torch import load_file, save_file
    d = tmp_path / "q"
    shutil.copytree(written[fmt], d)
    f = d / "model.safetensors"
    t = load_file(str(f))
    key = TARGET + suffix
    new = edit(t[key].clone())
    assert new.dtype == t[key].dtype and new.shape == t[key].shape
    assert torch.isfinite(new.float()).all() and not torch.equal(new.float(), t[key].float())
    t[key] = new
    save_file(t, str(f))
    return d


def _e4m3_bits(fn):
    """Edit an E4M3 scale tensor through its bit patterns: fn(uint8 flat view) in place."""
    def edit(s):
        u = s.view(torch.uint8).reshape(-1)
        fn(u)
        return u.reshape(s.shape).view(torch.float8_e4m3fn)
    return edit


def _first(u, ok):
    return next(i for i in range(u.numel()) if ok(int(u[i])))


def _set_first(value):
    def edit(s):
        s.reshape(-1)[0] = value
        return s
    return edit


def _times(f):
    def edit(s):
        s.reshape(-1)[0] *= f
        return s
    return edit


def _block_zero(u):
    u[_first(u, lambda b: b != 0)] = 0x00                                  # +0.0: finite


def _block_double(u):
    u[_first(u, lambda b: 0x08 <= b < 0x76)] += 0x08                       # exponent + 1 (<= 448)


def _block_next(u):
    u[_first(u, lambda b: 0 < b < 0x7E)] += 0x01                           # the next E4M3 value


DETECTED = [
    ("modelopt_nvfp4", "_scale", _e4m3_bits(_block_zero), "block scale 0"),
    ("ct_nvfp4", "_scale", _e4m3_bits(_block_zero), "block scale 0"),
    ("modelopt_nvfp4", "_scale_2", _set_first(0.0), "global 0"),
    ("ct_nvfp4", "_global_scale", _set_first(0.0), "encode global 0"),
    ("modelopt_nvfp4", "_scale_2", _set_first(1e38), "global 1e38: bf16 overflow"),
    ("modelopt_nvfp4", "_scale_2", _set_first(1e-44), "global 1e-44: bf16 underflow"),
    ("ct_nvfp4", "_global_scale", _set_first(1e-38), "encode global 1e-38: bf16 overflow"),
]
PASSED = [
    ("modelopt_nvfp4", "_scale", _e4m3_bits(_block_double), "block scale x2"),
    ("modelopt_nvfp4", "_scale", _e4m3_bits(_block_next), "block scale +1 ulp"),
    ("ct_nvfp4", "_scale", _e4m3_bits(_block_next), "block scale +1 ulp"),
    ("modelopt_nvfp4", "_scale_2", _times(2.0), "global x2"),
    ("ct_nvfp4", "_global_scale", _times(1.37), "encode global x1.37"),
    ("ct_int4", "_scale", _times(2.0), "group scale x2"),
    ("ct_int4", "_scale", _times(1.37), "group scale x1.37"),
]


@pytest.mark.parametrize("fmt,suffix,edit,what", DETECTED, ids=[f"{f}-{w}" for f, _, _, w in DETECTED])
def test_qat_check_detects_finite_scale_edits_that_break_the_round_trip(written, tmp_path, fmt, suffix, edit, what):
    d = _edited(written, fmt, suffix, edit, tmp_path)
    rep = qat_check(d)
    bad = [r for r in rep.rows if not r["static_exact"]]
    assert not rep.ok and [r["name"] for r in bad] == [TARGET], rep.to_text()
    assert bad[0]["static_code_mismatches"] > 0 and "MISMATCH" in rep.to_text().splitlines()[0]


@pytest.mark.parametrize("fmt,suffix,edit,what", PASSED, ids=[f"{f}-{w}" for f, _, _, w in PASSED])
def test_qat_check_cannot_see_consistent_finite_scale_edits_base_does(bf16_ckpt, written, tmp_path, fmt,
                                                                      suffix, edit, what):
    """What the self-consistency path cannot detect, asserted as such (so a change in what it
    sees is noticed), and the --base path flagging exactly the edited tensor."""
    from skyrl_numerics.quant.vendor_check import qat_check_base
    d = _edited(written, fmt, suffix, edit, tmp_path)
    rep = qat_check(d)
    assert rep.ok and all(r["static_exact"] for r in rep.rows), rep.to_text()
    src, _ = bf16_ckpt
    base = qat_check_base(d, src)
    assert not base.ok and [r["name"] for r in base.rows if not r["exact"]] == [TARGET], base.to_text()


@pytest.mark.parametrize("fmt,suffix,value", [("modelopt_nvfp4", "_scale_2", -1e-5),
                                               ("ct_nvfp4", "_global_scale", -3.0)])
def test_qat_check_refuses_a_negative_global_scale(written, tmp_path, fmt, suffix, value):
    d = _edited(written, fmt, suffix, _set_first(value), tmp_path)
    with pytest.raises(InputError, match="must be >= 0") as ei:
        qat_check(d)
    assert ei.value.field == TARGET + suffix and ei.value.source == "model.safetensors"


def test_qat_check_int4_zero_scale_names_the_tensor(written, tmp_path, capsys):
    from skyrl_numerics.cli import main
    d = _edited(written, "ct_int4", "_scale", _set_first(0.0), tmp_path)
    with pytest.raises(InputError) as ei:
        qat_check(d)
    assert TARGET in str(ei.value) and ei.value.field == TARGET + "_scale" and ei.value.index == 0, str(ei.value)
    assert main(["qat-check", str(d)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and TARGET in err


@pytest.mark.parametrize("fmt", ["modelopt_nvfp4", "ct_nvfp4", "ct_int4"])
def test_qat_check_refuses_a_negative_block_scale(written, tmp_path, fmt):
    def neg(s):
        f = s.float()
        f.reshape(-1)[0] = -f.reshape(-1)[0].abs().clamp_min(0.5)
        return f.to(s.dtype)
    d = _edited(written, fmt, "_scale", neg, tmp_path)
    with pytest.raises(InputError) as ei:
        qat_check(d)
    assert ei.value.field == TARGET + "_scale" and "holds -" in str(ei.value) and "must be" in str(ei.value), \
        str(ei.value)
