"""Vendor-quantized checkpoints served by the invariant forward (invariant/vendor_plan.py):
the plan read from the config, packed weights decoded exactly as the vendor's own dequantization
(compressed-tensors 0.17's compressors, nvidia-modelopt 0.47's QTensors, transformers' DeepSeek FP8
dequantizer), no bf16 copy of a quantized weight, the engine's load path (any tensor order) equal
to the trainer's, LoRA on a quantized base."""
from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

import vendor_ckpts as V
from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import family_class, from_checkpoint
from skyrl_numerics.invariant import numerics as N
from skyrl_numerics.invariant.base import iter_checkpoint_tensors

pytestmark = pytest.mark.filterwarnings("ignore")
IDS = [torch.tensor([3, 4, 5, 6, 7, 8, 9]), torch.tensor([11, 2, 40]), torch.tensor([7, 100, 9, 1, 5])]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, qwen_moe_dir):
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.engine.serving_checkpoint import write_int4_checkpoint

    root = tmp_path_factory.mktemp("vendor")
    ds = build_tiny_model("deepseek_v3", q_lora_rank=128, moe_intermediate_size=128)   # 128-col blocks
    out = {"ct_int4_experts": write_int4_checkpoint(qwen_moe_dir, experts=True, out_dir=root / "int4e"),
           "ct_nvfp4": V.ours(qwen_moe_dir, root / "ctnv", "ct_nvfp4"),
           "ct_fp8_channel": V.ours(qwen_moe_dir, root / "ctfc", "ct_fp8_channel"),
           "ct_fp8_block": V.ours(qwen_moe_dir, root / "ctfb", "ct_fp8_block"),
           "deepseek_fp8": V.ours(ds, root / "dsfp8", "deepseek_fp8"),
           "ctw_int4": V.ct_compressor(root / "ctw_int4", "int4"),
           "ctw_nvfp4": V.ct_compressor(root / "ctw_nvfp4", "nvfp4")}
    mo = V.modelopt_export(root)
    if mo is not None:
        out["modelopt_nvfp4"], out["modelopt_fp8"] = mo["NVFP4_DEFAULT_CFG"], mo["FP8_DEFAULT_CFG"]
    return out


WANT = {   # checkpoint -> {group: (weight, act)}
    "ct_int4_experts": {"attention": ("int4_g32", "none"), "experts": ("int4_g32", "none")},
    "ct_nvfp4": {"attention": ("nvfp4_ct", "none"), "experts": ("nvfp4_ct", "none")},
    "ct_fp8_channel": {"attention": ("fp8_channel", "none"), "experts": ("fp8_channel", "none")},
    "ct_fp8_block": {"attention": ("fp8_block", "none"), "experts": ("fp8_block", "none")},
    "deepseek_fp8": {g: ("fp8_block", "fp8_group") for g in ("attention", "dense", "shared", "experts")},
    "ctw_int4": {"attention": ("int4_g32", "none")},
    "ctw_nvfp4": {"attention": ("nvfp4_ct", "none")},
    "modelopt_nvfp4": {"attention": ("nvfp4", "nvfp4"), "experts": ("nvfp4", "nvfp4")},
    "modelopt_fp8": {"attention": ("fp8_tensor_weight", "fp8_tensor"), "experts": ("fp8_tensor_weight", "fp8_tensor")},
}


def _get(ckpts, kind):
    if kind not in ckpts:
        pytest.skip(f"modelopt's export does not run here (its dependencies are not in {V.DEPS})")
    return ckpts[kind]


def _tensors(d) -> dict:
    return dict(iter_checkpoint_tensors(d))


def _vendor_dequant(kind, d, qc, P, t):
    """The vendor's own dequantization of stored weight ``P`` (bf16), or None where it cannot run."""
    X = P[: -len(".weight")]
    if kind.startswith("modelopt"):
        from quant_vendors import modelopt_qtensors

        mo = modelopt_qtensors()
        if kind == "modelopt_nvfp4":
            shape = torch.Size((t[P].shape[0], t[P].shape[1] * 2))
            return mo.NVFP4QTensor(shape, torch.bfloat16, t[P]).dequantize(
                dtype=torch.bfloat16, scale=t[P + "_scale"], double_scale=t[P + "_scale_2"], block_sizes={-1: 16})
        # FP8: modelopt's dequantize in float32, rounded once to bf16 (its bf16 path first rounds the
        # float32 scale to bf16; the engine's FP8 GEMM applies the float32 scale)
        return mo.FP8QTensor(t[P].shape, torch.bfloat16, t[P]).dequantize(
            dtype=torch.float32, scale=t[P + "_scale"]).to(torch.bfloat16)
    if kind == "deepseek_fp8":
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        w, s = t[P], t[P + "_scale_inv"]
        if w.shape[0] % s.shape[0] or w.shape[1] % s.shape[1]:
            return None          # transformers' dequantizer takes whole blocks only (576-row kv_a_proj)
        return Fp8Dequantize._dequantize_one(None, w, s, torch.bfloat16)
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    (g,) = qc["config_groups"].values()
    fmt = g.get("format") or qc["format"]
    local = {k[len(X) + 1:]: v for k, v in t.items() if k.startswith(X + ".")}
    args = QuantizationArgs(**g["weights"])
    if args.strategy == "block":     # ct 0.17's decompress infers the strategy from the scale shape
        from compressed_tensors.quantization.lifecycle.forward import dequantize    # (one block col: "channel")

        return dequantize(x_q=t[P], scale=t[P + "_scale"], args=args).to(torch.bfloat16)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"].to(torch.bfloat16)


