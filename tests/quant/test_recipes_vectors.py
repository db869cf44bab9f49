"""Hand-computed vectors per recipe and convention: all-zero blocks, an amax on a rounding tie,
inf input, and the documented conventions' differences."""
import math

import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.quant import codecs as C
from skyrl_numerics.quant import dequantize, fake_quant, quantize

NAN = float("nan")
INF = float("inf")


def u8(t):
    return t.view(torch.uint8).tolist()


# ------------------------------------------------------------------------------------------- fp8
def test_fp8_tensor_zero_tie_inf():
    q = quantize(torch.zeros(2, 4), "fp8_tensor")
    assert q.scales.item() == pytest.approx(1 / (448 * 512), rel=0) and set(sum(u8(q.codes), [])) == {0}
    # amax 448*2 -> s = 2; 9 / 2 = 4.5 is the tie between 4 and 5 (quantum 0.5 at [4, 8)) -> 4.5 exact;
    # 9.5/2 = 4.75 is the tie between 4.5 and 5.0 -> even mantissa (4.5 = 1.001b*4, 5.0 = 1.010b*4) -> 5.0
    x = torch.tensor([[896.0, 9.0, 9.5, -0.0]])
    q = quantize(x, "fp8_tensor")
    assert q.scales.item() == 2.0
    assert C.decode(q.codes.view(torch.uint8), "e4m3fn").tolist() == [[448.0, 4.5, 5.0, -0.0]]
    # inf input: s = inf, finite elements -> +-0, the inf element -> NaN (vLLM behaviour)
    q = quantize(torch.tensor([[INF, 1.0, -2.0]]), "fp8_tensor")
    assert math.isinf(q.scales.item()) and u8(q.codes)[0][1:] == [0x00, 0x80]
    assert u8(q.codes)[0][0] & 0x7F == 0x7F                  # NaN (inf * 0 has the sign bit set on x86)


def test_fp8_token_scale_ub_and_floor():
    x = torch.tensor([[1000.0, 10.0], [0.0, 0.0]])
    q = quantize(x, "fp8_token", scale_ub=448.0)
    assert q.scales[0, 0].item() == 1.0 and q.scales[1, 0].item() == pytest.approx(1 / (448 * 512), rel=1e-7)
    assert C.decode(q.codes.view(torch.uint8), "e4m3fn")[0].tolist() == [448.0, 10.0]   # saturated


def test_fp8_channel_zero_row_gets_eps():
    q = quantize(torch.tensor([[0.0, 0.0], [448.0, -1.0]]), "fp8_channel")
    assert q.scales[:, 0].tolist() == [torch.finfo(torch.float32).eps, 1.0]


def test_fp8_block_eps_ue8m0_and_tie():
    x = torch.zeros(1, 256)
    x[0, 128] = 448.0 * 3            # block 1: amax 1344 -> s = 1344 * fp32(1/448)
    q = quantize(x, "fp8_block")
    assert q.scales[0, 0].item() == pytest.approx(1e-10 * (1 / 448), rel=1e-6)
    assert q.scales[0, 1].item() == (torch.tensor(1344.0) * torch.tensor(1 / 448.0)).item()
    qu = quantize(x, "fp8_block", ue8m0=True)
    assert qu.scales[0, 1].item() == 4.0                     # 3 -> next power of two
    # 1344 / 4 = 336 is the E4M3 tie between 320 (1.010b * 2^8) and 352 (1.011b * 2^8) -> 320
    assert C.decode(qu.codes.view(torch.uint8)[0, 128:129], "e4m3fn").item() == 320.0
    # ue8m0 rounds up exactly: a scale one fp32 ulp above 2^k goes to 2^(k+1)
    from skyrl_numerics.quant.recipes_fp8 import ceil_pow2
    assert ceil_pow2(torch.tensor([1.0 + 2 ** -23, 1.0, 0.75, 0.0])).tolist() == [2.0, 1.0, 1.0, 0.0]
    w = torch.ones(256, 256)
    assert quantize(w, "fp8_block", block=(128, 128)).scales.shape == (2, 2)


