"""CPU: the batch-invariant path (skyrl_numerics.kernels, backend="cpu") vs stock torch on the
same shapes, measured in the same process. The ratio is printed per shape (stock / invariant).

    .venv/bin/python -m pytest benchmarks/bench_kernels.py --benchmark-only -q
"""

import pytest
import torch

from skyrl_numerics.kernels import cpu
from _timing import best

SHAPES = [(1, 1024, 1024), (16, 1024, 1024), (128, 1024, 1024), (512, 1024, 1024)]




@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matmul_fp32(benchmark, M, K, N):
    a, b = torch.randn(M, K), torch.randn(K, N)
    stock = best(lambda: torch.mm(a, b), reps=5)
    benchmark(lambda: cpu.matmul_2d(a, b))
    inv = best(lambda: cpu.matmul_2d(a, b), reps=5)
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nmatmul fp32 M={M} K={K} N={N}: stock {stock * 1e3:.3f} ms, invariant {inv * 1e3:.3f} ms, "
          f"ratio {stock / inv:.2f}")


@pytest.mark.parametrize("M,V", [(1, 32768), (64, 32768)])
def test_log_softmax(benchmark, M, V):
    x = torch.randn(M, V)
    stock = best(lambda: torch.log_softmax(x, -1), reps=5)
    benchmark(lambda: cpu.log_softmax(x))
    inv = best(lambda: cpu.log_softmax(x), reps=5)
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nlog_softmax M={M} V={V}: stock {stock * 1e3:.3f} ms, invariant {inv * 1e3:.3f} ms, "
          f"ratio {stock / inv:.2f}")


@pytest.mark.parametrize("S", [128, 512])
def test_attention_prefill(benchmark, S):
    q, k, v = torch.randn(1, 4, S, 64), torch.randn(1, 2, S, 64), torch.randn(1, 2, S, 64)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    stock = best(lambda: sdpa(q, kr, vr, is_causal=True), reps=5)
    benchmark(lambda: cpu.attention(q, k, v))
    inv = best(lambda: cpu.attention(q, k, v), reps=5)
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nattention prefill S={S}: stock sdpa {stock * 1e3:.3f} ms, invariant {inv * 1e3:.3f} ms, "
          f"ratio {stock / inv:.2f}")