@pytest.mark.parametrize("kind", list(WANT))
def test_plan_and_packed_weights_are_the_vendors(ckpts, kind):
    d = _get(ckpts, kind)
    m = from_checkpoint(d)
    got = {g: (f.weight, f.act) for g, f in m.numerics.formats.items()}
    assert got == WANT[kind]
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    t = _tensors(d)
    checked = 0
    for P, q in m._packed.items():
        assert m._names[P] not in m.params                       # no bf16 copy of a quantized weight
        assert q.codes.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn)
        ref = _vendor_dequant(kind, d, qc, P, t)
        if ref is None:
            continue
        ours = m.served_weight(P)
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape, P
        assert torch.equal(ours.view(torch.int16), ref.contiguous().view(torch.int16)), P
        checked += 1
    assert checked >= 0.9 * len(m._packed) and checked > 0
    if WANT[kind].get("attention", ("", ""))[1] in ("nvfp4", "fp8_tensor"):    # static input scales, per linear
        P = "model.layers.0.self_attn.q_proj.weight"
        f = m._proj[P].fmt
        stored = float(t["model.layers.0.self_attn.q_proj.input_scale"])
        assert (f.act_global if f.act == "nvfp4" else f.act_scale) == stored


@pytest.mark.parametrize("kind", ["ct_int4_experts", "deepseek_fp8", "modelopt_nvfp4", "modelopt_fp8"])
def test_engine_load_path_in_any_order_equals_the_trainer(ckpts, kind):
    """The engine builds its model from the overridden config and loads the tensors vLLM's
    iterator hands it (here shuffled): the same packed codes, the same hidden states, and a
    sequence's rows the same alone and packed with others."""
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    d = _get(ckpts, kind)
    hf = json.loads((d / "config.json").read_text())
    over = engine_overrides(hf, model_dir=d)
    assert over["quantization_config"] is None and json.loads(over["skyrl_vendor"])["config"] == hf["quantization_config"]
    cfg = AutoConfig.from_pretrained(str(d))
    cfg.update(over)
    eng = family_class(hf["architectures"][0]).from_config(cfg, numerics=cfg.skyrl_numerics, pack=True)
    items = list(iter_checkpoint_tensors(d))
    random.Random(0).shuffle(items)
    eng.load_named(items)
    tr = from_checkpoint(d)
    assert set(eng._packed) == set(tr._packed)
    for P in tr._packed:
        assert torch.equal(eng._packed[P].codes.view(torch.uint8), tr._packed[P].codes.view(torch.uint8))
    for P, p in tr._proj.items():
        assert eng._proj[P].fmt == p.fmt
    with torch.no_grad():
        packed = tr.packed_hidden(IDS)
        off = 0
        for s in IDS:
            a, b = tr.sequence_hidden(s), eng.sequence_hidden(s)
            assert torch.equal(a, b) and torch.equal(a, packed[off:off + len(s)])
            off += len(s)


def test_lora_on_a_quantized_base(ckpts):
    d = ckpts["ct_int4_experts"]
    plan = N.NumericsPlan(lora_rank=4, lora_alpha=8, lora_targets=("attention", "experts"))
    m = from_checkpoint(d, numerics=plan)
    assert m.numerics.lora_rank == 4 and m.numerics.formats["experts"].weight == "int4_g32"
    assert len(m.adapter_names()) == 2 * (2 * 4 + 2 * 8 * 3) and m._packed
    base = from_checkpoint(d)
    with torch.no_grad():                 # B starts at zero: the adapters do not change a number
        assert torch.equal(m.sequence_hidden(IDS[0]), base.sequence_hidden(IDS[0]))
    clash = N.NumericsPlan(formats={"experts": {"weight": "nvfp4"}})
    with pytest.raises(InputError) as e:
        from_checkpoint(d, numerics=clash)
    assert e.value.field == "formats.experts"


def test_engine_overrides_refuse_what_they_cannot_serve(qwen_moe_dir):
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    cfg = json.loads((qwen_moe_dir / "config.json").read_text())
    bad = [({"quant_method": "awq", "bits": 4}, "quant_method"),
           ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, "quant_algo"),
           ({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}, "kv_cache_quant_algo"),
           ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
           ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
               "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
               "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
            "num_bits")]
    for qc, field in bad:
        with pytest.raises(InputError) as e:          # (UnsupportedConfig where the field is the reader's)
            engine_overrides({**cfg, "quantization_config": qc})
        assert e.value.field == field, (qc, e.value)
    # a group split between formats: one format per group
    split = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": [
        "lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.1.self_attn.o_proj"],
        "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    with pytest.raises(InputError, match="one format per group") as e:
        engine_overrides({**cfg, "quantization_config": split})
    assert e.value.field == "ignore" and "o_proj" in str(e.value)