# -------------------------------------------------------------------------------------------- MX
def test_mx_floor_vs_rceil_on_a_power_of_two_boundary():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 4.0, 3.0
    q = quantize(x, "mxfp4")                                 # floor(log2 4) - 2 = 0 -> X = 1
    assert u8(q.scales) == [[127]]
    assert C.decode(C.unpack_fp4(q.codes), "e2m1")[0, :2].tolist() == [4.0, 3.0]
    x[0, 0] = 3.9990234375                                   # just below 4: X = 0.5, 7.998 saturates to 6
    q = quantize(x, "mxfp4")
    assert u8(q.scales) == [[126]] and dequantize(q)[0, :2].tolist() == [3.0, 3.0]
    q = quantize(x, "mxfp4", scale_mode="rceil")             # 3.999/6 -> 2^0 -> X = 1
    assert u8(q.scales) == [[127]] and dequantize(q)[0, :2].tolist() == [4.0, 3.0]
    # mxfp8 floor saturates the top of a block: amax 3.93 -> X = 2^-7, 503 -> 448
    y = torch.zeros(1, 32)
    y[0, 0] = 3.93
    assert dequantize(quantize(y, "mxfp8"))[0, 0].item() == 3.5
    # rceil: 3.93/448 -> X = 2^-6, 251.52 -> 256 (grid step 16 in [128, 256)) -> 4.0
    assert dequantize(quantize(y, "mxfp8", scale_mode="rceil"))[0, 0].item() == 4.0


def test_mx_zero_nan_inf_blocks():
    x = torch.zeros(3, 32)
    x[1, 5] = NAN
    x[2, 0], x[2, 1] = INF, 1.0
    for mode in ("floor", "rceil"):
        q = quantize(x, "mxfp8", scale_mode=mode)
        b = u8(q.scales)
        assert b[0] == [0] and b[1] == [255]
        assert b[2] == ([247] if mode == "floor" else [254])
        d = dequantize(q)
        assert (d[0] == 0).all() and torch.isnan(d[1]).all()
        assert d[2, 0].item() == INF and d[2, 1].item() == 0.0   # 448 * 2^120 overflows fp32
    q = quantize(x, "mxfp4")
    assert torch.isnan(dequantize(q)[1]).all()


def test_mx_e5m2_elements():
    x = torch.zeros(1, 32)
    x[0, 0] = 57344.0 * 1.9                                  # floor: X = 2^(16 - 15) = 2, 1.9*57344/2*2 ...
    q = quantize(x, "mxfp8", elem="e5m2")
    assert q.codes.dtype == torch.float8_e5m2
    assert dequantize(q)[0, 0].item() == 57344.0 * 2         # 54476.8 rounds to 57344 at X = 2


# ----------------------------------------------------------------------------------------- NVFP4
@pytest.mark.parametrize("conv,zero_scale", [("vllm", 0.0), ("te", 0.0), ("modelopt", 1.0), ("torchao", 2.0 ** -6),
                                             ("compressed_tensors", 0.125)])
def test_nvfp4_zero_block_per_convention(conv, zero_scale):
    x = torch.zeros(1, 32)
    x[0, 16:] = torch.linspace(-3, 3, 16)
    q = quantize(x, "nvfp4", convention=conv)
    s = C.decode(q.scales.view(torch.uint8), "e4m3fn")
    assert s[0, 0].item() == zero_scale
    assert (dequantize(q)[0, :16] == 0).all()


def test_nvfp4_tie_amax_te_static_global():
    # A = 2688 -> S_enc = 1. Block amax 6.375: 6.375/6 = 1.0625 is the E4M3 tie between 1.0 and 1.125
    # -> 1.0 (even); then 6.375 -> clamp 6; 5.0 is the E2M1 tie between 4 and 6 -> 4; 0.25 -> 0.
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([6.375, 5.0, 0.25, -0.75])
    q = quantize(x, "nvfp4", convention="te", global_amax=2688.0)
    assert C.decode(q.scales.view(torch.uint8), "e4m3fn").item() == 1.0
    assert C.decode(C.unpack_fp4(q.codes), "e2m1")[0, :4].tolist() == [6.0, 4.0, 0.0, -1.0]
    # dequant: y * fl(fl(s*A) * fp32(1/2688)) = y * 1
    assert dequantize(q)[0, :4].tolist() == [6.0, 4.0, 0.0, -1.0]


