"""What the batch-invariant CPU path relies on, as properties that run on this host's ISA and —
through ``tests/test_isa_matrix.py`` — again under every lower capability it can emulate
(``ATEN_CPU_CAPABILITY`` / ``MKL_ENABLE_INSTRUCTIONS`` / ``ONEDNN_MAX_CPU_ISA``):

* the stock pointwise ops the mode leaves alone give an element the same bits in ATen's
  vectorized body and in its scalar tail (so a row's bits do not depend on where it falls in a
  flattened tensor); the ops that do not (sigmoid, silu, gelu, softplus, their backwards, bf16
  rsqrt) do once the mode is on;
* ``cpu.row_sum`` is the pairwise tree its docstring states (a numpy float32 model of the tree,
  IEEE additions only, gives the same bits) and trailing zeros do not change it;
* ``cpu.bmm`` rows do not depend on M, on N or on zero padding of K;
* SDPA under the mode: a sequence's rows inside a right-padded batch (bool or float mask, GQA,
  causal) equal the sequence alone, forward and the gradients of its own rows; and they are
  close to a float64 reference attention (value and gradients).
"""
from __future__ import annotations

import contextlib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

from skyrl_numerics.kernels import batch_invariant_mode, cpu, cpu_reduce

pytestmark = pytest.mark.isa
HS = settings(max_examples=40, deadline=None)


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2048, generator=g) * s for s in (0.05, 1, 4, 20, 90)])
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 1e4, -1e4])])
    return x.to(dtype)


# op: (fn, domain map) — every stock pointwise op the supported families reach that the mode
# leaves stock (tests/kernels/test_mode_trace.py lists the trace)
STOCK = {
    "exp": torch.exp, "log": lambda x: torch.log(x.abs() + 1e-3), "expm1": torch.expm1,
    "log1p": lambda x: torch.log1p(x.abs()), "tanh": torch.tanh, "sin": torch.sin, "cos": torch.cos,
    "sqrt": lambda x: torch.sqrt(x.abs()), "pow2": lambda x: x.pow(2), "pow_half": lambda x: x.abs().pow(0.5),
    "reciprocal": torch.reciprocal, "div": lambda x: x / 3.7, "mul": lambda x: x * 1.3, "neg": torch.neg,
    "tanh_backward": lambda x: torch.ops.aten.tanh_backward(torch.full_like(x, 0.3), torch.tanh(x)),
}
WRAPPED = {
    "sigmoid": torch.sigmoid, "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "softplus": F.softplus, "rsqrt": lambda x: torch.rsqrt(x.abs() + 1e-3),
    "silu_backward": lambda x: torch.ops.aten.silu_backward(torch.full_like(x, 0.3), x),
    "sigmoid_backward": lambda x: torch.ops.aten.sigmoid_backward(torch.full_like(x, 0.3), torch.sigmoid(x)),
    "gelu_backward": lambda x: torch.ops.aten.gelu_backward(torch.full_like(x, 0.3), x),
    "softplus_backward": lambda x: torch.ops.aten.softplus_backward(torch.full_like(x, 0.3), x, 1, 20),
}