def test_hf_quant_config_alone_and_disagreeing_with_config_json(ckpts, tmp_path):
    """modelopt <= 0.29 writes only hf_quant_config.json (vLLM reads it then); both present: the
    two must say the same."""
    from skyrl_numerics.invariant.vendor_plan import vendor_quant_config

    d = _get(ckpts, "modelopt_nvfp4")
    cfg = json.loads((d / "config.json").read_text())
    alone = V.copy_with(d, tmp_path / "alone", config={k: v for k, v in cfg.items() if k != "quantization_config"})
    assert vendor_quant_config(alone)["source"] == "hf_quant_config.json"
    assert from_checkpoint(alone).numerics.formats == from_checkpoint(d).numerics.formats
    qc = dict(cfg["quantization_config"], ignore=cfg["quantization_config"]["ignore"][:-1])
    other = V.copy_with(d, tmp_path / "other", config={**cfg, "quantization_config": qc})
    with pytest.raises(InputError) as e:
        from_checkpoint(other)
    assert e.value.field == "exclude_modules"


def _ct_fp8(acts):
    g = {"targets": ["Linear"], "format": "float-quantized",
         "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}}
    if acts is not None:
        g["input_activations"] = {"num_bits": 8, "type": "float", "symmetric": True, **acts}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head", "re:.*mlp.gate$"], "config_groups": {"group_0": g}}


@pytest.mark.parametrize("qc,want", [
    (_ct_fp8({"strategy": "token", "dynamic": True}), ("fp8_channel", "fp8_token", None)),
    (_ct_fp8({"strategy": "tensor", "dynamic": False}), ("fp8_channel", "fp8_tensor", 1.0)),
    (_ct_fp8({"strategy": "group", "group_size": 128, "dynamic": True}), ("fp8_channel", "fp8_group", None)),
    (_ct_fp8(None), ("fp8_channel", "none", None)),
    ({"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "exclude_modules": ["lm_head", "*mlp.gate"]},
     ("nvfp4", "none", None)),
])
def test_activation_formats_from_the_config(qwen_moe_dir, qc, want):
    """What the engine is told (``skyrl_numerics``) for each activation scheme; static scales are
    placeholders the loader replaces per linear with the stored ``input_scale``."""
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    cfg = json.loads((qwen_moe_dir / "config.json").read_text())
    if want[1] == "fp8_group":      # 1x128 groups: the tiny experts' 64-wide down_proj input is refused
        with pytest.raises(InputError) as e:
            engine_overrides({**cfg, "quantization_config": qc})
        assert e.value.field == "formats.experts.act"
        cfg = {**cfg, "moe_intermediate_size": 128}
    plan = N.NumericsPlan.from_json(engine_overrides({**cfg, "quantization_config": qc})["skyrl_numerics"])
    for g in ("attention", "experts"):
        f = plan.formats[g]
        assert (f.weight, f.act, f.act_scale) == want, g


def test_an_update_of_a_packed_weight_in_bf16_is_refused(ckpts):
    d = ckpts["ct_int4_experts"]
    m = from_checkpoint(d)
    P = "model.layers.0.self_attn.q_proj.weight"
    before = m._packed[P].codes.clone()
    with pytest.raises(InputError, match="stored codes") as e:
        m.load_named([(P, torch.zeros(m._packed_shapes[P], dtype=torch.bfloat16))])
    assert e.value.field == P and torch.equal(m._packed[P].codes, before)


@pytest.mark.isa
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 7), seed=st.integers(0, 2**31 - 1), mag=st.floats(1e-3, 1e3),
       act=st.sampled_from(["fp8_group", "nvfp4"]))
def test_new_activation_formats_are_row_local_and_the_recipes(rows, seed, mag, act):
    """``fp8_group`` is the ``fp8_block`` 1x128 recipe (vLLM's per-token-group FP8) and nvfp4 with
    ``act_global = g`` is the vllm-convention recipe at the stored global (``G = fl(1/g)``, what
    vLLM computes from a modelopt ``input_scale``), row by row."""
    from skyrl_numerics.quant import fake_quant

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 256, generator=g) * mag).to(torch.bfloat16)
    gl = float(torch.tensor(mag * 4 / 2688, dtype=torch.float32))
    f = N.LinearFormat(act=act, act_global=gl if act == "nvfp4" else None)
    whole = N.quantize_activation(x, f)
    want = (fake_quant(x, "fp8_block", block=(1, 128)) if act == "fp8_group" else
            fake_quant(x, "nvfp4", convention="vllm", global_scale=torch.tensor(gl)))
    assert torch.equal(whole, want)
    for i in range(rows):
        assert torch.equal(whole[i:i + 1], N.quantize_activation(x[i:i + 1], f))
