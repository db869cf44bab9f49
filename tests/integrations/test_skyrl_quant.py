"""Our quant recipes bitwise against SkyRL 0.4.0's own quantizers (``frameworks/skyrl``, conftest):

- ``int4_g32_kimi`` / ``int4_g32`` vs ``fake_int4_quantize_ste(w, 32, 7.0, -7)`` / ``(w, 32, 7.5, -8)``
  (``workers/megatron/quantization/fake_int4_qat.py``): dequantized values, bit patterns, with
  SkyRL's ``-0`` (a negative element of code 0) read as ``+0``, the value a checkpoint's code 0
  decodes to; both counted.
- ``fp8_block`` ``convention="skyrl"`` vs ``blockwise_cast_to_fp8`` and
  ``batched_blockwise_cast_to_fp8`` (``weight_sync/fp8/quantize.py``): E4M3 codes and float32
  scales, bit patterns, FP32 and power-of-two scales.
- ``mxfp8`` ``scale_mode="rceil"`` vs ``mx_cast_to_fp8`` (its torch path, the one CPU runs): equal
  in every block but the two kinds SkyRL's arithmetic rounds otherwise, which the test predicts.

Inputs are hypothesis-drawn: shapes that do not divide the blocks, blocks smaller than the input,
magnitudes over many binades, all-zero groups and groups below the FP8 amax floor (1e-10).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.quant import dequantize, fake_quant, quantize

INT4 = "backends.skyrl_train.workers.megatron.quantization.fake_int4_qat"
FP8 = "backends.skyrl_train.weight_sync.fp8.quantize"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _assert_bitwise(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    diff = _bits(ours) != _bits(ref)
    assert not bool(diff.any()), f"{what}: {int(diff.sum())} of {diff.numel()} differ, first at " \
                                 f"{tuple(diff.nonzero()[0].tolist())}"


@st.composite
def weights(draw, dtype=None, max_rows=40, max_cols=300, col_multiple=1):
    """A weight with rows of very different magnitudes, zero and tiny groups planted (tiny: below
    the FP8 amax floor 1e-10, or down to fp32 subnormals)."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(1, max_rows))
    cols = col_multiple * draw(st.integers(1, max_cols // col_multiple))
    seed = draw(st.integers(0, 2**31 - 1))
    lo = -14 if dtype == torch.float16 else -40
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    w *= torch.exp2(torch.randint(lo, 12, (rows, 1), generator=g).double())
    if draw(st.booleans()):
        w[draw(st.integers(0, rows - 1)), : draw(st.integers(1, cols))] = 0.0
    if draw(st.booleans()):
        r = draw(st.integers(0, rows - 1))
        w[r] *= 1e-4 if dtype == torch.float16 else draw(st.sampled_from([1e-12, 2.0 ** -100, 2.0 ** -128]))
    return w.to(dtype)


# ---------------------------------------------------------------------------------------- INT4
def _neg_zero(t: torch.Tensor) -> torch.Tensor:
    return (t == 0) & torch.signbit(t)


@pytest.mark.parametrize("recipe,divisor,q_min", [("int4_g32_kimi", 7.0, -7.0), ("int4_g32", 7.5, -8.0)])
@settings(max_examples=60, deadline=None)
@given(w=weights(max_cols=200))
def test_int4_equals_skyrl_fake_int4_qat(skyrl, recipe, divisor, q_min, w):
    ref = skyrl(INT4).fake_int4_quantize_ste(w, 32, divisor, q_min)
    q = quantize(w, recipe)
    assert int(q.codes.min()) >= q_min and int(q.codes.max()) <= 7
    for ours, path in ((dequantize(q), "dequantize(quantize)"), (fake_quant(w, recipe), "fake_quant")):
        assert not bool(_neg_zero(ours).any())
        _assert_bitwise(ours, ref + 0.0, f"{recipe} {path} vs SkyRL (-0 read as +0)")
        assert torch.equal(_bits(ours) != _bits(ref), _neg_zero(ref))   # the only other difference


def test_int4_kimi_and_compressed_tensors_grids_differ(skyrl):
    """The counts docs/quant.md quotes: the two grids differ on most elements of a bf16 weight;
    each equals its SkyRL setting, up to SkyRL's -0s."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 1024, generator=g) * 0.02).to(torch.bfloat16)
    kimi = skyrl(INT4).fake_int4_quantize_ste(w, 32, 7.0, -7.0)
    ct = skyrl(INT4).fake_int4_quantize_ste(w, 32, 7.5, -8.0)
    n_diff = int((fake_quant(w, "int4_g32") != kimi).sum())
    assert n_diff == 229_329, n_diff                              # of 262,144
    assert int((fake_quant(w, "int4_g32_kimi") != kimi).sum()) == 0
    assert int((fake_quant(w, "int4_g32") != ct).sum()) == 0
    assert int(_neg_zero(kimi).sum()) == 17_631                  # SkyRL's -0s: value-equal
    codes = quantize(w, "int4_g32_kimi").codes.reshape(256, 32, 32)
    assert bool((codes.abs().amax(-1) == 7).all())               # each group's max-|w| codes to +-7


# ----------------------------------------------------------------------------------------- FP8 block
@settings(max_examples=80, deadline=None)
@given(w=weights(), block=st.sampled_from([(128, 128), (1, 128), (16, 32), (3, 5), (1, 1)]), p2=st.booleans())
def test_fp8_block_skyrl_equals_blockwise_cast_to_fp8(skyrl, w, block, p2):
    ref_q, ref_s = skyrl(FP8).blockwise_cast_to_fp8(w, block, power_2_scale=p2)
    q = quantize(w, "fp8_block", block=block, ue8m0=p2, convention="skyrl")
    _assert_bitwise(q.codes, ref_q, "E4M3 codes")
    _assert_bitwise(q.scales, ref_s, "block scales")
    (R, C), (br, bc) = w.shape, block                           # SkyRL's decode: code * block scale
    s_full = ref_s.repeat_interleave(br, 0)[:R].repeat_interleave(bc, 1)[:, :C]
    _assert_bitwise(dequantize(q), (ref_q.float() * s_full).to(w.dtype), "dequantized")
    _assert_bitwise(fake_quant(w, "fp8_block", block=block, ue8m0=p2, convention="skyrl"), dequantize(q),
                    "fake_quant vs dequantize")


@settings(max_examples=20, deadline=None)
@given(e=st.integers(1, 5), rb=st.integers(1, 3), w=weights(dtype=torch.bfloat16, max_rows=1, max_cols=260))
def test_fp8_block_skyrl_equals_the_batched_expert_cast(skyrl, e, rb, w):
    """``[E, rows, cols]`` experts: SkyRL blocks each expert; ours the [E*rows, cols] view, the
    same blocks when rows is a multiple of the block rows (per expert otherwise: quantize each)."""
    ws = torch.cat([w * (k + 1) for k in range(e * rb * 16)]).reshape(e, rb * 16, -1)
    ref_q, ref_s = skyrl(FP8).batched_blockwise_cast_to_fp8(ws, (16, 32), expert_batch_size=2)
    q = quantize(ws, "fp8_block", block=(16, 32), convention="skyrl")
    _assert_bitwise(q.codes, ref_q, "E4M3 codes")
    _assert_bitwise(q.scales.reshape(ref_s.shape), ref_s, "block scales")


def test_fp8_block_vllm_and_skyrl_scales_differ(skyrl):
    """``amax * fp32(1/448)`` (vLLM) vs ``amax / 448`` (SkyRL): counts quoted in docs/quant.md."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 1024, generator=g) * torch.exp2(torch.randint(-20, 20, (512, 1), generator=g).float()))
    ref_q, ref_s = skyrl(FP8).blockwise_cast_to_fp8(w, (128, 128))
    vllm = quantize(w, "fp8_block", block=(128, 128))
    assert int((_bits(vllm.scales) != _bits(ref_s)).sum()) == 22          # of 32 block scales, 1 ulp
    sky = quantize(w, "fp8_block", block=(128, 128), convention="skyrl")
    assert int((_bits(sky.scales) != _bits(ref_s)).sum()) == 0
    assert int((_bits(sky.codes) != _bits(ref_q)).sum()) == 0


# ------------------------------------------------------------------------------------------- MXFP8
def _skyrl_mx_rounds_otherwise(w: torch.Tensor) -> torch.Tensor:
    """Per 1x32 block: where SkyRL's ``ceil(log2(amax / 448))`` is not ours. (1) float ``log2``
    rounds ``d`` just above ``2^k`` down to ``k``: SkyRL's scale is one binade smaller (the
    hardware's ``cvt.rp`` and our rceil round up). (2) ``d <= 2^-127`` (scale code 0): SkyRL divides
    by ``2^-127``, rceil leaves the elements unscaled (as torchao's RCEIL)."""
    d = w.float().reshape(w.shape[0], -1, 32).abs().amax(-1) / 448.0
    m, e = torch.frexp(d)
    exact = torch.where(m == 0.5, e - 1, e)
    miss = (torch.ceil(torch.log2(d)) != exact) & (d > 2.0 ** -127)
    return miss | ((d <= 2.0 ** -127) & (d > 0))


@settings(max_examples=60, deadline=None)
@given(w=weights(col_multiple=32, max_cols=256))
def test_mxfp8_rceil_equals_mx_cast_to_fp8(skyrl, w):
    ref_codes, ref_scales = skyrl(FP8).mx_cast_to_fp8(w)
    q = quantize(w, "mxfp8", scale_mode="rceil")
    other = _skyrl_mx_rounds_otherwise(w)
    same_blocks = ~other
    assert torch.equal(q.scales.view(torch.uint8)[same_blocks], ref_scales[same_blocks])
    codes = q.codes.view(torch.uint8).reshape(*other.shape, 32)
    ref = ref_codes.view(torch.uint8).reshape(*other.shape, 32)
    assert torch.equal(codes[same_blocks], ref[same_blocks])


def test_mxfp8_the_predicted_blocks_do_differ(skyrl):
    w = torch.zeros(2, 64)
    w[0, :32] = torch.linspace(-1, 1, 32) * 448.0 * 2.0 ** -5 * (1 + 2.0 ** -23)   # log2 rounds down
    w[1, :32] = torch.linspace(-1, 1, 32) * 1e-37                                 # d < 2^-127
    w[1, 32:] = 0.0                                                               # zero block: same
    ref_codes, ref_scales = skyrl(FP8).mx_cast_to_fp8(w)
    q = quantize(w, "mxfp8", scale_mode="rceil")
    other = _skyrl_mx_rounds_otherwise(w)
    assert other.tolist() == [[True, False], [True, False]]
    assert int(q.scales.view(torch.uint8)[0, 0]) == int(ref_scales[0, 0]) + 1
    assert not torch.equal(q.codes.view(torch.uint8)[1, :32], ref_codes.view(torch.uint8)[1, :32])
    assert torch.equal(q.codes.view(torch.uint8)[1, 32:], ref_codes.view(torch.uint8)[1, 32:])
