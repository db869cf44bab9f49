"""Triton kernels under the interpreter: batch invariance (bitwise), agreement with the
float64 reference, decode == prefill for attention, gradients vs reference.

Each test runs per ``device`` (tests/device_cases.py): ``cpu`` is marked ``interpreter`` and runs
in a child pytest with ``TRITON_INTERPRET=1`` in the child's environment only
(tests/triton_child.py); ``cuda`` is marked ``gpu`` (compiled kernels on CUDA tensors, skipped
without a CUDA device)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.kernels import ops, reference as ref
from skyrl_numerics.kernels import tl_attention, tl_matmul, tl_rmsnorm, tl_softmax, tl_reduce

from device_cases import ATTENTION_DECODE, DEVICES, DRY, SMALL, attention_tiles

pytestmark = [pytest.mark.triton,
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
HS = settings(max_examples=3 if DRY else 8, deadline=None)   # the GPU check's dry run: fewer
on_devices = pytest.mark.parametrize("device", DEVICES)


@on_devices
@HS
@given(M=st.integers(1, 40), K=st.integers(1, 50), N=st.integers(1, 40), m=st.integers(1, 40),
       bias=st.booleans())
def test_matmul_prefix_invariant_and_close(M, K, N, m, bias, device):
    m = min(m, M)
    a, b = torch.randn(M, K), torch.randn(K, N)
    c = torch.randn(N) if bias else None
    full = tl_matmul.matmul(a, b, c, config=SMALL)
    assert torch.equal(tl_matmul.matmul(a[:m], b, c, config=SMALL), full[:m])
    torch.testing.assert_close(full, ref.matmul(a, b, c), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_runs_under_the_interpreter():
    from skyrl_numerics.kernels._util import interpreting
    from triton.runtime.interpreter import InterpretedFunction
    assert interpreting() and isinstance(tl_matmul.matmul_kernel, InterpretedFunction)


@on_devices
def test_matmul_rows_invariant_under_concatenation_and_shuffle(device):
    a, b = torch.randn(23, 40), torch.randn(40, 33)
    full = tl_matmul.matmul(a, b, config=SMALL)
    other = torch.randn(9, 40) * 100
    mixed = torch.cat([other[:4], a, other[4:]])
    assert torch.equal(tl_matmul.matmul(mixed, b, config=SMALL)[4:27], full)
    perm = torch.randperm(23)
    assert torch.equal(tl_matmul.matmul(a[perm], b, config=SMALL), full[perm])


@on_devices
def test_matmul_bf16_and_default_config(device):
    a, b = torch.randn(70, 96).bfloat16(), torch.randn(96, 48).bfloat16()
    out = ops.matmul(a, b, backend="triton")
    assert out.dtype == torch.bfloat16
    assert torch.equal(ops.matmul(a[:3], b, backend="triton"), out[:3])
    torch.testing.assert_close(out, ref.matmul(a, b), rtol=1e-2, atol=1e-2)


@on_devices
def test_matmul_autograd_matches_reference(device):
    a = torch.randn(12, 20, requires_grad=True)
    b = torch.randn(20, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    g = torch.randn(12, 8)
    ops.matmul(a, b, bias, backend="triton").backward(g)
    a2, b2, c2 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    (a2 @ b2 + c2).backward(g.double())
    for got, want in ((a.grad, a2.grad), (b.grad, b2.grad), (bias.grad, c2.grad)):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@on_devices
@HS
@given(B=st.integers(1, 4), M=st.integers(1, 20), K=st.integers(1, 30), N=st.integers(1, 20))
def test_bmm_invariant_and_close(B, M, K, N, device):
    a, b = torch.randn(B, M, K), torch.randn(B, K, N)
    full = tl_matmul.bmm(a, b, config=SMALL)
    assert torch.equal(tl_matmul.bmm(a[:, :1], b, config=SMALL), full[:, :1])
    assert torch.equal(tl_matmul.bmm(a[:1], b[:1], config=SMALL), full[:1])
    torch.testing.assert_close(full, ref.bmm(a, b), rtol=1e-5, atol=1e-5)


@on_devices
@HS
@given(counts=st.lists(st.integers(0, 20), min_size=1, max_size=5), K=st.integers(1, 24),
       N=st.integers(1, 24))
def test_grouped_matmul_rows_do_not_depend_on_other_experts(counts, K, N, device):
    E = len(counts)
    offs = torch.tensor([0] + counts).cumsum(0)
    T = int(offs[-1])
    x, w = torch.randn(T, K), torch.randn(E, K, N)
    out = tl_matmul.grouped_matmul(x, w, offs, config=SMALL)
    torch.testing.assert_close(out, ref.grouped_matmul(x, w, offs), rtol=1e-5, atol=1e-5)
    # Each expert's rows alone (other experts empty) give the same bits: no cross-row influence.
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e + 1])
        alone = torch.zeros(E + 1, dtype=torch.long)
        alone[e + 1:] = hi - lo
        got = tl_matmul.grouped_matmul(x[lo:hi], w, alone, config=SMALL)
        assert torch.equal(got, out[lo:hi])


@on_devices
@HS
@given(M=st.integers(1, 12), V=st.integers(1, 70), m=st.integers(1, 12), scale=st.floats(0.1, 30))
def test_log_softmax_invariant_close(M, V, m, scale, device):
    m = min(m, M)
    x = torch.randn(M, V) * scale
    full = tl_softmax.log_softmax_fwd(x, block=16)
    assert torch.equal(tl_softmax.log_softmax_fwd(x[:m], block=16), full[:m])
    torch.testing.assert_close(full, ref.log_softmax(x), rtol=1e-5, atol=1e-5)


@on_devices
def test_log_softmax_autograd(device):
    x = torch.randn(6, 50, requires_grad=True)
    g = torch.randn(6, 50)
    ops.log_softmax(x, backend="triton").backward(g)
    x2 = x.detach().double().requires_grad_()
    torch.log_softmax(x2, -1).backward(g.double())
    torch.testing.assert_close(x.grad, x2.grad.float(), rtol=1e-5, atol=1e-5)


@on_devices
@HS
@given(M=st.integers(1, 10), V=st.integers(2, 80), T=st.sampled_from([1.0, 0.7, 1.3]),
       m=st.integers(1, 10))
def test_token_logprob_entropy_invariant_close(M, V, T, m, device):
    m = min(m, M)
    x = torch.randn(M, V) * 4
    t = torch.randint(0, V, (M,))
    lp, ent, _ = tl_softmax.token_logprob_entropy_fwd(x, t, T, block=16)
    lp_m, ent_m, _ = tl_softmax.token_logprob_entropy_fwd(x[:m], t[:m], T, block=16)
    assert torch.equal(lp_m, lp[:m]) and torch.equal(ent_m, ent[:m])
    rlp, rent = ref.token_logprob_entropy(x, t, T)
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=2e-5)


@on_devices
def test_token_logprob_entropy_grad_vs_reference(device):
    x = torch.randn(2, 3, 40, requires_grad=True)
    t = torch.randint(0, 40, (2, 3))
    glp, gent = torch.randn(2, 3), torch.randn(2, 3)
    lp, ent = ops.token_logprob_entropy(x, t, 0.8, backend="triton")
    (lp * glp + ent * gent).sum().backward()
    x2 = x.detach().double().requires_grad_()
    logp = torch.log_softmax(x2 / 0.8, -1)
    lp2 = logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    ent2 = -(logp.exp() * logp).sum(-1)
    (lp2 * glp + ent2 * gent).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad.float(), rtol=1e-5, atol=1e-5)


@on_devices
def test_entropy_hand_computed(device):
    # uniform over 4 -> H = log 4, logprob = -log 4; one-hot-ish -> H ~ 0
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    lp, ent, _ = tl_softmax.token_logprob_entropy_fwd(x, torch.tensor([2, 0]), 1.0, block=2)
    torch.testing.assert_close(lp, torch.tensor([-1.3862944, 0.0]))
    torch.testing.assert_close(ent, torch.tensor([1.3862944, 0.0]), atol=1e-6, rtol=0)


@on_devices
@HS
@given(M=st.integers(1, 20), N=st.integers(1, 48), m=st.integers(1, 20))
def test_rms_norm_forward_invariant_close(M, N, m, device):
    m = min(m, M)
    x, w = torch.randn(M, N), torch.randn(N)
    y, rstd = tl_rmsnorm.forward(x, w, 1e-6)
    y_m, rstd_m = tl_rmsnorm.forward(x[:m], w, 1e-6)
    assert torch.equal(y_m, y[:m]) and torch.equal(rstd_m, rstd[:m])
    torch.testing.assert_close(y, ref.rms_norm(x, w), rtol=1e-5, atol=1e-5)


@on_devices
@HS
@given(M=st.integers(1, 30), N=st.integers(1, 40), rows=st.sampled_from([1, 4, 7]))
def test_rms_norm_backward_dw_order_is_exact(M, N, rows, device):
    x, w, g = torch.randn(M, N), torch.randn(N), torch.randn(M, N)
    _, rstd = tl_rmsnorm.forward(x, w, 1e-6)
    dx, dw = tl_rmsnorm.backward(g, x, w, rstd, rows_per_block=rows, block_n=16)
    assert torch.equal(dw, ref.rms_norm_dw_ordered(g, x, rstd, rows))   # bitwise: order pinned
    rdx, rdw = ref.rms_norm_backward(g, x, w, rstd)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-4)
    dx_m, _ = tl_rmsnorm.backward(g[:1], x[:1], w, rstd[:1], rows_per_block=rows, block_n=16)
    assert torch.equal(dx_m, dx[:1])


@on_devices
def test_rms_norm_autograd(device):
    x = torch.randn(5, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    g = torch.randn(5, 32)
    ops.rms_norm(x, w, backend="triton").backward(g)
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * w2).backward(g.double())
    torch.testing.assert_close(x.grad, x2.grad.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad.float(), rtol=1e-5, atol=1e-5)


@on_devices
@HS
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), data=st.data())
def test_mean_sum_invariant_close(shape, data, device):
    x = torch.randn(*shape)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    keep = data.draw(st.booleans())
    for mean in (True, False):
        out = tl_reduce.reduce(x, [dim], keep, mean)
        want = (x.double().mean(dim, keepdim=keep) if mean else x.double().sum(dim, keepdim=keep)).float()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    if len(shape) >= 2 and dim % len(shape) != 0:
        full = tl_reduce.reduce(x, [dim], False, True)
        assert torch.equal(tl_reduce.reduce(x[:1], [dim], False, True), full[:1])


@on_devices
@pytest.mark.parametrize("H,Hkv,S", ATTENTION_DECODE)
def test_attention_decode_equals_prefill_bitwise(H, Hkv, S, device):
    ATT = attention_tiles(device)
    B, D = 2, 16
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    prefill = tl_attention.attention(q, k, v, mode="prefill", **ATT)
    torch.testing.assert_close(prefill, ref.attention(q, k, v), rtol=1e-5, atol=1e-5)
    cache_k = torch.zeros(B, Hkv, S + 5, D)   # a KV cache with spare capacity, filled as we go
    cache_v = torch.zeros(B, Hkv, S + 5, D)
    for t in range(S):
        cache_k[:, :, t], cache_v[:, :, t] = k[:, :, t], v[:, :, t]
        out = tl_attention.attention(q[:, :, t:t + 1], cache_k[:, :, :t + 1], cache_v[:, :, :t + 1],
                                     mode="decode", **ATT)
        assert torch.equal(out, prefill[:, :, t:t + 1]), f"query {t}"


@on_devices
def test_attention_chunked_prefill_and_batch_invariant(device):
    ATT = attention_tiles(device)
    B, H, S, D = 3, 2, 30, 16
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    full = tl_attention.attention(q, k, v, mode="prefill", **ATT)
    chunk = tl_attention.attention(q[:, :, 11:], k, v, mode="prefill", **ATT)   # second chunk
    assert torch.equal(chunk, full[:, :, 11:])
    assert torch.equal(tl_attention.attention(q[:1], k[:1], v[:1], **ATT), full[:1])
    out = ops.attention(q, k, v, backend="triton")
    torch.testing.assert_close(out, ref.attention(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter   # on a GPU: test_mode.py's test_mode_claimed_ops_rows_invariant_on_device
def test_mode_cuda_table_kernels_on_cpu_tensors():
    """The kernels the mode registers for the CUDA key (Triton), run here on CPU tensors in the
    interpreter: the ops the CPU key also has (_grouped_mm in its three layouts, _softmax and its
    backward, the .out forms, the rest of the matmul family, mean.dim) agree with the CPU table and give each row the same bits
    for a batch prefix."""
    from skyrl_numerics.kernels import mode
    K, C = mode._cuda_kernels(), mode._CPU_KERNELS
    assert set(K) == set(C) - mode.CPU_ONLY
    x, g = torch.randn(7, 40) * 3, torch.randn(7, 40)
    for dim in (-1, 0):
        y = K["_softmax"](x, dim, False)
        torch.testing.assert_close(y, torch.softmax(x.double(), dim).float(), rtol=1e-5, atol=1e-6)
        dx = K["_softmax_backward_data"](g, y, dim, torch.float32)
        torch.testing.assert_close(dx, C["_softmax_backward_data"](g, y, dim, torch.float32),
                                   rtol=1e-5, atol=1e-6)
        lp = K["_log_softmax"](x, dim, False)
        torch.testing.assert_close(lp, torch.log_softmax(x.double(), dim).float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(K["_softmax"](x[:2], -1, False), K["_softmax"](x, -1, False)[:2])
    assert torch.equal(K["_softmax_backward_data"](g[:2], K["_softmax"](x[:2], -1, False), -1, torch.float32),
                       K["_softmax_backward_data"](g, K["_softmax"](x, -1, False), -1, torch.float32)[:2])
    assert K["_softmax"](x.bfloat16(), -1, True).dtype == torch.float32
    assert K["_softmax"](x.bfloat16(), -1, False).dtype == torch.bfloat16
    # _grouped_mm: (S, K) x (G, K, N) with offs (row ends; rows past the last end stay zero)
    a, w = torch.randn(10, 12), torch.randn(3, 12, 5)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)
    out = K["_grouped_mm"](a, w, offs)
    torch.testing.assert_close(out, C["_grouped_mm"](a, w, offs), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[8:], torch.zeros(2, 5))
    assert torch.equal(K["_grouped_mm"](a[:3], w, torch.tensor([3, 3, 3], dtype=torch.int32)), out[:3])
    # (G, M, K) x (G, K, N) without offs; (K, S) x (S, N) with offs (the expert-weight gradient)
    a3, b3 = torch.randn(3, 4, 12), torch.randn(3, 12, 5)
    torch.testing.assert_close(K["_grouped_mm"](a3, b3), C["_grouped_mm"](a3, b3), rtol=1e-5, atol=1e-5)
    at, bs = torch.randn(12, 10), torch.randn(10, 5)
    wg = K["_grouped_mm"](at, bs, offs)
    assert wg.shape == (3, 12, 5) and torch.equal(wg[1], torch.zeros(12, 5))
    torch.testing.assert_close(wg, C["_grouped_mm"](at, bs, offs), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError):
        K["_grouped_mm"](a3, bs, offs)
    # .out forms write the op's result into out (resized)
    b2, bias = torch.randn(12, 6), torch.randn(6)
    for op, args in (("mm", (a, b2)), ("addmm", (bias, a, b2)), ("bmm", (a3, b3))):
        o = torch.empty(0)
        assert K[f"{op}.out"](*args, out=o) is o and torch.equal(o, K[op](*args))
        torch.testing.assert_close(o, C[op](*args), rtol=1e-5, atol=1e-5)
    assert torch.equal(K["mm"](a[:1], b2), K["mm"](a, b2)[:1])
    # the rest of the matmul family (mode_matmul: the same formulas over the Triton primitives)
    acc, v = torch.randn(10, 6), torch.randn(12)
    for op, args, kw in (("addmm_", (acc.clone(), a, b2), {"beta": 0.5}), ("mv", (a, v), {}),
                         ("addmv", (acc[:, 0], a, v), {"alpha": 2.0}), ("dot", (v, v), {}),
                         ("addbmm", (acc, torch.randn(3, 10, 12), torch.randn(3, 12, 6)), {}),
                         ("mm.dtype", (a, b2, torch.float32), {}),
                         ("baddbmm_", (torch.randn(3, 4, 5), a3, b3), {"alpha": 3.0})):
        ref = C[op](*(t.clone() if isinstance(t, torch.Tensor) else t for t in args), **kw)
        got = K[op](*args, **kw)                                    # (in place: args[0] written)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(K["mv"](a[:3], v), K["mv"](a, v)[:3])
    assert torch.equal(K["addmm_"](acc[:2].clone(), a[:2], b2), K["addmm"](acc, a, b2)[:2])
    m = K["mean.dim"](x, [-1], False)
    torch.testing.assert_close(m, x.double().mean(-1).float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(K["mean.dim"](x[:2], [-1], False), m[:2])
