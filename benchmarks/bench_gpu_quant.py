"""GPU: the fused Triton fake-quant kernels' effective bandwidth vs ``y.copy_(x)``, same tensor,
same process (bf16, 64M elements; goal >= 80 % of the copy). Bytes = read + written.

Each case records ``ms``, ``gbs``, ``copy_gbs`` and ``frac_of_copy`` in ``benchmark.extra_info``
and as junit properties (``benchmarks/gpu_check.py`` reads them into gpu.json). Bitwise equality
with the torch recipe is a test, not a benchmark: tests/quant/test_triton.py (``-m gpu``). Marked
``gpu``: skipped without a CUDA device.

    python -m pytest benchmarks/bench_gpu_quant.py -o python_files='bench_*.py' -m gpu --benchmark-only
    SKYRL_QUANT_GPU_N=16777216 python -m pytest benchmarks/bench_gpu_quant.py -o python_files='bench_*.py'

In ``benchmarks/gpu_check.py --dry-run`` (``SKYRL_NUMERICS_GPU_DRY_RUN=1``, ``TRITON_INTERPRET=1``)
the same code runs on 4096 CPU elements in the Triton interpreter.
"""
from __future__ import annotations

import os

import pytest
import torch

from bench_gpu_kernels import DEV, DRY, REPS, time_ms

pytestmark = [pytest.mark.gpu, pytest.mark.triton,
              pytest.mark.skipif(not (DRY or torch.cuda.is_available()), reason="no CUDA device")]

N = 4096 if DRY else int(os.environ.get("SKYRL_QUANT_GPU_N", 64 * 2**20))
# one case per kernel path (the correctness case list is tests/device_cases.py's QUANT_CASES)
CASES = [("fp8_block", {}), ("fp8_block", {"ue8m0": True}), ("mxfp8", {}), ("mxfp8", {"scale_mode": "rceil"}),
         ("mxfp8", {"elem": "e5m2"}), ("mxfp4", {}), ("mxfp4", {"scale_mode": "rceil"}),
         ("nvfp4", {"convention": "vllm"}), ("nvfp4", {"convention": "te"}),
         ("nvfp4", {"convention": "modelopt"}), ("nvfp4", {"convention": "torchao"}),
         ("nvfp4", {"convention": "compressed_tensors"})]
IDS = [f"{r}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for r, o in CASES]


@pytest.fixture(scope="module")
def big():
    n = N - N % 4096
    g = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(n // 4096, 4096, generator=g, device=DEV) *
         torch.exp(torch.randn(n // 4096, 1, generator=g, device=DEV))).to(torch.bfloat16)
    y = torch.empty_like(x)
    return x, time_ms(lambda: y.copy_(x))


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_fake_quant_bandwidth_vs_copy(benchmark, record_property, big, case):
    from skyrl_numerics.quant.triton_fq import fake_quant_triton
    recipe, opts = CASES[case]
    x, copy_ms = big
    nbytes = 2 * x.numel() * x.element_size()
    ms = time_ms(lambda: fake_quant_triton(x, recipe, **opts))

    def synced():
        fake_quant_triton(x, recipe, **opts)
        if DEV == "cuda":
            torch.cuda.synchronize()
    benchmark.pedantic(synced, rounds=max(REPS // 4, 1), warmup_rounds=0, iterations=1)
    row = dict(recipe=recipe, opts=str(opts), n=x.numel(), ms=ms, gbs=nbytes / ms / 1e6,
               copy_gbs=nbytes / copy_ms / 1e6, frac_of_copy=copy_ms / ms, baseline="y.copy_(x)")
    for k, v in row.items():
        benchmark.extra_info[k] = v
        record_property(k, v)
