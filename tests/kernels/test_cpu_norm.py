"""The fused CPU RMSNorm (``kernels/csrc/rms_norm.c``), shared by the trainer and the engine:
bitwise equal to its torch specification for any shape, dtype, weight layout and values; a
baseline ``-O2`` build gives the same bits; rows do not depend on the batch or the thread
count; close to the float64 reference; ``kernels.rms_norm`` still differentiates."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.kernels import cpu, cpu_norm as cn, native, reference as ref, rms_norm

pytestmark = pytest.mark.isa   # also run under each lower CPU capability (tests/test_isa_matrix.py)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a, b):
    """Bitwise equal, a NaN matching any NaN (a payload carries no number: 0 · inf here)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@settings(max_examples=60, deadline=None)
@given(M=st.integers(1, 40), N=st.sampled_from([1, 7, 8, 64, 128, 129, 4099, 20000]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       per_row=st.booleans(), strided=st.booleans(),
       eps=st.sampled_from([1e-6, 1e-5, 0.0, 0.5]),
       values=st.sampled_from(["normal", "tiny", "huge", "zero_row"]), seed=st.integers(0, 2 ** 16))
def test_kernel_equals_its_specification(M, N, dtype, per_row, strided, eps, values, seed):
    g = torch.Generator().manual_seed(seed)
    scale = {"normal": 1.0, "tiny": 1e-20, "huge": 1e18, "zero_row": 1.0}[values]
    x = (torch.randn(M, 2 * N if strided else N, generator=g) * scale).to(dtype)[:, :N]
    if values == "zero_row":
        x[0] = 0
    w = torch.randn(M, N, generator=g).to(dtype) if per_row else torch.randn(N, generator=g).to(dtype)
    y, rstd = cn.rms_norm(x, w, eps)
    ys, rs = cn.rms_norm_spec(x, w, eps)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert _same(y, ys) and _same(rstd, rs)


@pytest.mark.skipif(native.lib() is None, reason="compiled kernels unavailable")
@settings(max_examples=50, deadline=None)
@given(M=st.integers(1, 40), N=st.sampled_from([1, 7, 64, 128, 129, 4099]),
       w_dtype=st.sampled_from([torch.float32, torch.bfloat16]), strided=st.booleans(),
       eps=st.sampled_from([1e-6, 0.0]), values=st.sampled_from(["normal", "cancel", "tiny", "huge"]),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_residual_add_and_norm_in_one_pass_equal_torchs_add_then_the_norm(M, N, w_dtype, strided, eps,
                                                                         values, threads, seed):
    """``add_rms_norm``'s C pass gives torch's bfloat16 ``h + a`` (rounding ties, cancellation to
    zero, overflow to inf, subnormal sums) and then :func:`rms_norm` of it, bit for bit, on one
    thread or split over two."""
    g = torch.Generator().manual_seed(seed)
    scale = {"normal": 1.0, "cancel": 1.0, "tiny": 1e-38, "huge": 2e38}[values]
    h = (torch.randn(M, 2 * N if strided else N, generator=g) * scale).bfloat16()[:, :N]
    a = (torch.randn(M, N, generator=g) * scale).bfloat16()
    if values == "cancel":        # exact cancellations and sums one bf16 ulp apart (ties)
        a = torch.where(torch.rand(M, N, generator=g) < 0.5, -h, (h.float() * 2 ** -8).bfloat16())
    w = torch.randn(N, generator=g).to(w_dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        s, y = cn.add_rms_norm(h, a, w, eps)
    finally:
        torch.set_num_threads(before)
    want = h + a
    assert s.dtype == torch.bfloat16 and _same(s, want)
    assert _same(y, cn.rms_norm(want, w, eps)[0])


def test_a_baseline_build_gives_the_same_bits(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYRL_NUMERICS_CACHE_DIR", str(tmp_path))
    base = native.load(native.build(native.BASE_FLAGS))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 1000, generator=g).bfloat16()
    w = torch.randn(1000, generator=g).bfloat16()
    want = cn.rms_norm(x, w, 1e-6)
    monkeypatch.setattr(native, "_LIB", base)
    got = cn.rms_norm(x, w, 1e-6)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(got[1], want[1])


def test_rows_do_not_depend_on_the_batch_or_the_thread_count():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3000, 512, generator=g).bfloat16()
    w = torch.randn(512, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.rms_norm(x, w, 1e-6)[0]
        torch.set_num_threads(4)
        four = cpu.rms_norm(x, w, 1e-6)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_bits(one), _bits(four))
    for r in (0, 1, 1234, 2999):
        assert torch.equal(_bits(cpu.rms_norm(x[r:r + 1], w, 1e-6)[0]), _bits(one[r:r + 1]))


def test_close_to_the_float64_reference_and_differentiable():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 300, generator=g, requires_grad=True)
    w = torch.randn(300, generator=g, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    xx, ww = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = ref.rms_norm(xx, ww, 1e-6)
    assert (y.double() - want).abs().max().item() < 1e-5
    y.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad.double(), xx.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad.double(), ww.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native_on", [True, False])
def test_rms_norm_is_what_the_kernel_computes_with_or_without_the_library(native_on, monkeypatch):
    """Without the library the specification runs: the same bits as the kernel."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g).bfloat16()
    want = cn.rms_norm_spec(x, w, 1e-6)[0]
    if not native_on:
        monkeypatch.setattr(cn, "lib", lambda: None)
    assert torch.equal(_bits(cpu.rms_norm(x, w, 1e-6)[0]), _bits(want))


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 40), Hq=st.sampled_from([1, 2, 4, 6]), Hk=st.sampled_from([1, 2]),
       D=st.sampled_from([2, 16, 64, 128]), style=st.sampled_from(["neox", "gptj"]),
       eps=st.sampled_from([1e-6, 1e-5]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       mscale=st.sampled_from([1.0, 1.2]), seed=st.integers(0, 2 ** 16), spec=st.booleans())
def test_fused_qk_norm_rope_equals_the_unfused_ops(T, Hq, Hk, D, style, eps, scale, mscale, seed, spec):
    """Qwen3's per-head norms + RoPE + cache row in one kernel: the bits of ``rms_norm_heads``,
    ``Rope`` and ``cat`` (what the training forward, with grad, runs) — from the C kernel and,
    without the library (``spec``), from its torch specification."""
    from skyrl_numerics.invariant import blocks

    if spec:
        mp = pytest.MonkeyPatch()
        mp.setattr(cn, "lib", lambda: None)
    try:
        _qk_norm_rope_case(blocks, T, Hq, Hk, D, style, eps, scale, mscale, seed)
    finally:
        if spec:
            mp.undo()


def _qk_norm_rope_case(blocks, T, Hq, Hk, D, style, eps, scale, mscale, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, Hq * D, generator=g) * scale).bfloat16()
    k = (torch.randn(T, Hk * D, generator=g) * scale).bfloat16()
    v = torch.randn(T, Hk * D, generator=g).bfloat16()
    qw, kw = (torch.randn(D, generator=g).bfloat16() for _ in range(2))
    rope = blocks.Rope(D, 1.0 / (1e4 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)), mscale, style)
    pos = torch.randint(0, 5000, (T,), generator=g)
    cs = rope.cos_sin(pos)
    qh, kh = q.view(T, Hq, D), k.view(T, Hk, D)
    with torch.no_grad():
        fused = blocks.qk_norm_rope_rows(qh, kh, v, qw, kw, eps, rope, cs)
    assert fused is not None
    qk = rope(blocks.rms_norm_heads([(qh, qw), (kh, kw)], eps), pos, cs)
    rows = torch.cat([qk[:, Hq:].reshape(T, -1), v], -1)
    assert torch.equal(_bits(fused[0]), _bits(qk[:, :Hq])) and torch.equal(_bits(fused[1]), _bits(rows))
    with torch.enable_grad():          # with grad the unfused ops run
        assert blocks.qk_norm_rope_rows(qh, kh, v, qw.clone().requires_grad_(True), kw, eps, rope,
                                        cs) is None


def test_qk_norm_rope_kernel_equals_its_specification():
    """The fused kernel and :func:`cpu_norm.qk_norm_rope_spec` directly, both layouts, strided
    inputs (views of a wider projection) and a head dim above the kernel's limit (the spec runs)."""
    g = torch.Generator().manual_seed(11)
    for D, style in ((128, "neox"), (64, "gptj"), (2, "neox"), (2048, "gptj")):
        T, Hq, Hk = 7, 4, 2
        qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).bfloat16()
        q = qkv[:, :Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D)
        v = qkv[:, (Hq + Hk) * D:]
        qw, kw = (torch.randn(D, generator=g).bfloat16() for _ in range(2))
        cos, sin = torch.randn(T, 1, D // 2, generator=g), torch.randn(T, 1, D // 2, generator=g)
        got = cn.qk_norm_rope(q, k, v, qw, kw, cos, sin, 1e-6, style == "gptj")
        want = cn.qk_norm_rope_spec(q, k, v, qw, kw, cos, sin, 1e-6, style == "gptj")
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want)), (D, style)


