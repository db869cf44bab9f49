"""GPU: the invariant Triton kernels vs the stock baseline in the same process, bf16.

matmul / bmm / grouped matmul against cuBLAS (``torch.matmul`` / ``torch.bmm`` /
``torch._grouped_mm``) and attention (prefill, decode) against torch SDPA. Every case records
``ours_ms``, ``base_ms`` (median of CUDA-event timings, same tensors) and ``frac_of_base`` =
``base_ms / ours_ms`` (1.0: as fast as the baseline) in ``benchmark.extra_info`` and as junit
properties (``benchmarks/gpu_check.py`` reads them into gpu.json). Marked ``gpu``: skipped
without a CUDA device.

    python -m pytest benchmarks/bench_gpu_kernels.py -o python_files='bench_*.py' -m gpu --benchmark-only
    python benchmarks/gpu_check.py OUT --sections matmul_perf,attention_perf   # budgeted, gpu.json

In ``benchmarks/gpu_check.py --dry-run`` (``SKYRL_NUMERICS_GPU_DRY_RUN=1``, ``TRITON_INTERPRET=1``)
the same code runs on tiny CPU tensors in the Triton interpreter, against torch on CPU.
"""
from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

DRY = os.environ.get("SKYRL_NUMERICS_GPU_DRY_RUN") == "1"
DEV = "cpu" if DRY else "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.triton,
              pytest.mark.skipif(not (DRY or torch.cuda.is_available()), reason="no CUDA device")]

if DRY:
    REPS, WARM = 1, 0
    MATMUL = [(M, K, N) for K in (32, 64) for N in (32, 64) for M in (1, 16)]
    BMM, GROUPED = [(2, 1, 32, 32)], [(2, 16, 32, 32)]
    ATTN = [(1, 2, 1, 32, 32, 16), (1, 2, 1, 1, 64, 16)]
else:
    REPS, WARM = 20, 3
    MATMUL = [(M, K, N) for K in (4096, 7168, 14336) for N in (4096, 7168, 14336) for M in (1, 16, 256, 4096)]
    BMM = [(8, 1, 4096, 4096), (8, 256, 4096, 4096), (32, 256, 1024, 1024)]
    GROUPED = [(8, 4096, 4096, 14336), (8, 4096, 14336, 4096), (64, 16384, 2048, 1408)]
    ATTN = [(1, 32, 8, 1024, 1024, 128), (1, 32, 8, 4096, 4096, 128), (8, 32, 8, 1, 1024, 128),
            (8, 32, 8, 1, 4096, 128), (1, 32, 8, 1, 16384, 128)]
BLAS = "CPU BLAS" if DRY else "cuBLAS"
T = dict(backend="triton")


def time_ms(fn, reps: int = REPS, warm: int = WARM) -> float:
    """Median ms of ``reps`` calls after ``warm`` calls (CUDA events on the GPU)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if DEV == "cuda":
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def compare(benchmark, record_property, ours, base, baseline: str, flops: float | None = None, **shape):
    """Times ours and the baseline in this process; records the row (junit + extra_info)."""
    ours_ms, base_ms = time_ms(ours), time_ms(base)

    def synced():
        ours()
        if DEV == "cuda":
            torch.cuda.synchronize()
    benchmark.pedantic(synced, rounds=max(REPS // 4, 1), warmup_rounds=0, iterations=1)
    row = dict(shape, ours_ms=ours_ms, base_ms=base_ms, frac_of_base=base_ms / ours_ms, baseline=baseline)
    if flops:
        row.update(ours_tflops=flops / ours_ms / 1e9, base_tflops=flops / base_ms / 1e9)
    for k, v in row.items():
        benchmark.extra_info[k] = v
        record_property(k, v)
    return row


def rnd(*shape, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(torch.bfloat16)


@pytest.mark.parametrize("M,K,N", MATMUL)
def test_matmul_vs_cublas(benchmark, record_property, M, K, N):
    from skyrl_numerics.kernels import ops
    a, b = rnd(M, K), rnd(K, N, seed=1)
    compare(benchmark, record_property, lambda: ops.matmul(a, b, **T), lambda: torch.matmul(a, b),
            f"torch.matmul ({BLAS})", flops=2 * M * K * N, op="matmul", M=M, K=K, N=N)


@pytest.mark.parametrize("B,M,K,N", BMM)
def test_bmm_vs_cublas(benchmark, record_property, B, M, K, N):
    from skyrl_numerics.kernels import ops
    a, b = rnd(B, M, K), rnd(B, K, N, seed=1)
    compare(benchmark, record_property, lambda: ops.bmm(a, b, **T), lambda: torch.bmm(a, b),
            f"torch.bmm ({BLAS})", flops=2 * B * M * K * N, op="bmm", B=B, M=M, K=K, N=N)


@pytest.mark.parametrize("E,Tn,K,N", GROUPED)
def test_grouped_matmul_vs_torch_grouped_mm(benchmark, record_property, E, Tn, K, N):
    """~uniform routing; our time includes the public API's offsets check (a device-to-host copy).
    Baseline ``torch._grouped_mm`` where this torch / device has it, else a per-expert mm loop."""
    from skyrl_numerics.kernels import ops
    x, w = rnd(Tn, K), rnd(E, K, N, seed=1)
    ends = torch.linspace(Tn / E, Tn, E).round().to(torch.int32).to(DEV)
    offs = torch.cat([ends.new_zeros(1), ends]).to(torch.int64)
    try:
        torch._grouped_mm(x, w, offs=ends)
        base, baseline = (lambda: torch._grouped_mm(x, w, offs=ends)), "torch._grouped_mm"
    except (RuntimeError, NotImplementedError, AttributeError) as exc:   # older torch / arch
        bounds = offs.tolist()
        base = lambda: [x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(E)]  # noqa: E731
        baseline = f"per-expert torch.mm (torch._grouped_mm: {type(exc).__name__})"
    compare(benchmark, record_property, lambda: ops.grouped_matmul(x, w, offs, **T), base, baseline,
            flops=2 * Tn * K * N, op="grouped_matmul", E=E, M=Tn, K=K, N=N)


@pytest.mark.parametrize("B,H,Hkv,Sq,Skv,D", ATTN)
def test_attention_vs_sdpa(benchmark, record_property, B, H, Hkv, Sq, Skv, D):
    """Prefill (Sq == Skv, causal) and decode (one query over the cache). Two SDPA baselines, the
    faster is the row's: K/V repeated to H heads (repeat not timed) and native GQA."""
    import torch.nn.functional as F

    from skyrl_numerics.kernels import ops
    q, k, v = rnd(B, H, Sq, D), rnd(B, Hkv, Skv, D, seed=1), rnd(B, Hkv, Skv, D, seed=2)
    causal = Sq == Skv
    kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    bases = {"torch SDPA (K/V repeated to H heads)":
             lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)}
    if "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or ""):
        bases["torch SDPA (enable_gqa=True)"] = \
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    ms = {name: time_ms(fn) for name, fn in bases.items()}
    baseline = min(ms, key=ms.get)
    compare(benchmark, record_property, lambda: ops.attention(q, k, v, causal=True, **T), bases[baseline],
            baseline, op="attention " + ("prefill" if causal else "decode"), B=B, H=H, Hkv=Hkv, Sq=Sq,
            Skv=Skv, D=D)
