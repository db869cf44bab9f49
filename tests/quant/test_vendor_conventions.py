"""The ``torchao`` / ``modelopt`` NVFP4 conventions and the MX FLOOR scale, bitwise against the vendors'
own functions (torchao 0.18.0, nvidia-modelopt 0.47.0: installed by the Makefile with --no-deps;
see tests/quant/quant_vendors.py for how modelopt's quantization files are loaded without its package
imports). Compared: E2M1 codes (packed bytes), E4M3 / E8M0 scale bytes, the global scale and the
dequantized values (bit patterns), for float32 and bfloat16 inputs."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.quant import codecs as C
from skyrl_numerics.quant import dequantize, quantize

from quant_vendors import modelopt_qtensors, torchao_mx

DTYPES = [torch.float32, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.dtype.itemsize])


def _data(shape, seed=0, dtype=torch.float32, amax_row=None):
    """Random rows of very different magnitudes + the hard cases in the first rows/blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 2)
    x2 = x.reshape(-1, shape[-1])
    x2[0, :16] = 0                                                      # zero block
    if shape[-1] >= 32:
        x2[0, 16:32] = torch.tensor([6.375, 5.0, 0.25, -0.75, 2.5, -3.5, 1e-30, -0.0,
                                     1.25, -1.75, 3.0, 0.5, -6.0, 4.0, 0.0, -1e-3])  # ties, tiny, -0
    if x2.shape[0] > 1:
        x2[1, :16] *= 1e-6                                              # tiny block scale (below 2^-9)
    if x2.shape[0] > 2:
        x2[2, :] = x2[2, :].abs().max() * torch.linspace(-1, 1, shape[-1])
    return x.to(dtype)


