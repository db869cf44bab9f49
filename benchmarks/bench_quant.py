"""CPU throughput of each fake-quant recipe as a ratio to a plain FP8 cast on the same tensor.

Baseline (measured in the same process, same tensor): ``x.to(torch.float8_e4m3fn).to(x.dtype)``.
A ratio of 10 means the recipe takes 10x the time of that cast. ``fake_quant`` runs the fused CPU
path (scale + round-onto-the-grid + decode per block, in cache-sized chunks; bitwise equal to the
reference, tests/quant/test_recipes_fast.py); the "reference" column is the two-step
``dequantize(quantize(x))`` spec it replaced. See bench_gpu_quant.py for the Triton kernels (GPU).

pytest-benchmark (16M bf16 elements by default, the issue's size)::

    .venv/bin/python -m pytest benchmarks/bench_quant.py -o python_files='bench_*.py' \
        --benchmark-only -q

Table for BENCHMARKS.md (size from SKYRL_QUANT_BENCH_N, default 16M; SKYRL_QUANT_BENCH_REF=0
skips the slow reference column; SKYRL_QUANT_BENCH_THREADS=1 runs baseline and recipes on one
thread)::

    .venv/bin/python benchmarks/bench_quant.py
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from skyrl_numerics.quant import fake_quant
from skyrl_numerics.quant.api import _fake_quant_reference

N = int(os.environ.get("SKYRL_QUANT_BENCH_N", 16 * 2**20))
REF = os.environ.get("SKYRL_QUANT_BENCH_REF", "1") != "0"
REPEAT = int(os.environ.get("SKYRL_QUANT_BENCH_REPEAT", 3))
COLS = 4096

CASES = [
    ("fp8_tensor", {}), ("fp8_channel", {}), ("fp8_token", {}), ("fp8_block", {}),
    ("fp8_block", {"ue8m0": True}), ("mxfp8", {}), ("mxfp8", {"scale_mode": "rceil"}), ("mxfp4", {}),
    ("nvfp4", {"convention": "vllm"}), ("nvfp4", {"convention": "te"}), ("nvfp4", {"convention": "modelopt"}),
    ("nvfp4", {"convention": "torchao"}), ("nvfp4", {"convention": "compressed_tensors"}), ("int4_g32", {}),
]
IDS = [f"{r}-{'-'.join(f'{k}={v}' for k, v in o.items())}".rstrip("-") for r, o in CASES]


def make_x(n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n // COLS, COLS, generator=g).to(torch.bfloat16)


def baseline(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def best_of(fn, *args, repeat: int = 3, warmup: bool = True, **kw) -> float:
    if warmup:
        fn(*args, **kw)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args, **kw)
        ts.append(time.perf_counter() - t)
    return min(ts)


@pytest.fixture(scope="module")
def x():
    return make_x()


@pytest.fixture(scope="module")
def baseline_s(x):
    return best_of(baseline, x, repeat=5)


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_recipe_throughput(benchmark, x, baseline_s, case):
    recipe, opts = CASES[case]
    benchmark.pedantic(fake_quant, args=(x, recipe), kwargs=opts, rounds=3, iterations=1, warmup_rounds=1)
    base = min(baseline_s, best_of(baseline, x, repeat=3))        # re-measured next to the recipe
    benchmark.extra_info["baseline_fp8_cast_s"] = base
    benchmark.extra_info["ratio_vs_fp8_cast"] = benchmark.stats.stats.min / base


def main() -> None:
    if os.environ.get("SKYRL_QUANT_BENCH_THREADS"):         # e.g. 1: CPU work without thread-pool waits
        torch.set_num_threads(int(os.environ["SKYRL_QUANT_BENCH_THREADS"]))
    x = make_x()
    base = best_of(baseline, x, repeat=5)
    print(f"N = {x.numel():,} bf16 elements, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"baseline x.to(float8_e4m3fn).to(bf16): {base * 1e3:.1f} ms "
          f"({x.numel() / base / 1e6:.0f} Melem/s)\n")
    print("| recipe | options | fused (ms) | ratio vs fp8 cast | reference (ms) | reference ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for (recipe, opts), name in zip(CASES, IDS):
        t = best_of(fake_quant, x, recipe, repeat=REPEAT, **opts)
        b = min(base, best_of(baseline, x, repeat=3))              # re-measured next to the recipe
        o = ", ".join(f"{k}={v}" for k, v in opts.items()) or "-"
        ref = ""
        if REF:
            tr = best_of(_fake_quant_reference, x, recipe, repeat=1, warmup=False, **opts)
            ref = f"{tr * 1e3:.0f} | {tr / b:.1f}"
        print(f"| {recipe} | {o} | {t * 1e3:.0f} | {t / b:.2f} | {ref} |")


if __name__ == "__main__":
    main()
