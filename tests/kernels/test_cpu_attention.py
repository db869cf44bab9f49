"""The fused CPU attention kernel (``kernels/csrc/attention.c``), which the trainer and the
engine both run:

- the compiled kernel equals its torch specification (``cpu_attention.attention_spec``) bit for
  bit, for any shapes, strides, dtypes, lengths and values (signs of zeros included), and a
  baseline ``-O2`` build (no ``-march=native``) gives the same bits as the default build;
- a query's bits depend only on its own sequence: decode over a cache equals the prefill row,
  a padded batch equals each sequence alone, the thread count changes nothing;
- it is attention: close to the float64 reference, its ``exp`` within an ulp of float64's, and
  differentiable (through the reference formula) with the reference gradients;
- a machine without a compiler falls back to the specification; ``SKYRL_NUMERICS_NATIVE=1``
  makes that an error.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.kernels import cpu, cpu_attention as ca, native, reference as ref

pytestmark = pytest.mark.isa   # also run under each lower CPU capability (tests/test_isa_matrix.py)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _inputs(gen, B, H, Hkv, Sq, Skv, D, Dv, dtype, scale_v=1.0, layout="contiguous"):
    q = torch.randn(B, H, Sq, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, Skv, D, generator=gen).to(dtype)
    v = (torch.randn(B, Hkv, Skv, Dv, generator=gen) * scale_v).to(dtype)
    if layout == "engine":       # (B, S, heads, D) storage seen through transposes, as attn_core
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    return q, k, v


def test_the_kernel_is_built_on_this_machine():
    """CI has a C compiler: the fast path is what the rest of the suite exercises."""
    assert native.lib() is not None, native.unavailable_reason()


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 3), Hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 2, 3, 5, 8, 9]),
       D=st.sampled_from([8, 13, 16, 64, 80]), dv_cut=st.sampled_from([0, 3, 8]),
       Skv=st.integers(1, 200), sq=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       padded=st.booleans(), causal=st.booleans(), block_n=st.sampled_from([1, 7, 64]),
       values=st.sampled_from(["normal", "negative", "zero_block", "wide"]),
       layout=st.sampled_from(["contiguous", "engine"]), seed=st.integers(0, 2 ** 16))
def test_kernel_equals_its_specification(B, Hkv, g, D, dv_cut, Skv, sq, dtype, padded, causal,
                                         block_n, values, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    Sq = min(sq, Skv)
    Dv = max(1, D - dv_cut)
    q, k, v = _inputs(gen, B, Hkv * g, Hkv, Sq, Skv, D, Dv, dtype,
                      scale_v=30.0 if values == "wide" else 1.0, layout=layout)
    if values == "wide":         # scores far apart: exp underflows to 0 inside a row
        q = q * 40
    if values == "negative":     # products 0 · v = -0
        v = -v.abs()
    elif values == "zero_block":
        v[:, :, :min(Skv, 64)] = 0
    lens = torch.randint(Sq, Skv + 1, (B,), generator=gen) if padded else None
    got = ca.attention(q, k, v, causal, None, block_n, lens)
    want = ca.attention_spec(q, k, v, causal, None, block_n, lens)
    assert got.dtype == q.dtype and got.shape == (B, Hkv * g, Sq, Dv)
    assert torch.equal(_bits(got), _bits(want))


def test_a_baseline_build_gives_the_same_bits(tmp_path, monkeypatch):
    """-O2 without -march=native (other vector instructions, other unrolling) changes no bit."""
    monkeypatch.setenv("SKYRL_NUMERICS_CACHE_DIR", str(tmp_path))
    base = native.load(native.build(native.BASE_FLAGS))
    gen = torch.Generator().manual_seed(11)
    for (B, H, Hkv, Sq, Skv, D, Dv, dtype) in [(3, 4, 2, 1, 150, 64, 64, torch.bfloat16),
                                               (2, 9, 3, 70, 70, 44, 40, torch.float32),
                                               (1, 16, 1, 5, 300, 96, 64, torch.bfloat16)]:
        q, k, v = _inputs(gen, B, H, Hkv, Sq, Skv, D, Dv, dtype, layout="engine")
        lens = torch.randint(Sq, Skv + 1, (B,), generator=gen)
        want = ca.attention(q, k, v, True, None, 64, lens)
        monkeypatch.setattr(native, "_LIB", base)
        got = ca.attention(q, k, v, True, None, 64, lens)
        monkeypatch.undo()
        monkeypatch.setenv("SKYRL_NUMERICS_CACHE_DIR", str(tmp_path))
        assert torch.equal(_bits(got), _bits(want))


def test_decode_of_a_padded_batch_equals_each_request_alone():
    """What the engine runs: 16 decodes over kv lengths 1 .. 200 in one padded call (garbage in
    the padding), each equal to that request's own prefill row."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 201, (16,), generator=gen)
    q, k, v = _inputs(gen, 16, 4, 2, 1, 200, 64, 64, torch.bfloat16, layout="engine")
    for b in range(16):
        k[b, :, int(lens[b]):] = float("nan")
        v[b, :, int(lens[b]):] = float("inf")
    batch = cpu.attention(q, k, v, True, None, 64, lens)
    for b in range(16):
        n = int(lens[b])
        qs = torch.randn(1, 4, n, 64, generator=gen).bfloat16()
        qs[:, :, -1] = q[b:b + 1, :, 0]
        alone = cpu.attention(qs, k[b:b + 1, :, :n], v[b:b + 1, :, :n], True)
        assert torch.equal(_bits(batch[b, :, 0]), _bits(alone[0, :, -1])), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch_or_the_thread_count(dtype):
    gen = torch.Generator().manual_seed(5)
    q, k, v = _inputs(gen, 4, 8, 2, 300, 300, 64, 64, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.attention(q, k, v)
        torch.set_num_threads(4)
        four = cpu.attention(q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_bits(one), _bits(four))
    for b in range(4):
        assert torch.equal(_bits(cpu.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1])),
                           _bits(one[b:b + 1]))


