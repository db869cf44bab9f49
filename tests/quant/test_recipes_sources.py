"""Recipes bitwise against independent implementations that run here: vLLM (QuantFP8 native,
ref_nvfp4_quant / dequantize_to_dtype, the MXFP8 torch reference) and compressed-tensors (INT4)."""
import pytest
import torch

from skyrl_numerics.quant import codecs as C
from skyrl_numerics.quant import dequantize, fake_quant, quantize
from skyrl_numerics.quant.recipes_int4 import pack_int4_to_int32, unpack_int4_from_int32

# vLLM / compressed-tensors are imported (their reference functions), the engine is not started
pytest.importorskip("vllm")
pytest.importorskip("compressed_tensors")


def _x(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 2)
    return x.to(dtype)


@pytest.fixture(scope="module")
def vllm_ctx():
    from vllm.config import VllmConfig, set_current_vllm_config
    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_tensor_and_token_match_vllm_quantfp8(vllm_ctx, dtype):
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
    x = _x((64, 512), dtype=dtype)
    for recipe, gs in (("fp8_tensor", GroupShape.PER_TENSOR), ("fp8_token", GroupShape.PER_TOKEN)):
        ref_q, ref_s = QuantFP8(static=False, group_shape=gs).forward_native(x)
        q = quantize(x, recipe)
        assert torch.equal(q.codes.view(torch.uint8), ref_q.view(torch.uint8)), recipe
        assert torch.equal(q.scales.reshape(-1), ref_s.reshape(-1).float()), recipe
    static = torch.tensor([0.0123])
    ref_q, _ = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR).forward_native(x, static)
    assert torch.equal(quantize(x, "fp8_tensor", scale=static).codes.view(torch.uint8), ref_q.view(torch.uint8))
    ub = torch.tensor([1.5])
    ref_q, ref_s = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN).forward_native(x, scale_ub=ub)
    q = quantize(x, "fp8_token", scale_ub=1.5)
    assert torch.equal(q.codes.view(torch.uint8), ref_q.view(torch.uint8))


def test_mxfp8_rceil_matches_vllm_torch_reference():
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
        _mxfp8_e4m3_quantize_torch, dequant_mxfp8_to_bf16)
    x = _x((64, 256), seed=1, dtype=torch.bfloat16)
    ref_q, ref_s = _mxfp8_e4m3_quantize_torch(x)
    q = quantize(x, "mxfp8", scale_mode="rceil")
    assert torch.equal(q.scales.view(torch.uint8), ref_s)
    assert torch.equal(q.codes.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(dequantize(q, torch.bfloat16), dequant_mxfp8_to_bf16(ref_q, ref_s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_vllm_matches_ref_nvfp4_quant(dtype):
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype, ref_nvfp4_quant)
    x = _x((32, 256), seed=2, dtype=dtype)
    amax = x.float().abs().amax()
    input_scale = amax / 2688.0                      # modelopt checkpoint input_scale
    g_enc = (1.0 / input_scale).to(torch.float32)    # vLLM input_global_scale_inv
    ref_vals, ref_s = ref_nvfp4_quant(x, g_enc, 16)
    q = quantize(x, "nvfp4", convention="vllm", global_amax=amax)
    ours_vals = C.decode(C.unpack_fp4(q.codes), "e2m1")
    assert torch.equal(ours_vals, ref_vals)          # includes the sign of zero
    assert torch.equal(C.decode(q.scales.view(torch.uint8), "e4m3fn"), ref_s)
    assert torch.equal(q.global_scale, input_scale)
    # weight path: vLLM dequantizes checkpoint weights as e2m1 * (s * weight_scale_2)
    w = dequantize_to_dtype(q.codes, q.scales.view(torch.uint8), q.global_scale, torch.float32, 16, swizzle=False)
    mo = quantize(x, "nvfp4", convention="modelopt", global_amax=amax)
    w_mo = dequantize_to_dtype(mo.codes, mo.scales.view(torch.uint8), mo.global_scale, torch.float32, 16, swizzle=False)
    assert torch.equal(dequantize(mo, torch.float32), w_mo)
    assert w.shape == x.shape


def test_nvfp4_vllm_fake_quant_matches_ref_quant_dequant():
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant_dequant
    x = _x((16, 128), seed=3, dtype=torch.bfloat16)
    amax = x.float().abs().amax()
    g_enc = (1.0 / (amax / 2688.0)).to(torch.float32)
    assert torch.equal(fake_quant(x, "nvfp4", convention="vllm", global_amax=amax), ref_nvfp4_quant_dequant(x, g_enc, 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_matches_compressed_tensors(dtype):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward_helpers import _dequantize, _quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, calculate_range
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    w = _x((64, 256), seed=4, dtype=dtype)
    w[0, :32] = 0                                     # an all-zero group: scale = eps
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    g = w.reshape(64, 8, 32)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    qmin, qmax = calculate_range(args, w.device)
    ref_q = _quantize(g, scale.unsqueeze(-1), None, qmin, qmax, args, dtype=torch.int8).reshape(64, 256)
    q = quantize(w, "int4_g32")
    assert q.scales.dtype == scale.dtype and torch.equal(q.scales, scale)
    assert torch.equal(q.codes, ref_q)
    ref_w = _dequantize(ref_q.reshape(64, 8, 32), scale.unsqueeze(-1)).reshape(64, 256)
    assert torch.equal(dequantize(q), ref_w.to(dtype))
    packed = pack_int4_to_int32(q.codes)
    assert torch.equal(packed, pack_to_int32(q.codes, 4))
    assert torch.equal(unpack_int4_from_int32(packed, 256), q.codes)


def test_nvfp4_compressed_tensors_matches_library():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward_helpers import _dequantize, _quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, calculate_range, generate_gparam
    x = _x((32, 256), seed=5)
    x[0, :16] = 0                                             # zero block: scale 0.125
    x[1, :16] = 1e-7                                          # scale underflows to 0 -> 0.125 too
    x[2, :4] = torch.tensor([-0.0, -1e-9, 0.0, 1e-9])
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
                            scale_dtype=torch.float8_e4m3fn)
    G = generate_gparam(x.amin(), x.amax())
    g = x.reshape(32, 16, 16)
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=G)
    qmin, qmax = calculate_range(args, x.device)
    ref_vals = _quantize(g, scale.unsqueeze(-1), None, qmin, qmax, args, global_scale=G).reshape(32, 256)
    ref_deq = _dequantize(ref_vals.reshape(32, 16, 16), scale.unsqueeze(-1), global_scale=G).reshape(32, 256)
    q = quantize(x, "nvfp4", convention="compressed_tensors")
    assert torch.equal(q.global_scale.reshape(1), G)
    assert torch.equal(C.decode(q.scales.view(torch.uint8), "e4m3fn"), scale.float())
    assert torch.equal(C.decode(C.unpack_fp4(q.codes), "e2m1"), ref_vals)
    assert torch.equal(dequantize(q), ref_deq)
