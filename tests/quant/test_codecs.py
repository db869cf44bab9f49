"""Element codecs bitwise against ml_dtypes (an independent implementation) on every code and on
>= 1e6 values per format: random fp32 bit patterns (NaN, inf, fp32 subnormals), exact ties between
neighbouring codes and their fp32 neighbours, target-format subnormals, +-0 and overflow."""
import ml_dtypes
import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.quant import codecs as C

ML = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn}


def _ml_codes(x: np.ndarray, fmt: str) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return x.astype(ML[fmt]).view(np.uint8) & ((1 << C.FORMATS[fmt].nbits) - 1)


def _stress_values(fmt: C.MiniFloat, n_random: int = 1_000_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=n_random, dtype=np.uint64).astype(np.uint32)
    rand_bits = bits.view(np.float32)                       # every fp32 class incl. NaN/inf/subnormal
    dec = np.array([fmt.code_value(c) for c in range(1 << fmt.nbits)], dtype=np.float64)
    pos = np.unique(dec[np.isfinite(dec) & (dec >= 0)])
    mids = ((pos[1:] + pos[:-1]) / 2).astype(np.float32)   # exact ties (fit in fp32)
    near = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0)),
                           pos.astype(np.float32)])
    span = float(pos[-1])
    in_range = rng.uniform(-1.2 * span, 1.2 * span, size=200_000).astype(np.float32)
    sub = rng.uniform(-2.0 ** fmt.emin, 2.0 ** fmt.emin, size=50_000).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, span, -span, 2 * span, 1e30, -1e30], np.float32)
    return np.concatenate([rand_bits, near, -near, in_range, sub, special])


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e2m1"])
def test_decode_every_code_matches_ml_dtypes(fmt):
    f = C.FORMATS[fmt]
    codes = torch.arange(1 << f.nbits, dtype=torch.uint8)
    ours = C.decode(codes, f).numpy()
    ref = codes.numpy().view(ML[fmt]).astype(np.float32) if f.nbits == 8 else \
        np.array([np.uint8(c) for c in range(16)], np.uint8).view(ML[fmt]).astype(np.float32)
    assert np.array_equal(np.isnan(ours), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(ours[ok].view(np.uint32), ref[ok].view(np.uint32))  # sign of zero too


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_encode_unsaturated_matches_ml_dtypes(fmt):
    f = C.FORMATS[fmt]
    x = _stress_values(f)
    assert x.size >= 1_000_000
    ours = C.encode(torch.from_numpy(x), f, saturate=False).numpy()
    ref = _ml_codes(x, fmt)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], ref[~nan])
    # NaN: a NaN code with the input's sign (ml_dtypes agrees on NaN-ness)
    assert np.isnan(C.decode(torch.from_numpy(ours[nan]), f).numpy()).all()
    assert np.isnan(ref[nan].view(ML[fmt]).astype(np.float32)).all()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e2m1"])
def test_encode_saturated_is_ml_dtypes_of_clamped_input(fmt):
    """Documented choice: overflow and inf saturate to +-max (PTX satfinite / vLLM clamp)."""
    f = C.FORMATS[fmt]
    x = _stress_values(f, seed=1)
    if f.nan_code is None:
        x = x[~np.isnan(x)]
    ours = C.encode(torch.from_numpy(x), f, saturate=True).numpy()
    clamped = np.clip(np.nan_to_num(x, nan=np.nan, posinf=f.max_finite, neginf=-f.max_finite),
                      -f.max_finite, f.max_finite)
    clamped = np.where(np.isnan(x), x, clamped).astype(np.float32)
    ref = _ml_codes(clamped, fmt)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], ref[~nan])
    if f.nan_code is not None:
        assert np.isnan(C.decode(torch.from_numpy(ours[nan]), f).numpy()).all()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e2m1"])
def test_round_to_equals_decode_encode(fmt):
    f = C.FORMATS[fmt]
    x = _stress_values(f, n_random=100_000, seed=2)
    x = x[~np.isnan(x)]
    t = torch.from_numpy(x)
    for sat in (True, False):
        a = C.round_to(t, f, saturate=sat)
        b = C.decode(C.encode(t, f, saturate=sat), f)
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        m = ~torch.isnan(a)
        assert torch.equal(a[m].view(torch.int32), b[m].view(torch.int32))


def test_encode_from_bf16_and_float64_inputs():
    x = torch.randn(4096, dtype=torch.float64) * 100
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        xd = x.to(dt)
        ref = _ml_codes(xd.to(torch.float64).numpy(), "e4m3fn")   # ml_dtypes rounds float64 directly
        assert np.array_equal(C.encode(xd, "e4m3fn", saturate=False).numpy(), ref)


