"""Subnormal, tiny and zero blocks against torchao 0.18's own functions (``to_mx`` / ``to_dtype``
with ``ScaleCalculationMode.FLOOR`` and ``RCEIL``; ``nvfp4_quantize`` / ``NVFP4Tensor``), for any
finite input (issue 23). Our recipes equal torchao bit for bit except in the two cases named in
``quant/recipes_mx.py`` / ``quant/recipes_nvfp4.py`` and docs/quant.md, and the tests pin those
exactly: the differing elements are predicted element by element, and torchao's values there are
given by a formula (MX FLOOR: torchao encodes with ``2^-126``), not just "some difference".

* MX ``floor``, E8M0 code ``b = 0`` (block amax below ``2^(emax_elem - 126)``): torchao encodes
  ``x * 2^126`` and decodes with ``2^-127``; we encode ``x * 2^127`` (OCP MX v1.0). Every other
  block: codes, scales and dequantized bits equal.
* NVFP4 ``torchao``: an element ``x = +-0`` in a block whose element multiplier
  ``r = fl(fl(1/g)/s)`` overflows to inf (global ``g`` below about ``2^-122``): torchao computes
  ``0 * inf = NaN`` and its bit-twiddling E2M1 cast turns that NaN into a code that depends on the
  NaN's bit pattern (x86: ``0b1011`` = -1.5); ours is code 0. A global that is 0 (``fl(A/2688)``
  underflows) follows our zero-global rule; torchao divides by 0 there. Everything else equal.
"""
import warnings

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from skyrl_numerics.quant import codecs as C
from skyrl_numerics.quant import dequantize, fake_quant, quantize

from quant_vendors import torchao_mx

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MX = {"e4m3fn": ("mxfp8", {"elem": "e4m3fn"}, torch.float8_e4m3fn),
      "e5m2": ("mxfp8", {"elem": "e5m2"}, torch.float8_e5m2),
      "e2m1": ("mxfp4", {}, "fp4")}
EMAX = {"e4m3fn": 8, "e5m2": 15, "e2m1": 2}
KINDS = ("zero", "subnormal", "b0", "edge", "mixed", "normal", "bits", "huge")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.dtype.itemsize])


def _from_bits(b: torch.Tensor, dtype) -> torch.Tensor:
    return b.to(torch.int16).view(torch.bfloat16) if dtype == torch.bfloat16 else b.to(torch.int32).view(torch.float32)


def _block(kind: str, n: int, dtype, emax: int, g: torch.Generator) -> torch.Tensor:
    """One block of ``n`` finite values in ``dtype`` (returned as float32, exact)."""
    mbits = 7 if dtype == torch.bfloat16 else 23
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    if kind == "zero":
        return sign * 0.0                                                      # +0 and -0
    if kind == "subnormal":                                                    # every element subnormal in dtype
        v = _from_bits(torch.randint(1, 2 ** mbits, (n,), generator=g), dtype).float()
    elif kind == "b0":                                                         # normal or not, E8M0 code 0
        v = torch.rand(n, generator=g) * 2.0 ** (emax - 126 - int(torch.randint(0, 40, (1,), generator=g)))
    elif kind == "edge":                                                       # amax at / just below 2^(emax-126)
        top = torch.tensor(2.0 ** (emax - 126)).to(dtype).float()
        if bool(torch.rand(1, generator=g) < 0.5):
            top = torch.nextafter(top.to(dtype), torch.tensor(0.0, dtype=dtype)).float()
        v = torch.rand(n, generator=g) * top
        v[int(torch.randint(0, n, (1,), generator=g))] = top
    elif kind == "mixed":                                                      # subnormals + small normals
        sub = _from_bits(torch.randint(1, 2 ** mbits, (n,), generator=g), dtype).float()
        v = torch.where(torch.rand(n, generator=g) < 0.3, sub * 2.0 ** int(torch.randint(1, 20, (1,), generator=g)), sub)
    elif kind == "normal":
        v = torch.randn(n, generator=g).abs() * 2.0 ** int(torch.randint(-110, 120, (1,), generator=g))
    elif kind == "bits":                                                       # finite random bit patterns
        hi = 2 ** 15 if dtype == torch.bfloat16 else 2 ** 31
        v = _from_bits(torch.randint(0, hi, (n,), generator=g), dtype).float()
        v = torch.where(torch.isfinite(v), v, 0.0)
    else:                                                                      # huge: near the dtype's max
        v = torch.finfo(dtype).max * (1 - torch.rand(n, generator=g) * 0.5)
    v = torch.where(torch.rand(n, generator=g) < 0.1, 0.0, v)                  # exact zeros inside blocks
    return (sign * v).to(dtype).float()


