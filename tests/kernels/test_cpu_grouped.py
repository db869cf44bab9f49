"""Issue 14's fast paths of the CPU kernels, each against the plain formulation it replaces:

- ``cpu.attention`` computes a group of key blocks per pass (one GEMM call for all scores, one
  for ``p V``, a running max for ``m_j``); it must equal the online softmax one key block at a
  time (the loop below, written the direct way) bit for bit — signs of zeros included — for any
  pass size;
- ``cpu.elementwise`` gives every element the vector-loop bits, whatever the tensor's size and
  the thread count (torch's own sigmoid/silu round the tail of a loop differently);
- ``blocks.head_matmuls`` (MLA's per-head absorbed products in one call) equals the per-head loop.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.kernels import cpu, matmul as inv_matmul, reference as ref
from skyrl_numerics.trainer.invariant import blocks


def _bmm_views(a, b, rb):
    """``a (B, M, K) @ b (B, K, N)`` with ``a`` in zero-padded row blocks of ``rb`` and ``b``'s
    fp32 matrices passed to the GEMM as the views they are (key blocks transposed, value blocks
    as stored): one call per row-block index, as the one-block-at-a-time attention did."""
    B, M, K = a.shape
    N = b.shape[2]
    blocks, nb = cpu._row_blocks(a, rb)
    by = blocks.view(B, nb, rb, K)
    out = torch.empty((B, nb, rb, N))
    for j in range(nb):
        out[:, j] = cpu._gemm_blocks(by[:, j], b)
    return out.view(B, nb * rb, N)[:, :M]


def attention_block_loop(q, k, v, causal=True, scale=None, block_n=64, kv_lens=None):
    """The online softmax one key block at a time, each product a row-blocked GEMM:

        s = q K_j^T * scale (masked);  m' = max(m, rowmax s);  alpha = exp(m - m'*);  p = exp(s - m'*)
        l = l * alpha + rowsum p;  acc = acc * alpha + p V_j;   out = acc / l   (m'* = 0 where -inf)
    """
    B, H, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    kv_lens = torch.full((B,), Skv) if kv_lens is None else torch.as_tensor(kv_lens)
    lens = kv_lens.long().repeat_interleave(Hkv)[:, None, None]
    scale = D ** -0.5 if scale is None else scale
    g = H // Hkv
    qf = q.reshape(B * Hkv, g * Sq, D)
    pad = -Skv % block_n

    def padded(t):
        out = torch.zeros((B * Hkv, Skv + pad, D))
        out[:, :Skv] = t.reshape(B * Hkv, Skv, D)
        return out
    kf = padded(k)
    vf = kf if v is k else padded(v)
    qpos = torch.arange(Sq).repeat(g)[None, :, None] + (lens - Sq)
    m = torch.full((B * Hkv, g * Sq), float("-inf"))
    l_ = torch.zeros(B * Hkv, g * Sq)
    acc = torch.zeros(B * Hkv, g * Sq, D)
    rb = cpu.ATTN_ROW_BLOCK
    for n0 in range(0, Skv, block_n):
        kpos = torch.arange(n0, n0 + block_n)
        kb, vb = kf[:, n0:n0 + block_n], vf[:, n0:n0 + block_n]
        s = _bmm_views(qf, kb.transpose(1, 2), rb) * scale
        invalid = kpos[None, None, :] >= lens
        if causal:
            invalid = invalid | (kpos[None, None, :] > qpos)
        s = s.masked_fill(invalid, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = (m - m_safe).exp()
        p = (s - m_safe.unsqueeze(-1)).exp()
        l_ = l_ * alpha + cpu.row_sum(p.reshape(-1, block_n)).reshape(l_.shape)
        acc = acc * alpha.unsqueeze(-1) + _bmm_views(p, vb, rb)
        m = m_new
    out = (acc / l_.unsqueeze(-1)).reshape(B, Hkv, g, Sq, D).reshape(B, H, Sq, D)
    return out.to(q.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), Hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 2, 3, 8]),
       D=st.sampled_from([16, 64, 80]), Skv=st.integers(1, 260), sq=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), padded=st.booleans(),
       causal=st.booleans(), shared=st.booleans(), pass_bytes=st.sampled_from([1, 40000, None]),
       seed=st.integers(0, 2 ** 16))
def test_grouped_key_blocks_equal_the_block_loop(B, Hkv, g, D, Skv, sq, dtype, padded, causal,
                                                 shared, pass_bytes, seed):
    Sq = min(sq, Skv)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * g, Sq, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, Skv, D, generator=gen).to(dtype)
    v = k if shared else torch.randn(B, Hkv, Skv, D, generator=gen).to(dtype)
    lens = torch.randint(Sq, Skv + 1, (B,), generator=gen) if padded else None
    want = attention_block_loop(q, k, v, causal, None, 64, lens)
    with pytest.MonkeyPatch.context() as mp:
        if pass_bytes is not None:        # several passes, down to one key block per pass
            mp.setattr(cpu, "ATTN_PASS_BYTES", pass_bytes)
        got = cpu.attention(q, k, v, causal, None, 64, lens)
    assert torch.equal(_bits(got), _bits(want))


def test_grouped_attention_decode_of_a_padded_batch_equals_each_request_alone():
    """What the engine runs: 16 decodes over kv lengths 1 .. 200 in one padded call, each equal
    to that request's own prefill row."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 201, (16,), generator=gen)
    q = torch.randn(16, 4, 1, 64, generator=gen).bfloat16()
    k = torch.randn(16, 2, 200, 64, generator=gen).bfloat16()
    v = torch.randn(16, 2, 200, 64, generator=gen).bfloat16()
    batch = cpu.attention(q, k, v, True, None, 64, lens)
    for b in range(16):
        n = int(lens[b])
        qs = torch.randn(1, 4, n, 64, generator=gen).bfloat16()
        qs[:, :, -1] = q[b:b + 1, :, 0]
        alone = cpu.attention(qs, k[b:b + 1, :, :n], v[b:b + 1, :, :n], True)
        assert torch.equal(batch[b, :, 0], alone[0, :, -1]), b
    torch.testing.assert_close(batch[0:1, :, 0:1].float(), ref.attention(
        q[0:1].float(), k[0:1, :, :int(lens[0])].float(), v[0:1, :, :int(lens[0])].float())
        [:, :, -1:], rtol=2e-2, atol=2e-2)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5000), lo=st.integers(0, 4999), width=st.integers(1, 300),
       fn=st.sampled_from(["sigmoid", "silu"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       scale=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2 ** 16))
def test_elementwise_bits_do_not_depend_on_the_tensor_around_them(n, lo, width, fn, dtype, scale, seed):
    f = torch.sigmoid if fn == "sigmoid" else torch.nn.functional.silu
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    lo = min(lo, n - 1)
    hi = min(n, lo + width)
    full = cpu.elementwise(f, x)
    assert torch.equal(_bits(cpu.elementwise(f, x[lo:hi])), _bits(full[lo:hi]))
    assert torch.equal(_bits(cpu.elementwise(f, x[lo:hi].clone())), _bits(full[lo:hi]))
    # and the values are the op's (the vector path is torch's own sigmoid/silu)
    torch.testing.assert_close(full.float(), f(x.double()).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               atol=1e-6)


def test_elementwise_bits_do_not_depend_on_the_thread_count():
    n = torch.get_num_threads()
    x = torch.randn(3 * cpu.PIECE + 1001) * 4
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(cpu.elementwise(torch.sigmoid, x))
    finally:
        torch.set_num_threads(n)
    assert all(torch.equal(_bits(o), _bits(outs[0])) for o in outs[1:])
    assert torch.equal(_bits(cpu.elementwise(torch.sigmoid, x[-1001:])), _bits(outs[0][-1001:]))


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 40), E=st.sampled_from([8, 12, 16, 24]), t=st.integers(0, 39),
       scale=st.sampled_from([0.05, 1.0, 4.0]), seed=st.integers(0, 2 ** 16))