@pytest.mark.parametrize("S", [65, 200])
def test_attention_decode_padded_batch(benchmark, S):
    """The engine's decode step: 16 requests, one query each, bf16 K/V as the cache holds them
    (a padded batch with kv_lens), against SDPA on the same tensors (no padding)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 4, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(16, 2, S, 64, generator=g).bfloat16() for _ in range(2))
    lens = torch.full((16,), S)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    stock = best(lambda: sdpa(q, kr, vr), reps=20)
    benchmark(lambda: cpu.attention(q, k, v, True, None, 64, lens))
    inv = best(lambda: cpu.attention(q, k, v, True, None, 64, lens), reps=20)
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nattention decode 16 x S={S}: stock sdpa {stock * 1e6:.0f} us, invariant {inv * 1e6:.0f} us, "
          f"ratio {stock / inv:.2f}")


@pytest.mark.parametrize("M,N", [(16, 128), (4096, 1024)])
def test_rms_norm(benchmark, M, N):
    """The fused fixed-order RMSNorm vs the same formula in stock torch ops."""
    x, w = torch.randn(M, N).bfloat16(), torch.randn(N).bfloat16()

    def stock_norm():
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()
    stock = best(stock_norm, reps=20)
    benchmark(lambda: cpu.rms_norm(x, w, 1e-6))
    inv = best(lambda: cpu.rms_norm(x, w, 1e-6), reps=20)
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nrms_norm {M}x{N}: stock {stock * 1e6:.0f} us, invariant {inv * 1e6:.0f} us, "
          f"ratio {stock / inv:.2f}")


def test_qk_norm_rope_fused(benchmark):
    """Qwen3's per-head norms + RoPE + cache row, fused kernel vs the unfused invariant ops
    (same bits), 16 decode tokens, 4 query + 2 KV heads of 64."""
    from skyrl_numerics.invariant import blocks

    T, Hq, Hk, D = 16, 4, 2, 64
    q, k = torch.randn(T, Hq, D).bfloat16(), torch.randn(T, Hk, D).bfloat16()
    v = torch.randn(T, Hk * D).bfloat16()
    qw, kw = torch.randn(D).bfloat16(), torch.randn(D).bfloat16()
    rope = blocks.Rope(D, 1.0 / (1e4 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)))
    pos = torch.arange(T) + 100
    cs = rope.cos_sin(pos)

    def unfused():
        qk = rope(blocks.rms_norm_heads([(q, qw), (k, kw)], 1e-6), pos, cs)
        return qk[:, :Hq], torch.cat([qk[:, Hq:].reshape(T, -1), v], -1)
    with torch.no_grad():
        base = best(unfused, reps=20)
        benchmark(lambda: blocks.qk_norm_rope_rows(q, k, v, qw, kw, 1e-6, rope, cs))
        inv = best(lambda: blocks.qk_norm_rope_rows(q, k, v, qw, kw, 1e-6, rope, cs), reps=20)
    benchmark.extra_info["unfused_over_fused"] = round(base / inv, 3)
    print(f"\nqk_norm_rope T={T}: unfused {base * 1e6:.0f} us, fused {inv * 1e6:.0f} us, "
          f"ratio {base / inv:.2f}")


@pytest.mark.parametrize("M,V", [(64, 32768), (16, 151936)])
def test_row_sum_tree(benchmark, M, V):
    """cpu.row_sum (the fixed pairwise tree) vs torch's sum over the last dim."""
    x = torch.randn(M, V)
    stock = best(lambda: x.sum(-1), reps=5)
    benchmark(lambda: cpu.row_sum(x))
    inv = best(lambda: cpu.row_sum(x), reps=5)
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nrow_sum M={M} V={V}: stock sum {stock * 1e3:.3f} ms, tree {inv * 1e3:.3f} ms, ratio {stock / inv:.2f}")


@pytest.mark.parametrize("K", [128, 1024])
def test_bmm_k_chunks(benchmark, K):
    """cpu.bmm (K in chunks of 128, folded) vs torch.bmm: attention's p @ v over K keys."""
    a, b = torch.randn(8, 256, K), torch.randn(8, K, 64)
    stock = best(lambda: torch.bmm(a, b), reps=5)
    benchmark(lambda: cpu.bmm(a, b))
    inv = best(lambda: cpu.bmm(a, b), reps=5)
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nbmm 8x256x{K}x64: stock {stock * 1e3:.3f} ms, invariant {inv * 1e3:.3f} ms, ratio {stock / inv:.2f}")


@pytest.mark.parametrize("S", [128, 512])
def test_sdpa_forward_backward_under_the_mode(benchmark, S):
    """F.scaled_dot_product_attention forward + backward, right-padded batch of 4 (bool mask, GQA
    2:1): stock CPU flash kernel vs the mode's kernels/cpu_sdpa.py."""
    from skyrl_numerics.kernels import batch_invariant_mode

    q, k, v = (torch.randn(4, h, S, 64, requires_grad=True) for h in (8, 4, 4))
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(4, 1, S, S).clone()
    keep[1:, :, :, S // 2:] = False

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        out.sum().backward()
    stock = best(run, reps=3)

    def run_mode():
        with batch_invariant_mode():
            run()
    benchmark(run_mode)
    inv = best(run_mode, reps=3)
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nsdpa fwd+bwd B=4 H=8 S={S}: stock {stock * 1e3:.1f} ms, mode {inv * 1e3:.1f} ms, ratio {stock / inv:.2f}")