def _tensor(kinds, n: int, dtype, emax: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.cat([_block(k, n, dtype, emax, g) for k in row]) for row in kinds]).to(dtype)


def _to_mx(x, elem, mode):
    ao = torchao_mx()
    el = MX[elem][2]
    el = torch.float4_e2m1fn_x2 if el == "fp4" else el
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s, data = ao.to_mx(x.contiguous(), el, 32, getattr(ao.ScaleCalculationMode, mode))
        deq = ao.to_dtype(data, s, el, 32, x.dtype)
    return s.view(torch.uint8), data.view(torch.uint8), deq


def _codes(q, elem):
    c = q.codes.view(torch.uint8)
    return C.unpack_fp4(c) if elem == "e2m1" else c


def check_mx_floor(x: torch.Tensor, elem: str) -> int:
    """Ours vs torchao FLOOR on ``x`` ([R, 32k]); returns the number of differing element codes."""
    recipe, opts, _ = MX[elem]
    s_ao, c_ao, deq_ao = _to_mx(x, elem, "FLOOR")
    c_ao = C.unpack_fp4(c_ao) if elem == "e2m1" else c_ao
    q = quantize(x, recipe, **opts)
    b = q.scales.view(torch.uint8)
    assert torch.equal(b, s_ao)                                                # scales: always equal
    ours = _codes(q, elem)
    deq = dequantize(q)
    assert torch.equal(_bits(fake_quant(x, recipe, **opts)), _bits(deq))       # fused path = reference
    b0 = (b == 0).repeat_interleave(32, dim=1)
    # outside b = 0 blocks: codes and dequantized bits equal
    assert torch.equal(ours[~b0], c_ao[~b0])
    assert torch.equal(_bits(deq)[~b0], _bits(deq_ao)[~b0])
    # b = 0 blocks: torchao encodes x / 2^-126 (its F32_MIN_NORMAL clamp), decodes with 2^-127
    xf = x.float()
    fmt = C.FORMATS[elem]
    assert torch.equal(c_ao[b0], C.encode((xf * 2.0 ** 126)[b0], fmt))
    assert torch.equal(ours[b0], C.encode((xf * 2.0 ** 127).clamp(-fmt.max_finite, fmt.max_finite)[b0], fmt))
    want_ao = (C.decode(c_ao, elem) * 2.0 ** -127).to(x.dtype)
    assert torch.equal(_bits(deq_ao)[b0], _bits(want_ao)[b0])
    return int((ours != c_ao).sum())            # all inside b = 0 blocks (both can round to one element code)


def check_mx_rceil(x: torch.Tensor, elem: str) -> None:
    """Ours vs torchao RCEIL: scales differ only where torchao's float log2 rounds ``d = a/max``
    just above ``2^k`` down to ``k`` (never on subnormal or zero blocks); codes equal elsewhere."""
    recipe, opts, _ = MX[elem]
    s_ao, c_ao, deq_ao = _to_mx(x, elem, "RCEIL")
    c_ao = C.unpack_fp4(c_ao) if elem == "e2m1" else c_ao
    q = quantize(x, recipe, scale_mode="rceil", **opts)
    b = q.scales.view(torch.uint8)
    assert torch.equal(_bits(fake_quant(x, recipe, scale_mode="rceil", **opts)), _bits(dequantize(q)))
    d = x.float().abs().reshape(x.shape[0], -1, 32).amax(-1) / C.FORMATS[elem].max_finite
    off = b != s_ao
    if bool(off.any()):
        k = s_ao[off].int() - 127
        assert torch.equal(b[off].int(), s_ao[off].int() + 1)
        assert torch.equal(torch.log2(d[off]), k.float()) and bool((d[off] > torch.exp2(k.float())).all())
    same = (~off).repeat_interleave(32, dim=1)
    assert torch.equal(_codes(q, elem)[same], c_ao[same])
    assert torch.equal(_bits(dequantize(q))[same], _bits(deq_ao)[same])


