"""The bf16-weight GEMM (``kernels/csrc/gemm_bf16.c``, :mod:`skyrl_numerics.kernels.cpu_gemm_bf16`):
the C kernel is its torch specification bit for bit; an output depends only on its own row and
weight row (any M, any column split, any group layout); the AVX2 + FMA build and a baseline
build (scalar ``fmaf``) give the host build's bits; the spec's fma is C's exactly rounded
``fmaf`` (libm), double-rounding cases included; and the numbers are a float32 dot product
(checked against numpy's float64 product with the standard error bound, and against ml_dtypes'
bfloat16 for the widening)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.kernels import cpu_gemm_bf16 as gb
from skyrl_numerics.kernels import native
from skyrl_numerics.kernels.fixed_order import fma

pytestmark = pytest.mark.isa

needs_lib = pytest.mark.skipif(native.lib() is None,
                               reason=f"compiled kernels unavailable: {native.unavailable_reason()}")


def _data(seed, M, K, N, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * scale).bfloat16()
    w = (torch.randn(N, K, generator=g) * scale).bfloat16()
    return x, w


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@needs_lib
@settings(max_examples=60, deadline=None)
@given(M=st.integers(0, 13), K=st.integers(0, 140), N=st.integers(0, 110), seed=st.integers(0, 2**16))
def test_c_kernel_is_its_torch_spec(M, K, N, seed):
    x, w = _data(seed, M, K, N)
    assert torch.equal(_bits(gb.linear_f32(x, w)), _bits(gb.linear_spec(x, w)))


@needs_lib
@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 40), K=st.sampled_from([7, 64, 200, 768]), N=st.sampled_from([1, 5, 48, 97, 300]),
       seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]))
def test_a_row_is_the_same_in_any_batch_and_any_split(M, K, N, seed, threads):
    """Every row of an M-row call equals that row alone, any sub-batch, and the call on one
    thread or split over two (the column split of :mod:`.pool`)."""
    x, w = _data(seed, M, K, N)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        full = gb.linear_f32(x, w)
    finally:
        torch.set_num_threads(before)
    for m in range(M):
        assert torch.equal(_bits(gb.linear_f32(x[m:m + 1], w)), _bits(full[m:m + 1]))
    lo = M // 3
    assert torch.equal(_bits(gb.linear_f32(x[lo:], w)), _bits(full[lo:]))
    # columns: a weight's rows alone give the same outputs
    assert torch.equal(_bits(gb.linear_f32(x, w[N // 2:])), _bits(full[:, N // 2:]))


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=7), K=st.sampled_from([16, 40, 96]),
       N=st.sampled_from([8, 24, 50]), seed=st.integers(0, 2**16), native_on=st.booleans())
def test_grouped_rows_are_each_groups_own_call(counts, K, N, seed, native_on):
    """Experts: rows of group g times ws[g] in one call equal one call per group (empty groups,
    first and last included; with the C kernel and with its spec)."""
    if native_on and native.lib() is None:
        pytest.skip(f"compiled kernels unavailable: {native.unavailable_reason()}")
    g = torch.Generator().manual_seed(seed)
    off = np.concatenate([[0], np.cumsum(counts)])
    R = int(off[-1])
    x = torch.randn(R, K, generator=g).bfloat16().float()
    ws = [torch.randn(N, K, generator=g).bfloat16() for _ in counts]
    with pytest.MonkeyPatch.context() as mp:
        if not native_on:
            mp.setattr(gb, "lib", lambda: None)
        got = gb.grouped(x, ws, off)
    assert got.shape == (R, N)
    for i in range(len(counts)):
        want = gb.linear_spec(x[off[i]:off[i + 1]], ws[i])
        assert torch.equal(_bits(got[off[i]:off[i + 1]]), _bits(want))


@needs_lib
@settings(max_examples=30, deadline=None)
@given(M=st.integers(0, 150), K=st.sampled_from([1, 16, 40, 128, 300]), N=st.sampled_from([1, 7, 48, 130]),
       seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]),
       scale=st.sampled_from([1e-3, 1.0, 1e3, 1e15]), pad=st.sampled_from([0, 5]))
def test_bf16_rows_in_and_out_are_the_float32_call_rounded(M, K, N, seed, threads, scale, pad):
    """x read as bfloat16 rows (widened in the kernel, 64 rows at a time; row stride past K) and
    outputs rounded to bfloat16 in the kernel give the float32 call on ``x.float()`` then torch's
    ``.to(bfloat16)``, bit for bit, for one call and for grouped rows, on one thread or split."""
    x, w = _data(seed, M, K + pad, N, scale)
    x = x[:, pad:]                                        # row stride K + pad
    f32 = gb.linear_f32(x.float(), w[:, pad:])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        one = gb.linear(x, w[:, pad:])
        mixed = gb.linear(x, w[:, pad:], out_dtype=torch.float32)
        half = gb.linear(x.half(), w[:, pad:])             # float16: rounded by torch
        half_grouped = gb.grouped(x, [w[:, pad:]], [0, M], torch.float16)
        off = np.array([0, M // 3, M // 3, M - M // 5])   # an empty group; rows after the last: +0
        ws = [w[:, pad:], None, w.flip(0)[:, pad:]]
        grouped = gb.grouped(x, ws, off, torch.bfloat16)
    finally:
        torch.set_num_threads(before)
    assert one.dtype == torch.bfloat16 and torch.equal(_bits(one), _bits(f32.to(torch.bfloat16)))
    assert torch.equal(_bits(mixed), _bits(f32))
    assert half.dtype == half_grouped.dtype == torch.float16
    assert torch.equal(half.view(torch.int16), gb.linear_f32(x.half().float(), w[:, pad:]).half().view(torch.int16))
    assert torch.equal(half_grouped.view(torch.int16), f32.half().view(torch.int16))
    want = torch.zeros(M, N, dtype=torch.bfloat16)
    want[off[0]:off[1]] = f32[off[0]:off[1]].to(torch.bfloat16)
    want[off[2]:off[3]] = gb.linear_f32(x[off[2]:off[3]].float(), ws[2]).to(torch.bfloat16)
    assert torch.equal(_bits(grouped), _bits(want))


def test_grouped_refuses_bad_offsets():
    x = torch.zeros(4, 8)
    ws = [torch.zeros(3, 8, dtype=torch.bfloat16)] * 2
    with pytest.raises(ValueError, match="non-decreasing"):
        gb.grouped(x, ws, [0, 3, 2])
    with pytest.raises(ValueError, match="past the 4 rows"):      # never read
        gb.grouped(x, ws, [0, 3, 5])
    with pytest.raises(ValueError, match="K = 8"):
        gb.grouped(x, [torch.zeros(3, 9, dtype=torch.bfloat16)] * 2, [0, 2, 4])


def test_weight_must_be_bf16_and_match_k():
    with pytest.raises(TypeError, match="bfloat16"):
        gb.linear_f32(torch.zeros(2, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="K = 8"):
        gb.linear_f32(torch.zeros(2, 8), torch.zeros(3, 9, dtype=torch.bfloat16))


@needs_lib
def test_strided_operands_give_the_contiguous_bits():
    """A weight view with unit stride along K is read in place; other layouts are copied in
    bf16 first: the same bits either way."""
    x, w = _data(5, 9, 72, 40)
    wide = torch.zeros(40, 100, dtype=torch.bfloat16)
    wide[:, 10:82] = w
    tr = w.t().contiguous().t()                      # [N, K] with stride (1, N)
    want = gb.linear_f32(x, w)
    assert torch.equal(_bits(gb.linear_f32(x, wide[:, 10:82])), _bits(want))
    assert torch.equal(_bits(gb.linear_f32(x, tr)), _bits(want))
    assert torch.equal(_bits(gb.linear_f32(x.t().contiguous().t(), w)), _bits(want))


def test_close_to_the_exact_product():
    """The float32 result is within the standard dot-product bound of numpy's float64 product
    of the same bfloat16 values (widened by ml_dtypes): |err| <= 1.01 K u sum |x w|."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, w = _data(3, 6, 1000, 33, scale=3.0)
    xs = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16).astype(np.float64)
    wsn = w.view(torch.int16).numpy().view(ml_dtypes.bfloat16).astype(np.float64)
    exact = xs @ wsn.T
    got = gb.linear_f32(x, w).numpy().astype(np.float64)
    bound = 1.01 * 1000 * 2.0 ** -24 * (np.abs(xs) @ np.abs(wsn).T)
    assert np.all(np.abs(got - exact) <= bound)


