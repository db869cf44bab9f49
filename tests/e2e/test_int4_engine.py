"""A real quantized engine: vLLM CPU serving a compressed-tensors INT4 (pack-quantized, W4A16 g32)
checkpoint of the tiny Qwen3-MoE through its INT4 kernel (``CPUWNA16LinearKernel``), and an
in-place update in the serving format (DeltaPublisher(weights_format="ct_int4") -> receiver ->
update_vllm_weights) matching a fresh engine loaded from the same quantized checkpoint, bitwise.

What vLLM CPU 0.32 does with INT4 here: the attention projections (qkv_proj, o_proj) run
``CompressedTensorsWNA16 / CPUWNA16LinearKernel``. INT4 experts are refused at start-up: the WNA16
MoE oracle's CPU backend (``CPUExpertsInt4``) accepts only the per-channel key ``kInt4Static``
(GroupShape(1, -1)), not group-32 scales, and ZEN_CPU needs a Zen CPU ("No WNA16 MoE backend
supports the deployment configuration"), so the experts stay bf16 (listed in the config's ignore).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from skyrl_numerics.host import missing_kernel_reason
from skyrl_numerics.quant import quantize
from skyrl_numerics.quant.recipes_int4 import pack_int4_to_int32

ATTN = "*.self_attn.*_proj.weight"
# vLLM CPU's AVX2 build has no W4A16 kernel (cpu_gemm_wna16): the engine tests skip there, naming it
_NO_W4A16 = missing_kernel_reason("w4a16")
needs_w4a16 = pytest.mark.skipif(_NO_W4A16 is not None, reason=str(_NO_W4A16))


@pytest.fixture(scope="module")
def int4_dir(qwen_moe_dir, tmp_path_factory):
    from skyrl_numerics.engine.serving_checkpoint import write_int4_checkpoint

    return write_int4_checkpoint(qwen_moe_dir, out_dir=tmp_path_factory.mktemp("int4") / "ckpt")


def test_int4_checkpoint_is_quantize_bitwise(qwen_moe_dir, int4_dir):
    from safetensors.torch import load_file

    base = load_file(str(qwen_moe_dir / "model.safetensors"))
    q = load_file(str(int4_dir / "model.safetensors"))
    qc = json.loads((int4_dir / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "lm_head" in qc["ignore"] and "model.layers.0.mlp.gate" in qc["ignore"]
    assert "model.layers.0.mlp.experts.0.gate_proj" in qc["ignore"]
    n = 0
    for k, w in base.items():
        if ".self_attn." in k and k.endswith("_proj.weight"):
            ref = quantize(w, "int4_g32")
            assert torch.equal(q[k + "_packed"], pack_int4_to_int32(ref.codes)), k
            assert torch.equal(q[k + "_scale"].view(torch.int16), ref.scales.view(torch.int16)), k
            assert k not in q
            n += 1
        else:
            assert torch.equal(q[k].view(torch.uint8), w.view(torch.uint8)), k
    assert n == 8   # 2 layers x q/k/v/o


def test_matched_trainer_holds_the_checkpoint_grid(qwen_moe_dir, int4_dir):
    """The doctor's "+ fake-quant matched" trainer: apply_qat with int4_qat_spec() rules covers
    exactly the quantized projections, and fake_quant of the bf16 weight is the dequantized
    checkpoint (bf16), bitwise."""
    from safetensors.torch import load_file

    from skyrl_numerics.quant import dequantize, fake_quant
    from skyrl_numerics.quant.checkpoint import load_qtensors
    from skyrl_numerics.engine.serving_checkpoint import int4_qat_spec, qat_rules

    rules = qat_rules(int4_qat_spec())
    assert [(r.pattern, r.recipe) for r in rules] == [("*.self_attn.*_proj", "int4_g32")]
    assert len(qat_rules(int4_qat_spec(experts=True))) == 2
    base = load_file(str(qwen_moe_dir / "model.safetensors"))
    qts = load_qtensors(int4_dir)
    assert len(qts) == 8
    for name, q in qts.items():
        assert torch.equal(dequantize(q, torch.bfloat16).view(torch.int16),
                           fake_quant(base[name], "int4_g32").view(torch.int16)), name


def test_experts_int4_refused_is_documented():
    """The finding above, checked against vLLM's own source (no engine start)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4
    from vllm.model_executor.layers.quantization.utils.quant_utils import kInt4Static

    assert CPUExpertsInt4._supports_quant_scheme(kInt4Static, None)
    assert kInt4Static.scale.group_shape[1] == -1      # per channel only: group-32 is not accepted