ROWS = st.integers(1, 4).flatmap(lambda w: st.lists(st.lists(st.sampled_from(KINDS), min_size=w, max_size=w),
                                                    min_size=1, max_size=4))     # kinds of [rows][blocks]


@settings(max_examples=120, deadline=None)
@given(rows=ROWS, seed=st.integers(0, 2 ** 16), dtype=st.sampled_from(sorted(DTYPES)),
       elem=st.sampled_from(sorted(MX)))
@example(rows=[["subnormal"] * 4] * 4, seed=0, dtype="fp32", elem="e4m3fn")
@example(rows=[["subnormal"] * 4] * 4, seed=0, dtype="bf16", elem="e5m2")
@example(rows=[["zero", "edge", "b0", "normal"]], seed=1, dtype="bf16", elem="e2m1")
def test_mx_floor_any_finite_block_matches_torchao_except_code_0(rows, seed, dtype, elem):
    n = check_mx_floor(_tensor(rows, 32, DTYPES[dtype], EMAX[elem], seed), elem)
    event("codes differ (b = 0 blocks)" if n else "all codes equal")


@settings(max_examples=60, deadline=None)
@given(rows=ROWS, seed=st.integers(0, 2 ** 16), dtype=st.sampled_from(sorted(DTYPES)),
       elem=st.sampled_from(sorted(MX)))
@example(rows=[["subnormal", "zero", "mixed", "b0"]], seed=0, dtype="fp32", elem="e4m3fn")
def test_mx_rceil_any_finite_block_matches_torchao(rows, seed, dtype, elem):
    check_mx_rceil(_tensor(rows, 32, DTYPES[dtype], EMAX[elem], seed), elem)


