"""The fast CPU path: rows invariant under batch prefixes, shuffles and thread counts, close to
the float64 reference. Nothing here assumes the stock CPU ops are NOT invariant (that depends on
the machine's BLAS)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.kernels import cpu, ops, reference as ref

pytestmark = pytest.mark.isa   # also run under each lower CPU capability (tests/test_isa_matrix.py)

HS = settings(max_examples=15, deadline=None)


@pytest.fixture
def threads():
    """Run a block with a given torch thread count; the count is restored afterwards."""
    n = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(n)


def test_invariant_on_the_shapes_where_stock_mkl_is_not_here(threads):
    """The shapes where this machine's MKL differs (fp32 mm with M = 1 takes a small-M path; one
    row longer than 32768 is split across threads): ours gives each row the same bits for 1 row
    or 64 / 8 rows, and for 1 or several threads."""
    a, b = torch.randn(64, 256), torch.randn(256, 256)
    x = torch.randn(8, 40000)
    full_mm, full_mean = cpu.matmul_2d(a, b), cpu.reduce(x, [-1], False, True)
    for m in (1, 2, 5, 17):
        assert torch.equal(cpu.matmul_2d(a[:m], b), full_mm[:m])
        assert torch.equal(cpu.reduce(x[:m], [-1], False, True), full_mean[:m])
    threads(1)
    assert torch.equal(cpu.matmul_2d(a[:1], b), full_mm[:1]) and torch.equal(cpu.matmul_2d(a, b), full_mm)
    assert torch.equal(cpu.reduce(x[:1], [-1], False, True), full_mean[:1])
    torch.testing.assert_close(full_mm, ref.matmul(a, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(full_mean, x.double().mean(-1).float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thinking_machines_case_large_k(dtype, threads):
    """batch_invariant_ops' own check: row 0 of a (2048, 4096) @ (4096, 4096) product equals the
    (1, 4096) product. A single padded MKL GEMM failed it here (fp32: MKL changes kernels with M
    from ~200 rows on for K >= 1024); the fixed row blocks hold on 2 threads and on 1."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2048, 4096, generator=g).to(dtype)
    b = torch.randn(4096, 4096, generator=g).to(dtype)
    full = cpu.matmul_2d(a, b)
    assert torch.equal(cpu.matmul_2d(a[:1], b), full[:1])
    assert torch.equal(cpu.matmul_2d(a[1000:1001], b), full[1000:1001])
    threads(1)
    assert torch.equal(cpu.matmul_2d(a[:300], b), full[:300])


@settings(max_examples=12, deadline=None)
@given(M=st.integers(1, 700), K=st.sampled_from([1, 100, 1024, 1100, 2048]),
       N=st.sampled_from([1, 17, 256, 640]), m=st.integers(1, 700), lo=st.integers(0, 699),
       nthreads=st.sampled_from([1, 2]))
def test_matmul_rows_invariant_large(M, K, N, m, lo, nthreads):
    """Rows of any prefix or window equal the full product's, for K and M where MKL's own
    kernel choice changes with M, on 1 or 2 threads (the full product on the default count)."""
    m, lo = min(m, M), min(lo, M - 1)
    g = torch.Generator().manual_seed(M * 7 + K)
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    full = cpu.matmul_2d(a, b)
    n = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        assert torch.equal(cpu.matmul_2d(a[:m], b), full[:m])
        assert torch.equal(cpu.matmul_2d(a[lo:lo + m], b), full[lo:lo + m])
    finally:
        torch.set_num_threads(n)