def test_nvfp4_tiny_block_floor_differs_torchao_vs_modelopt():
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0                                         # A = 2688 -> g = 1
    x[0, 16] = 6 * 2.0 ** -9                                 # block amax/6 = 2^-9: the smallest E4M3 subnormal
    s_mo = C.decode(quantize(x, "nvfp4", convention="modelopt").scales.view(torch.uint8), "e4m3fn")
    s_ao = C.decode(quantize(x, "nvfp4", convention="torchao").scales.view(torch.uint8), "e4m3fn")
    assert s_mo[0, 1].item() == 2.0 ** -9 and s_ao[0, 1].item() == 2.0 ** -6
    assert fake_quant(x, "nvfp4", convention="modelopt")[0, 16].item() == 6 * 2.0 ** -9
    # torchao: 6*2^-9 / 2^-6 = 0.75, the E2M1 tie between 0.5 and 1.0 -> 1.0 -> 2^-6
    assert fake_quant(x, "nvfp4", convention="torchao")[0, 16].item() == 2.0 ** -6


def test_nvfp4_inf_with_static_global_saturates_its_block():
    x = torch.ones(1, 32)
    x[0, 3] = INF
    for conv in ("vllm", "te", "modelopt", "torchao"):
        q = quantize(x, "nvfp4", convention=conv, global_amax=8.0)
        d = dequantize(q)
        assert math.isfinite(d[0, 3].item()) and d[0, 3].item() > 0, conv
        assert torch.equal(d[0, 16:], fake_quant(torch.ones(1, 16), "nvfp4", convention=conv, global_amax=8.0)[0]), conv


def test_nvfp4_2d_tiles_share_one_scale():
    w = torch.zeros(32, 32)
    w[0, 0] = 6.0
    w[15, 15] = 1.0
    q = quantize(w, "nvfp4", convention="te", tile=(16, 16))
    assert q.scales.shape == (2, 2)
    assert dequantize(q)[15, 15].item() == 1.0
    with pytest.raises(InputError):
        quantize(torch.zeros(2, 16, 16), "nvfp4", tile=(16, 16))


def test_nvfp4_all_zero_tensor():
    for conv in ("vllm", "te", "modelopt", "torchao"):
        q = quantize(torch.zeros(2, 16), "nvfp4", convention=conv)
        assert (dequantize(q) == 0).all() and not torch.isnan(dequantize(q)).any()


# ------------------------------------------------------------------------------------------ INT4
def test_int4_ties_zero_group_and_nan():
    w = torch.zeros(2, 32)
    w[1, :5] = torch.tensor([7.5, 2.5, -3.5, -7.5, 0.5])    # s = 1.0 exactly
    q = quantize(w, "int4_g32")
    assert q.scales[:, 0].tolist() == [2.0 ** -23, 1.0]      # fp32 eps for the zero group
    assert q.codes[1, :5].tolist() == [7, 2, -4, -8, 0]      # clamp, RNE ties to even
    assert dequantize(q)[1, :5].tolist() == [7.0, 2.0, -4.0, -8.0, 0.0]
    with pytest.raises(InputError, match="NaN"):
        quantize(torch.tensor([[NAN] + [1.0] * 31]), "int4_g32")
    with pytest.raises(InputError, match="NaN"):             # inf makes s = inf, inf / inf = NaN
        quantize(torch.tensor([[INF] + [1.0] * 31]), "int4_g32")


# ------------------------------------------------------------------------------------ bad input
def test_bad_input_errors_name_the_field():
    with pytest.raises(InputError, match="recipe"):
        quantize(torch.ones(4), "fp9")
    with pytest.raises(InputError, match="no option"):
        quantize(torch.ones(4), "fp8_tensor", block=3)
    with pytest.raises(InputError, match="convention"):
        quantize(torch.ones(16), "nvfp4", convention="xx")
    with pytest.raises(InputError, match="scale"):
        quantize(torch.ones(4), "fp8_tensor", scale=-1.0)
    with pytest.raises(InputError, match="even"):
        quantize(torch.ones(3), "mxfp4")


@pytest.mark.parametrize("conv,expect", [("vllm", 0.078125), ("te", 0.0703125), ("modelopt", 0.0703125),
                                         ("torchao", 0.0703125), ("compressed_tensors", 0.0703125)])
def test_nvfp4_block_amax_on_a_scale_tie_splits_the_conventions(conv, expect):
    # Global amax 2688 -> every convention's global is exactly 1. Block amax a = 0.44531247f:
    # fl(a / 6) = 0.074218743 (just below the E4M3 tie 0.07421875 -> 0.0703125), but vLLM's
    # a * fp32(1/6) = 0.07421875 lands exactly on the tie -> even mantissa -> 0.078125.
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0
    x[0, 16] = 0.4453124701976776
    q = quantize(x, "nvfp4", convention=conv)
    assert C.decode(q.scales.view(torch.uint8), "e4m3fn")[0, 1].item() == expect