def test_sigmoid_router_rows_do_not_depend_on_the_batch(T, E, t, scale, seed):
    """DeepSeek's router on ``[T, E]`` fp32 logits: a token's weights and experts are the same
    alone as in any batch (E = 8 with an odd T put tokens in torch's scalar sigmoid tail)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen) * scale
    bias = torch.randn(E, generator=gen) * 0.01
    t = min(t, T - 1)
    w, ids = blocks.sigmoid_group_topk(logits, bias, 2, 4, 2, True, 2.5)
    w1, ids1 = blocks.sigmoid_group_topk(logits[t:t + 1], bias, 2, 4, 2, True, 2.5)
    assert torch.equal(ids1, ids[t:t + 1])
    assert torch.equal(_bits(w1), _bits(w[t:t + 1]))


@pytest.mark.parametrize("T", [1, 5, 16, 33, 100])
@pytest.mark.parametrize("H,K,N", [(4, 32, 128), (3, 64, 48), (16, 128, 512)])
def test_head_matmuls_equal_the_per_head_loop(T, H, K, N):
    gen = torch.Generator().manual_seed(T * H)
    x = torch.randn(T, H, K, generator=gen).bfloat16()
    W = torch.randn(H, K + N, 256, generator=gen).bfloat16()       # a kv_b_proj-like weight
    with torch.no_grad():
        mats = [W[h, :K, :N] for h in range(H)]                      # q_nope -> latent (K x N)
        want = torch.stack([inv_matmul(x[:, h].contiguous(), mats[h]) for h in range(H)], 1)
        assert torch.equal(blocks.head_matmuls(x, mats), want)
        w_uv = [W[h, K:K + N, :K] for h in range(H)]                  # latent -> v: x @ w.T
        want = torch.stack([blocks.linear(x[:, h].contiguous(), w_uv[h]) for h in range(H)], 1)
        assert torch.equal(blocks.head_matmuls(x, [w.t() for w in w_uv]), want)
        W.mul_(2)                                                     # in-place weight change
        want = torch.stack([inv_matmul(x[:, h].contiguous(), mats[h]) for h in range(H)], 1)
        assert torch.equal(blocks.head_matmuls(x, mats), want)       # cache follows the version
        own = [m.clone() for m in mats]                               # separate tensors: any one
        assert torch.equal(blocks.head_matmuls(x, own), want)        # changing in place is seen
        own[-1].mul_(-1)
        want = torch.stack([inv_matmul(x[:, h].contiguous(), own[h]) for h in range(H)], 1)
        assert torch.equal(blocks.head_matmuls(x, own), want)


@settings(max_examples=12, deadline=None)
@given(Hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 2, 3]), S=st.integers(65, 330),
       B=st.integers(1, 2), padded=st.booleans(), zeros=st.sampled_from(["none", "neg", "block"]),
       passes=st.sampled_from([1, 3, 8]), seed=st.integers(0, 2 ** 16))
def test_causal_prefill_skipping_masked_blocks_equals_the_block_loop(Hkv, g, S, B, padded, zeros,
                                                                    passes, seed):
    """A causal prefill long enough to have (row block, key block) pairs above the diagonal: the
    kernel skips them, the loop computes them. Bits equal, signs of zeros included — also with
    values that are all negative (products 0 · v = -0) or a whole block of zero values (an
    exactly zero ``acc``)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * g, S, 16, generator=gen).bfloat16()
    k = torch.randn(B, Hkv, S, 16, generator=gen).bfloat16()
    v = torch.randn(B, Hkv, S, 16, generator=gen).bfloat16()
    if zeros == "neg":
        v = -v.abs()
    elif zeros == "block":
        v[:, :, :64] = 0
    lens = torch.randint(S - 70, S + 1, (B,), generator=gen).clamp_(min=S // 2) if padded else None
    if lens is not None:
        lens = torch.maximum(lens, torch.tensor(1))
        q = q[:, :, :int(lens.min())]                    # queries sit at each sequence's end
    want = attention_block_loop(q, k, v, True, None, 64, lens)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "ATTN_CAUSAL_PASSES", passes)
        got = cpu.attention(q, k, v, True, None, 64, lens)
    assert torch.equal(_bits(got), _bits(want))
    if zeros == "block" and lens is None:                # the first 64 queries see only zeros
        assert torch.equal(_bits(got[:, :, :64]), _bits(torch.zeros_like(got[:, :, :64])))