@needs_lib
def test_special_values_follow_ieee():
    """inf and NaN in x or w propagate as IEEE float32 products and sums do (the spec's ops)."""
    x, w = _data(1, 3, 24, 5)
    x[0, 3] = float("inf")
    x[1, 0] = float("nan")
    w[2, 7] = float("-inf")
    got, want = gb.linear_f32(x, w), gb.linear_spec(x, w)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = ~torch.isnan(want)
    assert torch.equal(got[fin], want[fin])
    assert torch.isinf(got[0]).any() and torch.isnan(got[1]).all()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


AVX2_FLAGS = ("-O3", "-march=x86-64-v3") + native.BASE_FLAGS[1:]   # AVX2 + FMA: an AVX2 host's build


@needs_lib
@pytest.mark.parametrize("flags", [native.BASE_FLAGS, AVX2_FLAGS], ids=["baseline_O2", "avx2_fma"])
def test_other_builds_give_the_same_bits(flags, tmp_path, monkeypatch):
    """-O2 without -march (16 scalar fmaf lanes) and the AVX2 + FMA build (two 8-lane halves)
    give the host build's bits (on an AVX-512 host: one 16-lane register)."""
    if flags is AVX2_FLAGS and not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA: the AVX2 build cannot run here")
    monkeypatch.setenv("SKYRL_NUMERICS_CACHE_DIR", str(tmp_path))
    other = native.load(native.build(flags))
    cases = [_data(s, M, K, N) for s, (M, K, N) in
             enumerate([(1, 2048, 97), (5, 131, 64), (17, 768, 50), (4, 15, 9), (64, 48, 13)])]
    cases.append((torch.randn(9, 200).float(), _data(7, 1, 200, 40)[1]))    # float32 x: inexact products
    want = [gb.linear_f32(x, w) for x, w in cases]
    monkeypatch.setattr(native, "_LIB", other)
    for (x, w), ref in zip(cases, want):
        assert torch.equal(_bits(gb.linear_f32(x, w)), _bits(ref))
    assert other.skyrl_amx_available() == 0     # neither build targets AMX: amx refuses there