def test_hand_vectors_e4m3_e2m1():
    e4 = C.encode(torch.tensor([464.0, 465.0, 1e9, float("inf"), -0.0, 2.0**-10, 3 * 2.0**-10, 0.0625 + 2.0**-5]), "e4m3fn")
    # 464 is the tie between 448 (mantissa 110) and 480: goes to even = 448; 2^-10 is the tie between 0 and 2^-9 -> 0
    assert e4.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x80, 0x00, 0x02, 0x1C]
    e2 = C.encode(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -5.0]), "e2m1")
    assert C.decode(e2, "e2m1").tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -4.0]
    assert e2[8].item() == 0x8  # -0.1 rounds to negative zero


def test_e2m1_nan_raises_input_error():
    with pytest.raises(InputError, match="index 2"):
        C.encode(torch.tensor([1.0, 2.0, float("nan")]), "e2m1")


def test_e8m0_decode_and_nearest_encode_match_ml_dtypes():
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    ours = C.decode_e8m0(codes).numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(ref))
    assert np.array_equal(ours[:255], ref[:255])
    rng = np.random.default_rng(3)
    x = np.exp2(rng.uniform(-126, 127, 300_000)).astype(np.float32)
    x = np.concatenate([x, np.exp2(np.arange(-126, 128)).astype(np.float32) * 1.5,
                        [0.0, -1.0, np.inf, np.nan]]).astype(np.float32)
    ours = C.encode_e8m0(torch.from_numpy(x), "nearest").numpy()
    assert np.array_equal(ours, x.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8))


def test_e8m0_floor_ceil_hand_vectors():
    s = torch.tensor([1.0, 1.5, 3.0, 2.0**-127, 2.0**127, 448.0 / 448, 1.0 + 2.0**-23, 0.0])
    assert C.encode_e8m0(s, "floor").tolist() == [127, 127, 128, 0, 254, 127, 127, 255]
    assert C.encode_e8m0(s, "ceil").tolist() == [127, 128, 129, 0, 254, 127, 128, 255]


def test_int4_against_ml_dtypes_and_numpy():
    q = torch.arange(-8, 8, dtype=torch.int8)
    assert np.array_equal(q.numpy().astype(ml_dtypes.int4).astype(np.int8), C.decode_int4(q, torch.int8).numpy())
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.uniform(-10, 10, 100_000), np.arange(-10, 10.5, 0.5)]).astype(np.float32)
    ref = np.clip(np.rint(x), -8, 7).astype(np.int8)   # np.rint is half-to-even
    assert np.array_equal(C.encode_int4(torch.from_numpy(x)).numpy(), ref)
    with pytest.raises(InputError):
        C.encode_int4(torch.tensor([float("nan")]))


def test_fp4_packing_low_nibble_first_and_vllm_unpack():
    codes = torch.tensor([[0x1, 0xF, 0x7, 0x8]], dtype=torch.uint8)
    packed = C.pack_fp4(codes)
    assert packed.tolist() == [[0xF1, 0x87]]
    assert torch.equal(C.unpack_fp4(packed), codes)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=g)
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes
    ref = break_fp4_bytes(C.pack_fp4(codes), torch.float32)
    assert torch.equal(ref, C.decode(codes, "e2m1"))
    q = torch.randint(-8, 8, (4, 32), dtype=torch.int8, generator=g)
    assert torch.equal(C.unpack_int4(C.pack_int4(q)), q)


def test_torch_native_fp8_cast_agrees_in_range():
    x = torch.randn(100_000) * 50
    for fmt, dt in (("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        assert torch.equal(C.encode(x, fmt), x.to(dt).view(torch.uint8))


def test_e4m3_fast_cast_equals_the_arithmetic_encoder():
    """``encode`` (saturating E4M3, float32 on CPU) runs torch's own fp8 cast after a clamp; the
    arithmetic encoder it stands in for gives the same code for every bf16 bit pattern and the
    stress set (ties, their neighbours, subnormals, NaN of both signs, inf, overflow).
    (Checked once over all 2^32 float32 inputs as well: equal.)"""
    f = C.E4M3
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    stress = torch.from_numpy(_stress_values(f, n_random=300_000, seed=3))
    for x in (every_bf16, stress, stress[::7]):        # (and a strided view)
        fast = C.encode(x, f)
        slow = C._encode_arith(x.float(), f, True)
        assert fast.dtype == torch.uint8 and fast.shape == x.shape
        assert torch.equal(fast, slow)
    assert C.encode(torch.tensor([float("nan"), -float("nan")]), f).tolist() == [0x7F, 0xFF]