@pytest.mark.parametrize("Sq,Skv,D,Dv,causal", [(1, 1, 64, 64, True), (33, 33, 64, 64, True),
                                                (1, 500, 128, 128, True), (40, 90, 48, 32, False),
                                                (257, 257, 576, 512, True)])
def test_close_to_the_float64_reference(Sq, Skv, D, Dv, causal):
    gen = torch.Generator().manual_seed(Sq + Skv)
    q, k, v = _inputs(gen, 2, 4, 1, Sq, Skv, D, Dv, torch.float32)
    got = cpu.attention(q, k, v, causal).double()
    want = ref.attention(q.double(), k.double(), v.double(), causal)
    assert (got - want).abs().max().item() < 2e-6


def test_exp_is_within_an_ulp_of_float64():
    x = torch.linspace(-86.99, 88.0, 2_000_001)
    got, want = ca.exp_s(x).double(), torch.exp(x.double())
    assert ((got - want).abs() / want).max().item() < 2 ** -23
    edge = torch.tensor([-87.0, -1e30, float("-inf"), 0.0, -0.0, 88.5, float("inf"), float("nan")])
    out = ca.exp_s(edge)
    assert out[:3].tolist() == [0.0, 0.0, 0.0] and out[3:5].tolist() == [1.0, 1.0]
    assert out[5:7].tolist() == [math.inf, math.inf] and math.isnan(out[7].item())


def test_differentiable_with_the_reference_gradients():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 90, 16, generator=gen).requires_grad_(True) for h in (4, 2, 2))
    lens = torch.tensor([90, 61])
    out = cpu.attention(q[:, :, :61], k, v, True, None, 64, lens)
    out.square().sum().backward()
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want = torch.cat([ref.attention(qq[:1, :, :61], kk[:1], vv[:1], True),
                      ref.attention(qq[1:, :, :61], kk[1:, :, :61], vv[1:, :, :61], True)])
    want.square().sum().backward()
    for a, b in ((q, qq), (k, kk), (v, vv)):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4)
    assert float(k.grad[1, :, 61:].abs().sum()) == 0.0        # padding gets no gradient


