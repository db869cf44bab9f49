"""The invariant bf16 GEMM (``kernels/csrc/gemm_bf16.c``) against stock torch's bf16 ``F.linear``
(on an AVX-512 + AVX512-BF16/AMX host: oneDNN's bf16 GEMM, what stock vLLM CPU runs) at the
Qwen3-MoE-30B-A3B layer shapes, measured for a loaded shared host: one thread, the calls
interleaved round by round (stock, then each library), each call's *CPU time* of this thread
(``time.thread_time``: time the scheduler gives to other jobs is not counted), and per library
the median over rounds of stock / library (> 1: faster than stock).

Libraries: ``host`` (this checkout's kernels built for this CPU, as the engine runs them),
``avx2`` (the same sources built with ``-march=x86-64-v3``: what an AVX2 + FMA host runs; the
same bits, tested), ``amx`` (the host build's AMX arithmetic, ``SKYRL_NUMERICS_GEMM=amx``,
``kernels/cpu_gemm_amx.py``; where the CPU has AMX) and any ``--lib NAME=PATH`` (e.g. a build of an earlier commit's ``csrc``:
``cc -O3 -march=native -std=c11 -ffp-contract=off -fno-fast-math -fPIC -shared -I csrc -o
old.so csrc/*.c -lm``).

    PYTHONPATH=src .venv/bin/python benchmarks/gemm_bf16_ab.py [--rounds 7] [--lib old=/tmp/old.so]

Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

SHAPES = [   # (name, M, K, N)
    ("LM head (a quarter of 151,936), 4 rows", 4, 2048, 37984),
    ("qkv, 4 rows", 4, 2048, 5120),
    ("o_proj, 4 rows", 4, 4096, 2048),
    ("expert gate, 1 row", 1, 2048, 768),
    ("expert gate, 2 rows", 2, 2048, 768),
    ("expert down, 2 rows", 2, 768, 2048),
    ("expert gate, 8 rows", 8, 2048, 768),
    ("expert gate, 64 rows", 64, 2048, 768),
    ("qkv, 128 rows", 128, 2048, 5120),
    ("o_proj, 128 rows", 128, 4096, 2048),
]


def _libraries(extra: list[str]) -> dict:
    from skyrl_numerics.kernels import native

    os.environ.setdefault("SKYRL_NUMERICS_CACHE_DIR", tempfile.mkdtemp())
    avx2 = ("-O3", "-march=x86-64-v3") + native.BASE_FLAGS[1:]
    libs = {}
    for spec in extra:
        name, path = spec.split("=", 1)
        libs[name] = native.load(path)
    libs["host"] = native.load(native.build())
    libs["avx2"] = native.load(native.build(avx2))
    return libs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--lib", action="append", default=[], help="NAME=PATH of another build")
    args = ap.parse_args()

    import torch

    from skyrl_numerics.kernels import cpu_gemm_amx, cpu_gemm_bf16, native

    torch.set_num_threads(1)
    libs = _libraries(args.lib)
    arith = {k: "fma" for k in libs}
    native._LIB = libs["host"]
    if cpu_gemm_amx.available():
        libs["amx"], arith["amx"] = libs["host"], "amx"
    print(f"host: torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| shape (M × K × N) | stock ms | " + " | ".join(f"{k} ms" for k in libs)
          + " | " + " | ".join(f"stock / {k}" for k in libs) + " |")
    print("|---" * (2 + 2 * len(libs)) + "|")
    g = torch.Generator().manual_seed(0)
    for name, M, K, N in SHAPES:
        x = torch.randn(M, K, generator=g).bfloat16()
        w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
        fns = {"stock": lambda: torch.nn.functional.linear(x, w)}
        for k, lib in libs.items():
            def run(lib=lib, a=arith[k]):
                native._LIB = lib            # the library cpu_gemm_bf16 calls (native.lib())
                os.environ[cpu_gemm_amx.GEMM_ENV] = a
                cpu_gemm_bf16.linear_f32(x, w)
            fns[k] = run
        for f in fns.values():
            f()
        t = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                t0 = time.thread_time()
                f()
                t[k].append(time.thread_time() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        ratio = {k: statistics.median(s / i for s, i in zip(t["stock"], t[k])) for k in libs}
        print(f"| {name}, {M} × {K} × {N} | {med['stock']:.2f} | "
              + " | ".join(f"{med[k]:.2f}" for k in libs) + " | "
              + " | ".join(f"{ratio[k]:.2f}×" for k in libs) + " |", flush=True)


if __name__ == "__main__":
    main()
