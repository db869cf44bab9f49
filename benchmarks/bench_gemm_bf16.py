"""CPU: the bf16-weight invariant GEMM (``kernels/cpu_gemm_bf16``, weights read as stored) vs
stock torch's bf16 ``F.linear`` (what vLLM CPU runs for an unquantized linear where oneDNN has
no bf16 kernel, e.g. an AVX2 host) and vs the previous invariant path (MKL float32 GEMMs in
16-row blocks against a float32 copy of the weight), at the layer shapes of the real-dims
models of issue 26 (Qwen3-MoE-30B per layer: hidden 2048, q/k/v 4096/512/512, experts 768,
vocab 151,936). Same process, best of a few runs each; the ratio is stock / invariant (> 1:
the invariant GEMM is faster) and the extra bytes each path keeps beside the bf16 weight.

    .venv/bin/python -m pytest benchmarks/bench_gemm_bf16.py --benchmark-only -q -s
"""

import pytest
import torch

from skyrl_numerics.kernels import cpu_gemm, cpu_gemm_bf16
from _timing import best

SHAPES = [   # (name, M, K, N)
    ("lm_head decode", 1, 2048, 151936),
    ("lm_head 4 decodes", 4, 2048, 151936),
    ("qkv 4 decodes", 4, 2048, 5120),
    ("o_proj 4 decodes", 4, 4096, 2048),
    ("expert gate 2 rows", 2, 2048, 768),
    ("expert down 2 rows", 2, 768, 2048),
    ("qkv prefill 128", 128, 2048, 5120),
    ("o_proj prefill 128", 128, 4096, 2048),
    ("expert gate 64 rows", 64, 2048, 768),
]




@pytest.mark.parametrize("name,M,K,N", SHAPES, ids=[s[0].replace(" ", "_") for s in SHAPES])
def test_gemm_bf16(benchmark, name, M, K, N):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
    old_b = cpu_gemm.prepare_b(w.float().t())            # the float32 copy the old path kept
    stock = best(lambda: torch.nn.functional.linear(x, w))
    old = best(lambda: cpu_gemm.gemm_blocks(cpu_gemm.row_blocks(x.float())[0], old_b))
    benchmark.pedantic(lambda: cpu_gemm_bf16.linear(x, w), rounds=3, iterations=1)
    inv = best(lambda: cpu_gemm_bf16.linear(x, w))
    extra = {"stock_over_invariant": round(stock / inv, 3), "old_over_invariant": round(old / inv, 3),
             "old_extra_weight_bytes": old_b.numel() * 4, "invariant_extra_weight_bytes": 0}
    benchmark.extra_info.update(extra)
    print(f"\n{name} (M={M} K={K} N={N}): stock bf16 {stock * 1e3:.2f} ms, old invariant (fp32 copy) "
          f"{old * 1e3:.2f} ms, bf16 invariant {inv * 1e3:.2f} ms; stock/inv {stock / inv:.2f}, "
          f"old/inv {old / inv:.2f}; fp32 copy {old_b.numel() * 4 / 2**20:.0f} MiB -> 0")
