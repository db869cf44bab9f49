"""Issue 14's fast paths of the CPU kernels, each against the plain formulation it replaces
(the fused attention kernel has its own file, ``test_cpu_attention.py``):

- ``cpu.elementwise`` gives every element the vector-loop bits, whatever the tensor's size and
  the thread count (torch's own sigmoid/silu round the tail of a loop differently);
- ``blocks.head_matmuls`` (MLA's per-head absorbed products in one call) equals the per-head loop.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.kernels import cpu, matmul as inv_matmul
from skyrl_numerics.invariant import blocks

pytestmark = pytest.mark.isa   # also run under each lower CPU capability (tests/test_isa_matrix.py)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


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