def test_without_a_compiler_the_specification_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("SKYRL_NUMERICS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_TRIED", False)
    monkeypatch.setattr(native, "_ERROR", None)
    assert native.lib() is None
    assert "no-such-cc" in native.unavailable_reason()
    called = []
    real = ca.attention_spec
    monkeypatch.setattr(ca, "attention_spec", lambda *a, **k: called.append(1) or real(*a, **k))
    q = torch.randn(1, 2, 3, 16)
    out = cpu.attention(q, q[:, :1], q[:, :1])
    assert called and out.shape == (1, 2, 3, 16)
    monkeypatch.setenv("SKYRL_NUMERICS_NATIVE", "1")
    with pytest.raises(native.NativeBuildError, match="no-such-cc"):
        native.lib()


def test_paged_attention_refuses_a_counted_slot_outside_the_pools():
    """A slot within kv_lens outside the pools is refused before it is read; slots past kv_lens
    are never read, whatever they hold."""
    if native.lib() is None:
        pytest.skip(f"compiled kernels unavailable: {native.unavailable_reason()}")
    pool = torch.randn(10, 2, 16)
    q = torch.randn(2, 2, 1, 16)
    rows = torch.tensor([[0, 3, 9], [4, 5, -7]])
    lens = torch.tensor([3, 2])
    out = ca.paged_attention(q, pool, pool, rows, lens)          # -7 is past kv_lens: fine
    assert torch.isfinite(out).all()
    for bad in (10, -1):
        r = rows.clone()
        r[1, 1] = bad
        with pytest.raises(ValueError, match="outside the pools' 10 rows"):
            ca.paged_attention(q, pool, pool, r, lens)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 6), Hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 2, 4]),
       D=st.sampled_from([16, 64, 72]), dv_cut=st.sampled_from([0, 8]), L=st.integers(1, 150),
       sq=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       slot_pad=st.sampled_from([0, 24]), native_on=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_paged_attention_equals_attention_over_the_gathered_rows(B, Hkv, g, D, dv_cut, L, sq, dtype,
                                                                 slot_pad, native_on, seed):
    """The engine reads K/V through its slots: the bits of ``attention`` over the gathered rows,
    garbage in slots past each sequence's length (never read) and in the slot padding."""
    gen = torch.Generator().manual_seed(seed)
    Sq, Dv, S = min(sq, L), D - dv_cut, 400
    width = Hkv * (D + Dv)
    slots = torch.randn(S, width + slot_pad, generator=gen).to(dtype)        # the cache's slots
    k_pool = slots[:, :Hkv * D].unflatten(1, (Hkv, D))
    v_pool = slots[:, Hkv * D:width].unflatten(1, (Hkv, Dv))
    S = max(S, B * L)
    slots = torch.cat([slots, torch.randn(S - slots.shape[0], slots.shape[1], generator=gen).to(dtype)])
    k_pool = slots[:, :Hkv * D].unflatten(1, (Hkv, D))
    v_pool = slots[:, Hkv * D:width].unflatten(1, (Hkv, Dv))
    rows = torch.randperm(S, generator=gen)[:B * L].view(B, L)   # each slot one sequence's
    lens = torch.randint(Sq, L + 1, (B,), generator=gen)
    for b in range(B):
        slots[rows[b, int(lens[b]):]] = float("nan")
    q = torch.randn(B, Hkv * g, Sq, D, generator=gen).to(dtype)
    with pytest.MonkeyPatch.context() as mp:
        if not native_on:              # the fallback: gather, then the kernel's specification
            mp.setattr(native, "lib", lambda: None)
        got = ca.paged_attention(q, k_pool, v_pool, rows, lens)
    kg = k_pool[rows].transpose(1, 2)
    vg = v_pool[rows].transpose(1, 2)
    want = ca.attention_spec(q, kg, vg, True, None, 64, lens)
    assert torch.equal(_bits(got), _bits(want))