@settings(max_examples=200, deadline=None)
@given(Sq=st.integers(1, 300), extra=st.integers(0, 300), g=st.integers(1, 9),
       key0=st.integers(0, 700))
def test_first_row_block_is_the_first_block_that_sees_the_key(Sq, extra, g, key0):
    """``_first_row_block`` against its definition: row r (query-major, rows padded to whole
    blocks) is query min(r // g, Sq - 1) at position query + max_last - (Sq - 1)."""
    rb = cpu.ATTN_ROW_BLOCK
    max_last = Sq - 1 + extra
    nb = -(-Sq * g // rb)
    pos = [min(r // g, Sq - 1) + max_last - (Sq - 1) for r in range(nb * rb)]
    sees = [b for b in range(nb) if max(pos[b * rb:(b + 1) * rb]) >= key0]
    want = sees[0] if sees else None
    got = cpu._first_row_block(key0, max_last, Sq, g, rb)
    assert (got >= nb) if want is None else (got == want)
    # every later block sees the key too (what makes a pass's rows a suffix)
    assert sees == list(range(sees[0], nb)) if sees else True


def test_causal_prefill_with_skipped_blocks_still_differentiates():
    """The passes rebuild (m, l, acc) rather than write rows in place, so autograd through a
    long causal prefill works and gives the reference gradients."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 300, 16, generator=gen).requires_grad_(True) for h in (4, 2, 2))
    cpu.attention(q, k, v).square().sum().backward()
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref.attention(qq, kk, vv, True, None).square().sum().backward()
    for a, b in ((q, qq), (k, kk), (v, vv)):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4)