def _tail_mismatches(fn, x) -> int:
    """Elements whose bits differ between one call on all of ``x`` (vector body; 10248 = a
    multiple of no vector step, so the end is a tail too) and one call per element (scalar)."""
    whole = fn(x).reshape(-1)
    alone = torch.cat([fn(x[i:i + 1]).reshape(-1) for i in range(x.numel())])
    same = (whole.view(torch.int16 if whole.dtype == torch.bfloat16 else torch.int32)
            == alone.view(torch.int16 if alone.dtype == torch.bfloat16 else torch.int32))
    return int((~same).sum())


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread for the ~10k one-element calls of :func:`_tail_mismatches`: oneDNN
    (behind ATen's gelu) runs even a 64-element op on every OpenMP thread, and on a loaded host
    each call then waits milliseconds at the barrier (measured: 1.5-15 ms a call with 2 threads,
    0.1-0.2 ms with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", sorted(STOCK))
def test_stock_pointwise_op_same_bits_in_vector_body_and_tail(op, dtype):
    with _one_thread():
        assert _tail_mismatches(STOCK[op], _inputs(dtype)) == 0, torch.backends.cpu.get_cpu_capability()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", sorted(WRAPPED))
def test_wrapped_pointwise_op_same_bits_at_any_position_under_the_mode(op, dtype):
    """Position: every element alone (one thread, see :func:`_one_thread`) == inside the whole
    tensor; threads: a tensor past one thread's piece (8 × 10,248 elements) gives the same bits
    on every thread and on one."""
    x = _inputs(dtype)
    big = torch.cat([x] * 8)
    with batch_invariant_mode():
        threaded = WRAPPED[op](big)
        with _one_thread():
            assert _tail_mismatches(WRAPPED[op], x) == 0
            assert torch.equal(WRAPPED[op](big).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               threaded.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_wrapped_ops_do_need_the_wrapper_here():
    """The reason for the wrappers, on this ISA: at least one of them rounds its tail unlike its
    body without the mode (if torch ever fixes that, the wrappers can go)."""
    x = _inputs(torch.float32)
    with _one_thread():
        assert sum(_tail_mismatches(WRAPPED[op], x) for op in ("sigmoid", "silu", "gelu")) > 0


# ---- row_sum: the tree, in numpy ---------------------------------------------------------------
def _np_tree(row: np.ndarray) -> np.float32:
    """cpu.row_sum's docstring written with numpy float32 additions."""
    x = row.astype(np.float32)
    P = min(1 << max(0, (len(x) - 1).bit_length()), cpu.SUM_BLOCK)
    nb = -(-len(x) // P)
    x = np.concatenate([x, np.zeros(nb * P - len(x), np.float32)]).reshape(nb, P)
    while x.shape[1] > 1:
        h = x.shape[1] // 2
        x = x[:, :h] + x[:, h:]
    s = x[:, 0]
    Q = 1 << max(0, (nb - 1).bit_length())
    s = np.concatenate([s, np.zeros(Q - nb, np.float32)])
    while len(s) > 1:
        h = len(s) // 2
        s = s[:h] + s[h:]
    return s[0] + np.float32(0)


@HS
@given(n=st.integers(1, 5000), pad=st.integers(0, 3000), rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_row_sum_is_the_tree_and_ignores_trailing_zeros(n, pad, rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.rand(rows, 1, generator=g) * 100
    got = cpu.row_sum(x)
    want = np.array([_np_tree(r) for r in x.numpy()])
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))
    padded = torch.cat([x, torch.zeros(rows, pad)], 1)
    assert torch.equal(cpu.row_sum(padded), got)
    assert torch.equal(cpu.row_sum(padded[-1:]), got[-1:])         # rows independent of M
    np.testing.assert_allclose(got.numpy(), x.double().sum(-1).numpy(), rtol=1e-5, atol=1e-3)


def test_row_sum_integers_and_edge_shapes():
    x = torch.randint(-2**40, 2**40, (3, 777))
    assert torch.equal(cpu.row_sum(x), x.sum(-1))
    assert torch.equal(cpu.row_sum(torch.ones(4, 3, dtype=torch.bool)), torch.full((4,), 3))
    assert cpu.row_sum(torch.zeros(2, 0)).shape == (2,)
    assert cpu.row_sum(-torch.zeros(1, 5)).view(torch.int32).item() == 0     # a sum of -0s is +0
    assert torch.isnan(cpu.row_sum(torch.tensor([[1.0, float("nan")]]))).all()


# ---- bmm ---------------------------------------------------------------------------------------
@HS
@given(K=st.integers(1, 700), ext=st.integers(1, 400), M=st.integers(1, 40), N=st.integers(1, 300),
       seed=st.integers(0, 2**16))
def test_bmm_rows_ignore_zero_padding_of_k_and_other_columns(K, ext, M, N, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, M, K, generator=g), torch.randn(2, K, N + ext, generator=g)
    base = cpu.bmm(a, b[:, :, :N])
    a2 = torch.cat([a, torch.zeros(2, M, ext)], 2)                  # K zero-padded ...
    b2 = torch.cat([b[:, :, :N], torch.randn(2, ext, N, generator=g)], 1)   # ... against anything
    assert torch.equal(cpu.bmm(a2, b2), base)
    assert torch.equal(cpu.bmm(a, b)[:, :, :N], base)               # N wider
    assert torch.equal(cpu.bmm(a[:1, -1:], b[:1, :, :N]), base[:1, -1:])   # one row alone


# ---- SDPA under the mode -----------------------------------------------------------------------
def _attn_case(seed, B, H, Hkv, lens, D, dtype):
    g = torch.Generator().manual_seed(seed)
    W = max(lens)
    q = torch.randn(B, H, W, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, W, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, W, D, generator=g).to(dtype)
    keep = torch.zeros(B, 1, W, W, dtype=torch.bool)
    for i, n in enumerate(lens):
        keep[i, :, :, :n] = True
    keep &= torch.ones(W, W, dtype=torch.bool).tril()
    return q, k, v, keep


def _sdpa(q, k, v, mask, w):
    """Output and the gradients of sum(out · w) (``w`` zero on rows the loss does not read)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    (out.double() * w.double()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _assert_close_to_float64(got, want, stock, rows, dtype, name, D):
    """The mode's error against float64 is of the size of the stock op's own: at most twice the
    stock error, plus four ulps of ``dtype`` at the tensor's magnitude (the result's rounding),
    plus four float32 ulps of a ``D``-term dot product of O(1) values (the accumulation: the
    inputs are standard normal, and where a gradient cancels to 0 — dQ of a one-key row — only
    that is left). bf16: a dK/dV element sums up to 40 query rows of bf16-rounded products, so
    neither error is a fixed number."""
    got, stock = got.double()[rows], stock.double()[rows]
    want = want[rows]
    eps32 = torch.finfo(torch.float32).eps
    floor = 4 * torch.finfo(dtype).eps * float(want.abs().max()) + 4 * eps32 * D ** 0.5
    err, stock_err = float((got - want).abs().max()), float((stock - want).abs().max())
    assert err <= 2 * stock_err + floor, (
        f"{name}: max |mode - float64| {err:.3g} > 2 x stock's {stock_err:.3g} + {floor:.3g}")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), lens=st.lists(st.integers(1, 40), min_size=2, max_size=4),
       gqa=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       float_mask=st.booleans())
@example(seed=0, lens=[1, 1, 33, 1], gqa=True, dtype=torch.bfloat16, float_mask=False)  # dv 0.029
@example(seed=707, lens=[1, 1], gqa=False, dtype=torch.float32, float_mask=False)   # dq = 0 exactly
def test_sdpa_rows_of_a_padded_batch_equal_the_sequence_alone(seed, lens, gqa, dtype, float_mask):
    B, H, D = len(lens), 4, 64
    Hkv = 2 if gqa else 4
    q, k, v, keep = _attn_case(seed, B, H, Hkv, lens, D, dtype)
    mask = keep if not float_mask else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    real = torch.zeros(B, 1, q.shape[2], 1)
    for i, n in enumerate(lens):
        real[i, :, :n] = 1                      # the loss reads real query rows only
    w = torch.randn(B, H, q.shape[2], D, generator=torch.Generator().manual_seed(seed + 1)) * real
    with batch_invariant_mode():
        out, dq, dk, dv = _sdpa(q, k, v, mask, w)
        for i, n in enumerate(lens):
            sl = (slice(i, i + 1), slice(None), slice(0, n))
            o1, q1, k1, v1 = _sdpa(q[sl], k[sl], v[sl], mask[sl][..., :n], w[sl])
            assert torch.equal(out[sl], o1), f"sequence {i} forward"
            assert torch.equal(dq[sl], q1) and torch.equal(dk[sl], k1) and torch.equal(dv[sl], v1), i
    # the same function as a float64 reference, and the stock op's own error against it
    ref = _sdpa(q.double(), k.double(), v.double(), keep, w)
    stock = _sdpa(q, k, v, mask, w)
    for got, want, st_, name in zip((out, dq, dk, dv), ref, stock, ("out", "dq", "dk", "dv")):
        rows = real.bool().expand_as(got) if name in ("out", "dq") else torch.ones_like(got, dtype=torch.bool)
        _assert_close_to_float64(got, want, st_, rows, dtype, name, D)


def test_sdpa_causal_flag_and_dropout_refused():
    q, k, v, keep = _attn_case(0, 1, 2, 2, [9], 64, torch.float32)
    with batch_invariant_mode():
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        assert torch.equal(a, b)
        # (SDPA with dropout takes the math path by itself; the CPU flash op refuses it)
        with pytest.raises(NotImplementedError, match="dropout"):
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.1, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [2, 4])
def test_sdpa_gqa_and_repeated_kv_give_the_same_bits(g, dtype):
    """transformers passes K/V heads with ``enable_gqa`` when there is no padding mask and
    repeats them (repeat_kv) when there is: under the mode both paths give the same bits."""
    q, k, v, keep = _attn_case(3, 2, 2 * g, 2, [11, 6], 64, dtype)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    with batch_invariant_mode():
        a = _sdpa(q, k, v, keep, w)
        kk, vv = (t.detach().clone().requires_grad_(True) for t in (k, v))
        out = F.scaled_dot_product_attention(q, kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1),
                                             attn_mask=keep)
        (out.double() * w.double()).sum().backward()
    assert torch.equal(a[0], out.detach()) and torch.equal(a[2], kk.grad) and torch.equal(a[3], vv.grad)


@pytest.mark.parametrize("shape", [(3, 5000), (2, 151936), (70, 1025), (1, 4096)])
def test_row_sum_c_kernel_equals_its_torch_code(shape, monkeypatch):
    from skyrl_numerics.kernels import native

    if native.lib() is None:
        pytest.skip(f"C kernels not built: {native.unavailable_reason()}")
    x = torch.randn(*shape) * 30
    x[..., -7:] = 0
    got = cpu.row_sum(x)
    monkeypatch.setattr(cpu_reduce, "_NATIVE_SUM_MIN", 1 << 62)
    assert torch.equal(got.view(torch.int32), cpu.row_sum(x).view(torch.int32))
    assert torch.equal(got, cpu.row_sum(x[..., :-7]))