@pytest.fixture(scope="module")
def int4_engine(int4_dir):
    pytest.importorskip("vllm")
    from skyrl_numerics.trainer import VLLMGenerator

    gen = VLLMGenerator(int4_dir)
    yield gen
    gen.close()


PROMPTS = [[(7 * i + j) % 500 + 2 for j in range(8)] for i in range(4)]


@pytest.mark.vllm
@needs_w4a16
def test_engine_runs_int4_kernel(int4_engine):
    from skyrl_numerics.host import assumed_build, vllm_capabilities
    from skyrl_numerics.engine.weight_update import engine_linear_kernels

    if assumed_build() is None:   # the worker loaded the build the detector names (vLLM's choice)
        assert int4_engine.engine_host["vllm_build_loaded"] == vllm_capabilities()["build"]

    k = engine_linear_kernels(int4_engine)
    for layer in (0, 1):
        for proj in ("qkv_proj", "o_proj"):
            assert k[f"model.layers.{layer}.self_attn.{proj}"] == "CompressedTensorsWNA16 / CPUWNA16LinearKernel"
    assert not any(".experts" in name for name in k)


@pytest.mark.vllm
@needs_w4a16
def test_fake_quant_matched_trainer_closes_the_int4_gap(qwen_moe_dir, int4_engine):
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.quant import apply_qat
    from skyrl_numerics.engine.serving_checkpoint import int4_qat_spec, qat_rules
    from skyrl_numerics.trainer.logprobs import trainer_logprobs

    r = int4_engine.generate(PROMPTS, max_tokens=16)
    plain = trainer_logprobs(load_hf_model(qwen_moe_dir), r).logprobs
    m = load_hf_model(qwen_moe_dir)
    apply_qat(m, qat_rules(int4_qat_spec()))
    matched = trainer_logprobs(m, r).logprobs
    gap_plain = float(np.abs(plain - r.rollout_logprobs).mean())
    gap_matched = float(np.abs(matched - r.rollout_logprobs).mean())
    print(f"INT4 engine: plain trainer mean|d| {gap_plain:.3g}, fake-quant matched {gap_matched:.3g}")
    assert gap_matched < gap_plain


@pytest.mark.vllm
@needs_w4a16
def test_in_place_int4_update_matches_fresh_engine(qwen_moe_dir, int4_engine, tmp_path):
    """bf16 weights -> ct_int4 publisher (codes + scales, deltas) -> receiver -> engine in place;
    the engine then holds and computes exactly what a fresh engine on the same checkpoint does."""
    import shutil

    from safetensors.torch import load_file, save_file

    from skyrl_numerics.trainer import VLLMGenerator
    from skyrl_numerics.engine.serving_checkpoint import write_int4_checkpoint
    from skyrl_numerics.engine.weight_update import engine_weight_digest, update_vllm_weights
    from skyrl_numerics.sync.weight_sync import DeltaPublisher, DeltaReceiver

    s0 = load_file(str(qwen_moe_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    s1 = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) if v.dim() >= 2 else v
          for k, v in s0.items()}
    pub = DeltaPublisher(tmp_path / "sync", weights_format="ct_int4", quantize=[ATTN])
    rec = DeltaReceiver(tmp_path / "sync", weights_format="ct_int4")
    pub.publish(s0)
    m1 = pub.publish(s1)
    assert not m1.is_full
    rec.sync()
    update_vllm_weights(int4_engine, rec.state)
    dig_a = engine_weight_digest(int4_engine)
    ra = int4_engine.generate(PROMPTS, max_tokens=16)

    new_dir = tmp_path / "new"
    new_dir.mkdir()
    save_file({k: v.contiguous() for k, v in s1.items()}, str(new_dir / "model.safetensors"))
    for f in qwen_moe_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy2(f, new_dir / f.name)
    fresh_dir = write_int4_checkpoint(new_dir, out_dir=tmp_path / "new-int4")
    on_disk = load_file(str(fresh_dir / "model.safetensors"))
    assert set(on_disk) == set(rec.state)
    assert all(torch.equal(on_disk[k].view(torch.uint8), rec.state[k].contiguous().view(torch.uint8))
               for k in on_disk)
    fresh = VLLMGenerator(fresh_dir)
    try:
        dig_b = engine_weight_digest(fresh)
        rb = fresh.generate(PROMPTS, max_tokens=16)
    finally:
        fresh.close()
    diff = sorted(k for k in dig_b if dig_a.get(k) != dig_b[k])
    assert not diff, diff[:5]
    assert np.array_equal(ra.response_tokens, rb.response_tokens)
    assert np.array_equal(ra.rollout_logprobs.view(np.uint32), rb.rollout_logprobs.view(np.uint32))