# the measured cases (64 blocks of 32 = 2048 elements each; counts in recipes_mx.py / docs/quant.md)
@pytest.mark.parametrize("elem", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", ["zero", "subnormal", "b0", "edge", "mixed", "normal"])
def test_mx_floor_subnormal_blocks_vs_torchao(kind, dtype, elem):
    x = _tensor([[kind] * 4] * 16, 32, DTYPES[dtype], EMAX[elem], seed=3)
    n = check_mx_floor(x, elem)
    b0 = quantize(x, "mxfp8", elem=elem).scales.view(torch.uint8) == 0
    if kind in ("zero", "normal"):
        assert n == 0
    if kind in ("subnormal", "b0"):
        assert bool(b0.all()) and n > 0                                        # every block has code 0 and differs
    if kind == "mixed":
        assert bool(b0.any()) and n > 0
    if kind == "edge":                                                         # amax = 2^(emax-126): code 1, equal
        assert bool(b0.any()) and not bool(b0.all())


def test_mx_floor_code_0_boundary():
    """``b = 0`` starts strictly below ``2^(emax_elem - 126)``: at it both give code 1 and equal bits."""
    for elem in ("e4m3fn", "e5m2", "e2m1"):
        top = torch.tensor(2.0 ** (EMAX[elem] - 126))
        x = torch.zeros(2, 32)
        x[0] = torch.linspace(-1, 1, 32) * top
        x[1] = torch.linspace(-1, 1, 32) * torch.nextafter(top, torch.tensor(0.0))
        recipe, opts, _ = MX[elem]
        assert quantize(x, recipe, **opts).scales.view(torch.uint8).reshape(-1).tolist() == [1, 0]
        assert check_mx_floor(x, elem) > 0


# ------------------------------------------------------------------------------------------ NVFP4
def check_nvfp4_torchao(x: torch.Tensor, static) -> int:
    """Ours (``convention="torchao"``) vs torchao ``nvfp4_quantize`` / ``NVFP4Tensor`` with the
    per-tensor scale ``g = A/2688``; returns the number of differing element codes."""
    ao = torchao_mx()
    A = x.float().abs().amax()
    A = A * static if static is not None and bool(torch.isfinite(A * static)) else A
    gs = ao.per_tensor_amax_to_scale(A)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s_ao, packed = ao.nvfp4_quantize(x.contiguous(), 16, gs)
        deq_ao = ao.NVFP4Tensor.to_nvfp4(x.contiguous(), 16, gs).dequantize(x.dtype)
    q = quantize(x, "nvfp4", convention="torchao", global_scale=gs)
    if float(gs) == 0:
        return _check_zero_global(x, q, s_ao, packed)
    assert torch.equal(q.scales.view(torch.uint8), s_ao.view(torch.uint8))    # scales: always equal
    deq = dequantize(q)
    assert torch.equal(_bits(fake_quant(x, "nvfp4", convention="torchao", global_scale=gs)), _bits(deq))
    ours, theirs = C.unpack_fp4(q.codes), C.unpack_fp4(packed)
    s = C.decode(q.scales.view(torch.uint8), "e4m3fn")
    r = ((1.0 / gs) / s).repeat_interleave(16, dim=1)                          # torchao's element multiplier
    nan = (x.float() == 0) & torch.isinf(r)                                    # 0 * inf = NaN there
    assert torch.equal(ours[~nan], theirs[~nan])
    assert torch.equal(_bits(deq)[~nan], _bits(deq_ao)[~nan])
    assert bool((ours[nan] == 0).all())                                        # ours: a zero stays code 0
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked
    nan_code = f32_to_f4_unpacked(torch.zeros(1) * float("inf")).item()       # torchao's code of this host's NaN
    assert nan_code != 0 and bool((theirs[nan] == nan_code).all())
    return int((ours != theirs).sum())


def _check_zero_global(x, q, s_ao, packed) -> int:
    """``g = fl(A/2688) = 0`` with ``A > 0`` (``A <= 1344 * 2^-149``): ours is the zero-global rule
    (zero codes, scales, dequant); torchao divides by 0: scale 448 (``fl(a/6)/0 = inf``, clamped)
    and codes +-6 for the non-zero elements; NaN scales where ``fl(a/6) = 0`` (``0/0``: zero blocks,
    and blocks of amax below ``6 * 2^-150``), whose codes are NaN's."""
    assert bool((q.codes == 0).all()) and bool((q.scales.view(torch.uint8) == 0).all())
    assert bool((dequantize(q) == 0).all())
    a6 = x.float().abs().reshape(x.shape[0], -1, 16).amax(-1) / 6.0
    s = s_ao.float()
    assert bool((s[a6 > 0] == 448).all()) and bool(torch.isnan(s[a6 == 0]).all())
    theirs = C.unpack_fp4(packed)
    xf = torch.where((a6 > 0).repeat_interleave(16, dim=1), x.float(), torch.nan)     # blocks with scale 448
    assert torch.equal(theirs[xf > 0], torch.full_like(theirs[xf > 0], 7))
    assert torch.equal(theirs[xf < 0], torch.full_like(theirs[xf < 0], 15))
    return int((theirs != 0).sum())


@settings(max_examples=100, deadline=None)
@given(rows=ROWS, seed=st.integers(0, 2 ** 16), dtype=st.sampled_from(sorted(DTYPES)),
       shift=st.integers(-150, 0), static=st.sampled_from([None, 0.25, 4.0]))
@example(rows=[["subnormal"] * 4] * 2, seed=0, dtype="bf16", shift=0, static=None)
@example(rows=[["mixed", "zero"]] * 2, seed=0, dtype="fp32", shift=0, static=None)
@example(rows=[["normal", "subnormal", "zero", "b0"]], seed=2, dtype="bf16", shift=0, static=0.25)
def test_nvfp4_torchao_any_finite_tensor_matches_except_zero_times_inf(rows, seed, dtype, shift, static):
    dt = DTYPES[dtype]
    x = (_tensor(rows, 16, dt, 2, seed).double() * 2.0 ** shift).to(dt)          # shift: whole tensor tiny
    if float(x.float().abs().amax()) == 0:
        return                                                                 # g = 0: the zero-tensor test below
    n = check_nvfp4_torchao(x, static)
    event("codes differ (0 * inf or g = 0)" if n else "all codes equal")


def test_nvfp4_torchao_global_underflows_to_zero():
    x = torch.zeros(2, 32)
    x[0, :16] = torch.linspace(-1, 1, 16) * 1344 * 2.0 ** -149                # A = 1344 * 2^-149: g = 0
    x[1, :16] = 2.0 ** -149                                                   # fl(a/6) = 0: NaN scale in torchao
    assert float(quantize(x, "nvfp4", convention="torchao").global_scale) == 0
    assert check_nvfp4_torchao(x, None) == 64                                 # every code of torchao's is non-zero
    x[0, 15] = torch.nextafter(x[0, 15], torch.tensor(1.0))                   # one ulp more: g = 2^-149
    assert float(quantize(x, "nvfp4", convention="torchao").global_scale) == 2.0 ** -149
    check_nvfp4_torchao(x, None)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", ["subnormal", "b0"])
def test_nvfp4_torchao_all_subnormal_tensor(kind, dtype):
    """A tensor of subnormal blocks: g = A/2688 is far below 2^-122, r = inf in every block, every
    non-zero element saturates to +-6 in both; the exact zeros are the only difference."""
    x = _tensor([[kind] * 2] * 64, 16, DTYPES[dtype], 2, seed=5)
    n = check_nvfp4_torchao(x, None)
    assert n == int((x == 0).sum()) and n > 0


def test_nvfp4_torchao_subnormal_block_in_normal_tensor_equal():
    x = _tensor([["normal", "subnormal", "zero", "mixed"]] * 8, 16, torch.bfloat16, 2, seed=6)
    x[0, :16] = 1.0
    assert check_nvfp4_torchao(x, None) == 0


def test_nvfp4_torchao_zero_tensor():
    """All zeros, dynamic global: g = 0. torchao divides 0/0 (NaN block scales, NaN elements,
    non-zero codes); ours gives zero codes, zero scales and g = 0 (recipes_nvfp4 module doc)."""
    ao = torchao_mx()
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    gs = ao.per_tensor_amax_to_scale(x.float().abs().amax())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s_ao, packed = ao.nvfp4_quantize(x, 16, gs)
    assert bool(torch.isnan(s_ao.float()).all()) and bool((packed != 0).all())
    q = quantize(x, "nvfp4", convention="torchao")
    assert float(q.global_scale) == 0 and bool((q.codes == 0).all())
    assert bool((q.scales.view(torch.uint8) == 0).all()) and bool((dequantize(q) == 0).all())


@pytest.mark.parametrize("conv", ["vllm", "te", "modelopt", "torchao", "compressed_tensors", "modelopt<0.45",
                                  "torchao<0.17"])
@pytest.mark.parametrize("how", ["zeros", "underflow", "global_scale=0"])
def test_nvfp4_zero_global_gives_zeros_in_every_convention(conv, how):
    """The zero-global rule (recipes_nvfp4 module doc): zero codes, scales and output, never 0/0."""
    x = torch.zeros(2, 32) if how == "zeros" else torch.linspace(-1, 1, 64).reshape(2, 32) * 1344 * 2.0 ** -149
    opts = {"global_scale": 0.0} if how == "global_scale=0" else {}
    if how == "global_scale=0":
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    q = quantize(x, "nvfp4", convention=conv, **opts)
    if how != "global_scale=0" and conv == "compressed_tensors":               # G = 2688 / max(A, FLT_MIN) > 0
        assert float(q.global_scale) > 0 and bool((dequantize(q) == 0).all())
        return
    if how == "underflow" and conv == "te":                                    # te's global is A itself
        assert float(q.global_scale) > 0
        return
    assert float(q.global_scale) == 0
    assert bool((q.codes == 0).all()) and bool((q.scales.view(torch.uint8) == 0).all())
    assert bool((dequantize(q) == 0).all()) and bool((fake_quant(x, "nvfp4", convention=conv, **opts) == 0).all())