def test_the_march_variable_names_another_cpus_build(monkeypatch):
    """``SKYRL_NUMERICS_NATIVE_MARCH`` builds (and caches apart) what another CPU runs; a value
    that is not a -march name is refused naming the variable, before any compiler runs."""
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    assert native.host_flags() == native.FLAGS
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    assert native.host_flags() == AVX2_FLAGS
    assert native.library_path() == native.library_path(AVX2_FLAGS) != native.library_path(native.FLAGS)
    monkeypatch.setenv(native.MARCH_ENV, "native -fno-strict; rm")
    with pytest.raises(native.NativeBuildError, match=native.MARCH_ENV):
        native.host_flags()


def _libm_fmaf():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("m")
    if name is None:
        pytest.skip("no libm to compare fmaf with")
    f = ctypes.CDLL(name).fmaf
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float] * 3
    return f


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_spec_fma_is_libm_fmaf(seed):
    """The spec's float64 fma (sum rounded to odd, then to float32) is C's fmaf bit for bit:
    random magnitudes, near-cancellation, the double-rounding midpoints (a plain float64
    a·b + c gets those wrong: checked), tiny and subnormal results, inf and NaN."""
    fmaf = _libm_fmaf()
    g = torch.Generator().manual_seed(seed)
    n = 64
    a = torch.randn(n, generator=g) * 2.0 ** torch.randint(-70, 70, (n,), generator=g)
    b = torch.randn(n, generator=g) * 2.0 ** torch.randint(-70, 70, (n,), generator=g)
    c = -(a.double() * b.double()).float() * (1 + torch.randint(-3, 4, (n,), generator=g) * 2.0 ** -23)
    c[::2] = torch.randn(n // 2, generator=g) * 2.0 ** torch.randint(-149, 70, (n // 2,), generator=g)
    mid = torch.tensor([1 + 2 ** -12, -(1 + 2 ** -12), 1 + 2 ** -12, 2.0 ** -75, float("inf"), float("nan"), 0.0])
    a = torch.cat([a, mid])
    b = torch.cat([b, mid.abs()])
    c = torch.cat([c, torch.tensor([2.0 ** -80, 2.0 ** -80, -2.0 ** -80, 2.0 ** -149, 1.0, 1.0, -0.0])])
    got = fma(a, b, c)
    want = torch.tensor([fmaf(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)])
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(_bits(got[ok]), _bits(want[ok]))
    naive = (a[n:n + 3].double() * b[n:n + 3].double() + c[n:n + 3].double()).float()
    assert not torch.equal(_bits(naive), _bits(want[n:n + 3]))     # the cases do need round-to-odd


def test_matmul_routes_bf16_through_it():
    """``kernels.matmul`` with two bfloat16 operands (the trainer's autograd forward) is the
    bf16 GEMM of ``b.T``, rounded once; with a bias, the float32 bias is added first."""
    from skyrl_numerics.kernels import matmul

    x, w = _data(9, 7, 64, 30)
    bias = torch.randn(30).bfloat16()
    assert torch.equal(_bits(matmul(x, w.t())), _bits(gb.linear_spec(x, w).bfloat16()))
    assert torch.equal(_bits(matmul(x, w.t(), bias)),
                       _bits((gb.linear_spec(x, w) + bias.float()).bfloat16()))