def test_bmm_rows_independent_of_batch_and_m_large():
    """cpu.bmm: a matrix's rows are the same alone, with a 1-row query, or inside a batch of 6
    whose other matrices are larger (attention over many requests at once)."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 400, 1024, generator=g), torch.randn(6, 1024, 192, generator=g)
    full = cpu.bmm(a, b)
    assert torch.equal(cpu.bmm(a[3:4], b[3:4]), full[3:4])
    assert torch.equal(cpu.bmm(a[3:4, 100:101], b[3:4]), full[3:4, 100:101])
    # K = 1024 > K_CHUNK: the product of each depth chunk of K_CHUNK, folded left to right
    chunks = [cpu.matmul_2d(a[3, :, lo:lo + cpu.K_CHUNK], b[3, lo:lo + cpu.K_CHUNK])
              for lo in range(0, 1024, cpu.K_CHUNK)]
    want = chunks[0]
    for c in chunks[1:]:
        want = want + c
    assert torch.equal(want, full[3])
    # K <= K_CHUNK: one GEMM, matmul_2d's bits
    assert torch.equal(cpu.matmul_2d(a[3, :, :100], b[3, :100]), cpu.bmm(a[:, :, :100], b[:, :100])[3])


def test_check_cpu_invariance_holds_here():
    assert cpu.check_cpu_invariance()


@HS
@given(M=st.integers(1, 70), K=st.integers(1, 300), N=st.integers(1, 200), m=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans())
def test_matmul_rows_invariant(M, K, N, m, dtype, bias):
    m = min(m, M)
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    c = torch.randn(N).to(dtype) if bias else None
    full = ops.matmul(a, b, c, backend="cpu")
    assert torch.equal(ops.matmul(a[:m], b, c, backend="cpu"), full[:m])
    perm = torch.randperm(M)
    assert torch.equal(ops.matmul(a[perm], b, c, backend="cpu"), full[perm])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(full, ref.matmul(a, b, c), rtol=tol, atol=tol * max(1, K ** 0.5))


def test_matmul_transposed_weight_like_linear():
    a, w = torch.randn(40, 96), torch.randn(64, 96)
    full = cpu.matmul_2d(a, w.t())
    assert torch.equal(cpu.matmul_2d(a[:2], w.t()), full[:2])


@HS
@given(B=st.integers(1, 5), M=st.integers(1, 30), K=st.integers(1, 64), N=st.integers(1, 40))
def test_bmm_invariant(B, M, K, N):
    a, b = torch.randn(B, M, K), torch.randn(B, K, N)
    full = ops.bmm(a, b, backend="cpu")
    assert torch.equal(ops.bmm(a[:, :1], b, backend="cpu"), full[:, :1])
    assert torch.equal(ops.bmm(a[-1:], b[-1:], backend="cpu"), full[-1:])
    torch.testing.assert_close(full, ref.bmm(a, b), rtol=1e-5, atol=1e-4)


@HS
@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=6), K=st.integers(1, 48),
       N=st.integers(1, 48))
def test_grouped_matmul_invariant(counts, K, N):
    E = len(counts)
    offs = torch.tensor([0] + counts).cumsum(0)
    x, w = torch.randn(int(offs[-1]), K), torch.randn(E, K, N)
    out = ops.grouped_matmul(x, w, offs, backend="cpu")
    torch.testing.assert_close(out, ref.grouped_matmul(x, w, offs), rtol=1e-5, atol=1e-4)
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e + 1])
        if hi > lo:   # the first row of each expert alone
            assert torch.equal(cpu.matmul_2d(x[lo:lo + 1], w[e]), out[lo:lo + 1])


@HS
@given(M=st.integers(1, 9), V=st.sampled_from([1, 7, 100, 5000, 40000]), m=st.integers(1, 9))
def test_row_ops_invariant(M, V, m):
    m = min(m, M)
    x = torch.randn(M, V) * 3
    t = torch.randint(0, V, (M,))
    for fn in (cpu.log_softmax, cpu.softmax, lambda z: cpu.reduce(z, [-1], False, True)):
        full = fn(x)
        assert torch.equal(fn(x[:m]), full[:m])
    lp, ent, _ = cpu.token_logprob_entropy(x, t, 0.9)
    lp_m, ent_m, _ = cpu.token_logprob_entropy(x[:m], t[:m], 0.9)
    assert torch.equal(lp_m, lp[:m]) and torch.equal(ent_m, ent[:m])
    rlp, rent = ref.token_logprob_entropy(x, t, 0.9)
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu.log_softmax(x), ref.log_softmax(x), rtol=1e-5, atol=1e-4)


def test_autograd_cpu_vs_reference():
    x = torch.randn(4, 3, 30, requires_grad=True)
    w = torch.randn(30, requires_grad=True)
    t = torch.randint(0, 30, (4, 3))
    h = ops.rms_norm(x, w, backend="cpu")
    lp, ent = ops.token_logprob_entropy(ops.log_softmax(h, backend="cpu"), t, backend="cpu")
    (lp.sum() + 0.1 * ent.sum()).backward()
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    h2 = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * w2
    z = torch.log_softmax(torch.log_softmax(h2, -1), -1)
    lp2 = z.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    ent2 = -(z.exp() * z).sum(-1)
    (lp2.sum() + 0.1 * ent2.sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad.float(), rtol=1e-4, atol=1e-5)


def test_rms_norm_invariant():
    x, w = torch.randn(20, 4096), torch.randn(4096)
    y = ops.rms_norm(x, w, backend="cpu")
    assert torch.equal(ops.rms_norm(x[:1], w, backend="cpu"), y[:1])
    torch.testing.assert_close(y, ref.rms_norm(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H,Hkv,S,D", [(2, 2, 70, 16), (4, 2, 33, 64)])
def test_attention_decode_equals_prefill(H, Hkv, S, D):
    B = 2
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    prefill = ops.attention(q, k, v, backend="cpu")
    torch.testing.assert_close(prefill, ref.attention(q, k, v), rtol=1e-5, atol=1e-5)
    for t in range(S):
        out = ops.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], backend="cpu")
        assert torch.equal(out, prefill[:, :, t:t + 1]), f"query {t}"
    assert torch.equal(ops.attention(q[:1], k[:1], v[:1], backend="cpu"), prefill[:1])


def test_pool_path_under_inference_mode(threads):
    """vLLM runs the forward under ``torch.inference_mode``: the blocks split over the pool
    threads are written there too, with the same bits as one thread."""
    threads(2)
    a, b = torch.randn(300, 512), torch.randn(512, 256)
    with torch.inference_mode():
        out = cpu.matmul_2d(a, b)
    threads(1)
    assert torch.equal(out, cpu.matmul_2d(a, b))


def test_concurrent_python_threads_get_the_same_bits(threads):
    """The GEMMs set the (process-wide) thread count to one while they run; Python threads that
    call matmul at the same time must neither race that setting nor change each other's bits."""
    from concurrent.futures import ThreadPoolExecutor

    threads(2)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(400, 1024, generator=g), torch.randn(1024, 512, generator=g)
    want = cpu.matmul_2d(a, b)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: cpu.matmul_2d(a[i * 7:], b), range(12)))
    for i, o in enumerate(outs):
        assert torch.equal(o, want[i * 7:]), i
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("M,K,N", [(0, 8, 8), (8, 0, 8), (8, 8, 0), (0, 0, 0), (40, 0, 3)])
def test_empty_products(M, K, N):
    """Empty GEMMs (an expert that got no tokens: its weight gradient has K = 0) are zeros of the
    right shape, with the bias added; bmm too."""
    a, b, c = torch.randn(M, K), torch.randn(K, N), torch.randn(N)
    assert torch.equal(cpu.matmul_2d(a, b), torch.zeros(M, N))
    assert torch.equal(cpu.matmul_2d(a, b, c), torch.zeros(M, N) + c)
    assert torch.equal(ops.matmul(a.bfloat16(), b.bfloat16(), backend="cpu"), torch.zeros(M, N).bfloat16())
    assert torch.equal(cpu.bmm(a[None].expand(3, M, K), b[None].expand(3, K, N)), torch.zeros(3, M, N))
    assert torch.equal(cpu.bmm(torch.randn(0, M, K), torch.randn(0, K, N)), torch.zeros(0, M, N))
    q = torch.randn(2, 4, 0, 16)                       # attention with no queries
    assert cpu.attention(q, torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)).shape == (2, 4, 0, 16)