@pytest.mark.skipif(native.lib() is None, reason="compiled kernels unavailable")
@settings(max_examples=50, deadline=None)
@given(T=st.integers(1, 24), K=st.sampled_from([8, 40, 128, 200]), Hq=st.sampled_from([1, 2, 4]),
       Hk=st.sampled_from([1, 2]), D=st.sampled_from([2, 16, 64]),
       style=st.sampled_from(["neox", "gptj"]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       strided=st.booleans(), norms=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_projections_norms_and_rope_in_one_call_equal_the_separate_calls(T, K, Hq, Hk, D, style,
                                                                          scale, strided, norms,
                                                                          bias, seed):
    """A small decode step's q/k/v projections (+ biases, Qwen2's) + per-head norms (Qwen3's; none
    for Llama / Mistral) + RoPE + cache rows in one C call (``blocks.qkv_norm_rope_rows``): the
    bits of the calls it replaces — ``linear_many``, the bf16 bias adds, then
    ``qk_norm_rope_rows`` or ``rope`` and ``cat`` — x and the weights read in place
    (``strided``: rows of wider tensors)."""
    from skyrl_numerics.invariant import blocks

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K + (8 if strided else 0), generator=g) * scale).bfloat16()[:, :K]

    def weight(rows):
        w = (torch.randn(rows, K + (8 if strided else 0), generator=g) * K ** -0.5).bfloat16()
        return w[:, :K]
    ws = [weight(Hq * D), weight(Hk * D), weight(Hk * D)]
    qw, kw = (torch.randn(D, generator=g).bfloat16() if norms else None for _ in range(2))
    bs = [torch.randn(w.shape[0], generator=g).bfloat16() for w in ws] if bias else None
    rope = blocks.Rope(D, 1.0 / (1e4 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)), 1.0, style)
    pos = torch.randint(0, 5000, (T,), generator=g)
    cs = rope.cos_sin(pos)
    with torch.no_grad():
        got = blocks.qkv_norm_rope_rows(x, ws, qw, kw, 1e-6, rope, cs, D, bs)
        q, k, v = blocks.linear_many(x, ws)
        if bias:
            q, k, v = (t + b for t, b in zip((q, k, v), bs))
        if norms:
            want = blocks.qk_norm_rope_rows(q.view(T, Hq, D), k.view(T, Hk, D), v, qw, kw, 1e-6, rope, cs)
        else:
            qk = rope(torch.cat([q.view(T, Hq, D), k.view(T, Hk, D)], dim=1), pos, cs)
            want = qk[:, :Hq], torch.cat([qk[:, Hq:].reshape(T, -1), v], dim=-1)
    assert got is not None
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(_bits(got[1]), _bits(want[1]))


