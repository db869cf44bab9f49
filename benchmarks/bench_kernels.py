"""CPU: the batch-invariant path (skyrl_numerics.kernels, backend="cpu") vs stock torch on the
same shapes, measured in the same process. The ratio is printed per shape (stock / invariant).

    .venv/bin/python -m pytest benchmarks/bench_kernels.py --benchmark-only -q
"""
import time

import pytest
import torch

from skyrl_numerics.kernels import cpu

SHAPES = [(1, 1024, 1024), (16, 1024, 1024), (128, 1024, 1024), (512, 1024, 1024)]


def _best(fn, reps=5):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matmul_fp32(benchmark, M, K, N):
    a, b = torch.randn(M, K), torch.randn(K, N)
    stock = _best(lambda: torch.mm(a, b))
    benchmark(lambda: cpu.matmul_2d(a, b))
    inv = _best(lambda: cpu.matmul_2d(a, b))
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nmatmul fp32 M={M} K={K} N={N}: stock {stock * 1e3:.3f} ms, invariant {inv * 1e3:.3f} ms, "
          f"ratio {stock / inv:.2f}")


@pytest.mark.parametrize("M,V", [(1, 32768), (64, 32768)])
def test_log_softmax(benchmark, M, V):
    x = torch.randn(M, V)
    stock = _best(lambda: torch.log_softmax(x, -1))
    benchmark(lambda: cpu.log_softmax(x))
    inv = _best(lambda: cpu.log_softmax(x))
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nlog_softmax M={M} V={V}: stock {stock * 1e3:.3f} ms, invariant {inv * 1e3:.3f} ms, "
          f"ratio {stock / inv:.2f}")


@pytest.mark.parametrize("S", [128, 512])
def test_attention_prefill(benchmark, S):
    q, k, v = torch.randn(1, 4, S, 64), torch.randn(1, 2, S, 64), torch.randn(1, 2, S, 64)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    stock = _best(lambda: sdpa(q, kr, vr, is_causal=True))
    benchmark(lambda: cpu.attention(q, k, v))
    inv = _best(lambda: cpu.attention(q, k, v))
    benchmark.extra_info["stock_over_invariant"] = round(stock / inv, 3)
    print(f"\nattention prefill S={S}: stock sdpa {stock * 1e3:.3f} ms, invariant {inv * 1e3:.3f} ms, "
          f"ratio {stock / inv:.2f}")