# ------------------------------------------------------------------------------------- NVFP4 torchao
def _torchao_ref(x, per_tensor_scale):
    ao = torchao_mx()
    s, packed = ao.nvfp4_quantize(x.contiguous(), 16, per_tensor_scale)
    t = ao.NVFP4Tensor.to_nvfp4(x.contiguous(), 16, per_tensor_scale)
    return s, packed, t.dequantize(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_nvfp4_torchao_matches_nvfp4_quantize(dtype, static):
    ao = torchao_mx()
    x = _data((48, 256), seed=1, dtype=dtype)
    amax = x.float().abs().amax()
    A = amax * 0.25 if static else amax                                  # static: calibrated amax < data (saturation)
    g = ao.per_tensor_amax_to_scale(A)
    s_ref, packed_ref, deq_ref = _torchao_ref(x, g)
    q = quantize(x, "nvfp4", convention="torchao", global_amax=A)
    assert torch.equal(q.global_scale, g)
    assert torch.equal(q.scales.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(q.codes, packed_ref)
    assert torch.equal(_bits(dequantize(q)), _bits(deq_ref))
    # the stored global given back (global_scale=) re-encodes the same
    q2 = quantize(x, "nvfp4", convention="torchao", global_scale=g)
    assert torch.equal(q2.codes, q.codes) and torch.equal(q2.scales.view(torch.uint8), q.scales.view(torch.uint8))


def test_nvfp4_torchao_single_level_is_global_one():
    """torchao without a per-tensor scale (x * fl(1/s)) is the convention with g = 1."""
    x = _data((16, 128), seed=2) * 1e-2
    s_ref, packed_ref, _ = _torchao_ref(x, None)
    q = quantize(x, "nvfp4", convention="torchao", global_scale=1.0)
    assert torch.equal(q.scales.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(q.codes, packed_ref)


def test_nvfp4_torchao_3d_expert_stack():
    ao = torchao_mx()
    x = _data((4, 32, 64), seed=3, dtype=torch.bfloat16)
    g = ao.per_tensor_amax_to_scale(x.float().abs().amax())
    s_ref, packed_ref, deq_ref = _torchao_ref(x, g)
    q = quantize(x, "nvfp4", convention="torchao", global_scale=g)
    assert torch.equal(q.codes, packed_ref.reshape(q.codes.shape))
    assert torch.equal(q.scales.view(torch.uint8).reshape(-1), s_ref.view(torch.uint8).reshape(-1))
    assert torch.equal(_bits(dequantize(q)), _bits(deq_ref))


def _near_midpoints(g: float, rows: int = 8) -> torch.Tensor:
    """Blocks whose elements sit 0..3 float32 ulps either side of E2M1 rounding midpoints times the
    block's dequant factor fl(g*s): where dividing and multiplying by a reciprocal disagree."""
    out = []
    for r in range(rows):
        x = torch.zeros(7, 16)
        x[:, 0] = g * 2688 * (0.05 + 0.95 * r / rows)                    # block amax -> scale s
        s = C.decode(quantize(x[:1], "nvfp4", convention="torchao", global_scale=g).scales.view(torch.uint8),
                     "e4m3fn")[0, 0]
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * (torch.tensor(g) * s)
        for i, k in enumerate(range(-3, 4)):
            c = mids.clone()
            for _ in range(abs(k)):
                c = torch.nextafter(c, torch.full_like(c, float("inf") if k > 0 else 0.0))
            x[i, 1:8], x[i, 8:15] = c, -c
        out.append(x)
    return torch.cat(out)


def test_nvfp4_torchao_old_release_divides():
    """torchao < 0.17 divided by fl(g*s) (read from the 0.16.0 wheel); 0.17+ multiplies by
    fl(fl(1/g)/s). Same scales; near E2M1 midpoints the codes differ, and torchao 0.18 agrees with
    ``torchao``, not ``torchao<0.17``."""
    g = 0.0009847743203863502
    x = _near_midpoints(g)
    gs = torch.tensor(g)
    new = quantize(x, "nvfp4", convention="torchao", global_scale=gs)
    old = quantize(x, "nvfp4", convention="torchao<0.17", global_scale=gs)
    assert torch.equal(new.scales.view(torch.uint8), old.scales.view(torch.uint8))
    s_ref, packed_ref, deq_ref = _torchao_ref(x, gs)
    assert torch.equal(new.codes, packed_ref)
    assert torch.equal(_bits(dequantize(new)), _bits(deq_ref))
    assert int((old.codes != packed_ref).sum()) > 0


# ------------------------------------------------------------------------------------ NVFP4 modelopt
def _modelopt_ref(x, wsf2=None):
    mo = modelopt_qtensors()
    qt, s, s2 = mo.NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=wsf2)
    return qt, s, s2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_nvfp4_modelopt_matches_nvfp4qtensor(dtype, static):
    x = _data((48, 256), seed=5, dtype=dtype)
    amax = x.float().abs().amax()
    wsf2 = (amax * 0.25 / 2688.0).float() if static else None            # static: block scales saturate at 448
    qt, s_ref, s2_ref = _modelopt_ref(x, wsf2)
    q = quantize(x, "nvfp4", convention="modelopt", **({"global_scale": wsf2} if static else {}))
    assert torch.equal(q.global_scale, s2_ref.float().reshape(()))
    assert torch.equal(q.scales.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(q.codes, qt._quantized_data)
    deq_ref = qt.dequantize(dtype, scale=s_ref, double_scale=s2_ref, block_sizes={-1: 16})
    assert torch.equal(_bits(dequantize(q)), _bits(deq_ref))             # includes code 0b1000 -> +0


def test_nvfp4_modelopt_tiny_block_clamps_to_2m9():
    """modelopt >= 0.45 clamps the block scale to [2^-9, 448] before the E4M3 cast; < 0.45 let a
    block with s_hp <= 2^-10 get scale 0."""
    x = torch.zeros(1, 48)
    x[0, 0] = 2688.0                                                     # g = 1
    x[0, 16] = 6 * 2.0 ** -12                                            # s_hp = 2^-12 -> 0 (old) / 2^-9 (new)
    x[0, 32:48] = torch.linspace(-6 * 2.0 ** -11, 6 * 2.0 ** -11, 16)
    qt, s_ref, _ = _modelopt_ref(x)
    q = quantize(x, "nvfp4", convention="modelopt")
    assert torch.equal(q.scales.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(q.codes, qt._quantized_data)
    s = C.decode(q.scales.view(torch.uint8), "e4m3fn")[0]
    assert s[1].item() == 2.0 ** -9 and s[2].item() == 2.0 ** -9
    old = C.decode(quantize(x, "nvfp4", convention="modelopt<0.45").scales.view(torch.uint8), "e4m3fn")[0]
    assert old[1].item() == 0.0
    mo = modelopt_qtensors()
    assert mo.cast_per_block_scale_to_fp8(torch.tensor([2.0 ** -12])).float().item() == 2.0 ** -9


def test_nvfp4_modelopt_decodes_code_8_as_positive_zero():
    """E2M1 code 0b1000 is -0 in the spec (and vLLM); modelopt's table gives +0. Our modelopt
    dequantization follows modelopt; the spec decoder (codecs.decode) keeps -0."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, -0.1                                         # -0.1 / 1 rounds to code 0b1000
    q = quantize(x, "nvfp4", convention="modelopt", global_scale=1 / 448)
    assert C.unpack_fp4(q.codes)[0, 1].item() == 8
    assert C.decode(torch.tensor([8], dtype=torch.uint8), "e2m1").item() == 0.0
    assert torch.signbit(C.decode(torch.tensor([8], dtype=torch.uint8), "e2m1")).item()
    d = dequantize(q)[0, 1]
    assert d.item() == 0.0 and not torch.signbit(d).item()
    qt, s_ref, s2_ref = _modelopt_ref(x, torch.tensor(1 / 448))
    ref = qt.dequantize(torch.float32, scale=s_ref, double_scale=s2_ref, block_sizes={-1: 16})
    assert not torch.signbit(ref[0, 1]).item()


def test_nvfp4_modelopt_ragged_last_dim():
    """modelopt zero-pads the last dim to a block multiple, as we do (codes compared on the real part)."""
    x = _data((8, 40), seed=6)
    qt, s_ref, s2_ref = _modelopt_ref(x)
    q = quantize(x, "nvfp4", convention="modelopt")
    assert torch.equal(q.global_scale, s2_ref.reshape(()))
    assert torch.equal(q.scales.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(q.codes, qt._quantized_data[:, :20])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 6), seed=st.integers(0, 2**16),
       bf16=st.booleans(), log_scale=st.floats(-30, 30), static=st.sampled_from([None, 0.1, 1.0, 7.0]))
def test_nvfp4_vendor_conventions_hypothesis(rows, blocks, seed, bf16, log_scale, static):
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, blocks * 16, generator=g) * torch.exp(torch.randn(rows, blocks, 1, generator=g) * 3)
         .expand(rows, blocks, 16).reshape(rows, -1) * 2.0 ** log_scale).to(dtype)
    amax = x.float().abs().amax()
    if amax == 0:
        return
    A = amax if static is None else amax * static
    ao = torchao_mx()
    gs = ao.per_tensor_amax_to_scale(A)
    s_ref, packed_ref, deq_ref = _torchao_ref(x, gs)
    q = quantize(x, "nvfp4", convention="torchao", global_scale=gs)
    assert torch.equal(q.scales.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(q.codes, packed_ref)
    assert torch.equal(_bits(dequantize(q)), _bits(deq_ref))
    wsf2 = (A / 2688.0).float().reshape(())
    qt, s_mo, s2_mo = _modelopt_ref(x, wsf2)
    q = quantize(x, "nvfp4", convention="modelopt", global_scale=wsf2)
    assert torch.equal(q.scales.view(torch.uint8), s_mo.view(torch.uint8))
    assert torch.equal(q.codes, qt._quantized_data)
    deq_mo = qt.dequantize(dtype, scale=s_mo, double_scale=s2_mo, block_sizes={-1: 16})
    assert torch.equal(_bits(dequantize(q)), _bits(deq_mo))


# ---------------------------------------------------------------------------------------- MX FLOOR
MX_CASES = [("mxfp8", {"elem": "e4m3fn"}, torch.float8_e4m3fn), ("mxfp8", {"elem": "e5m2"}, torch.float8_e5m2),
            ("mxfp4", {}, "fp4")]


def _to_mx(x, elem, mode):
    ao = torchao_mx()
    el = torch.float4_e2m1fn_x2 if elem == "fp4" else elem
    s, data = ao.to_mx(x.contiguous(), el, 32, getattr(ao.ScaleCalculationMode, mode))
    deq = ao.to_dtype(data, s, el, 32, x.dtype)
    codes = data.view(torch.uint8)
    return s.view(torch.uint8), codes, deq


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(MX_CASES)), ids=[f"{r}-{e}" for r, _, e in MX_CASES])
def test_mx_floor_matches_torchao_on_normal_scales(case, dtype):
    recipe, opts, elem = MX_CASES[case]
    x = _data((32, 256), seed=7, dtype=dtype)
    s_ref, c_ref, deq_ref = _to_mx(x, elem, "FLOOR")
    q = quantize(x, recipe, **opts)
    assert (q.scales.view(torch.uint8) > 0).all()                       # no subnormal-scale block here
    assert torch.equal(q.scales.view(torch.uint8), s_ref)
    assert torch.equal(q.codes.view(torch.uint8), c_ref.reshape(q.codes.shape))
    assert torch.equal(_bits(dequantize(q)), _bits(deq_ref.reshape(x.shape)))


def test_mx_rceil_matches_torchao_off_powers_of_two():
    x = _data((32, 256), seed=8)
    s_ref, c_ref, _ = _to_mx(x, torch.float8_e4m3fn, "RCEIL")
    q = quantize(x, "mxfp8", scale_mode="rceil")
    assert torch.equal(q.scales.view(torch.uint8), s_ref)
    assert torch.equal(q.codes.view(torch.uint8), c_ref)


def test_mx_floor_subnormal_scale_follows_spec_not_torchao():
    """A block whose E8M0 scale is 2^-127 (code 0): OCP MX v1.0 encodes and decodes with the same X;
    torchao 0.18 encodes with 2^-126 (its F32_MIN_NORMAL clamp) and decodes with 2^-127, so its
    round trip halves the block. Same code 0, different element codes."""
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-1, 1, 32) * 2.0 ** -120                 # E(amax) - 127 - 8 < -127 -> code 0
    x[0, 32:] = torch.linspace(-1, 1, 32)
    s_ref, c_ref, deq_ref = _to_mx(x, torch.float8_e4m3fn, "FLOOR")
    q = quantize(x, "mxfp8")
    assert s_ref[0, 0].item() == 0 and q.scales.view(torch.uint8)[0, 0].item() == 0
    ours = dequantize(q)
    assert torch.equal(ours[0, 32:], deq_ref[0, 32:])                   # normal block: identical
    assert not torch.equal(q.codes.view(torch.uint8)[0, :32], c_ref[0, :32])
    nz = x[0, :32] != 0
    assert torch.equal(deq_ref[0, :32][nz] * 2, C.decode(c_ref[0, :32], "e4m3fn")[nz] * 2.0 ** -126)
    # ours: the element codes are x / 2^-127 rounded, decoded with the same 2^-127
    assert torch.equal(ours[0, :32], C.decode(C.encode(x[0, :32] * 2.0 ** 127, "e4m3fn"), "e4m3fn") * 2.0 ** -127)
    assert (ours[0, :32] - x[0, :32]).abs().max() < (deq_ref[0, :32] - x[0, :32]).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_modelopt_near_midpoints(dtype):
    x = _near_midpoints(0.0009847743203863502).to(dtype)
    g = (x.float().abs().amax() / 2688.0).reshape(())
    qt, s_ref, s2_ref = _modelopt_ref(x, g)
    q = quantize(x, "nvfp4", convention="modelopt", global_scale=g)
    assert torch.equal(q.scales.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(q.codes, qt._quantized_data)