def test_projections_in_one_call_only_where_they_apply():
    """None (the caller runs the separate calls) with grad, for fp32, and for a step large enough
    for the thread pool; the separate calls' bits in every case (they are what runs then)."""
    from skyrl_numerics.invariant import blocks
    from skyrl_numerics.kernels.pool import PAR_MIN_WORK

    D, K = 16, 64
    rope = blocks.Rope(D, 1.0 / (1e4 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)), 1.0, "neox")
    ws = [torch.randn(2 * D, K).bfloat16(), torch.randn(D, K).bfloat16(), torch.randn(D, K).bfloat16()]
    qw, kw = torch.ones(D).bfloat16(), torch.ones(D).bfloat16()
    big = PAR_MIN_WORK // (K * 4 * D) + 1
    cs = rope.cos_sin(torch.arange(big))
    x = torch.randn(big, K).bfloat16()
    with torch.no_grad():
        assert blocks.qkv_norm_rope_rows(x, ws, qw, kw, 1e-6, rope, cs, D) is None
        assert blocks.qkv_norm_rope_rows(x[:4].float(), ws, qw, kw, 1e-6, rope,
                                         rope.cos_sin(torch.arange(4)), D) is None
    with torch.enable_grad():
        w0 = ws[0].clone().requires_grad_(True)
        assert blocks.qkv_norm_rope_rows(x[:4], [w0, *ws[1:]], qw, kw, 1e-6, rope,
                                         rope.cos_sin(torch.arange(4)), D) is None
