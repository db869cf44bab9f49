"""Two builds of the C kernels, one process: this checkout's and another source tree's (e.g. a
``git worktree`` of an earlier commit), built with the same flags, timed on the same inputs in
interleaved rounds, and checked bit for bit against each other (a change meant to be a pure
speed-up must give the same bits).

    git worktree add /tmp/old <commit>
    PYTHONPATH=src .venv/bin/python benchmarks/kernels_build_ab.py --old-src /tmp/old/src [--march x86-64-v3]

Prints a markdown table: op, shape, bitwise, best-of-rounds microseconds old / new, ratio. One
thread (the engines' setting); the calls go through the Python wrappers (their overhead is in
both columns alike).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from skyrl_numerics.kernels import cpu_attention, cpu_gemm_bf16, native

GEMMS = [(1, 256, 128), (16, 256, 128), (32, 64, 128), (32, 128, 64),        # tiny-model shapes
         (1, 768, 2048), (4, 768, 2048), (32, 768, 2048), (128, 768, 2048), (1, 2048, 768)]
ATTENTION = [(16, 4, 2, 64, 64, 1), (16, 4, 2, 64, 96, 1), (4, 32, 4, 128, 80, 1),
             (4, 32, 4, 128, 48, 48)]                                     # B, H, Hkv, D, L, Sq


def build_in(src: str, flags) -> str:
    """The library path of ``src``'s kernels built with ``flags`` (a child process imports that
    tree's ``native``; the cache folder is shared, keyed by the sources)."""
    code = f"from skyrl_numerics.kernels import native; print(native.build({tuple(flags)!r}))"
    env = dict(os.environ, PYTHONPATH=src)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True)
    return r.stdout.strip().splitlines()[-1]


def best_us(lib, fn, n: int) -> float:
    native._LIB = lib
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def compare(name: str, shape: str, fn, libs, n: int, rounds: int) -> str:
    outs = []
    for lib in libs:
        native._LIB = lib
        outs.append(fn())
    same = torch.equal(outs[0].view(torch.int16) if outs[0].dtype == torch.bfloat16 else outs[0],
                       outs[1].view(torch.int16) if outs[1].dtype == torch.bfloat16 else outs[1])
    times = [[], []]
    for _ in range(rounds):
        for i, lib in enumerate(libs):
            times[i].append(best_us(lib, fn, n))
    old, new = min(times[0]), min(times[1])
    return f"| {name} | {shape} | {same} | {old:.1f} | {new:.1f} | {old / new:.2f}× |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-src", required=True, help="the other tree's src/ folder")
    ap.add_argument("--march", default="native", help="-march of both builds (x86-64-v3: AVX2)")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    flags = ("-O3", f"-march={a.march}") + native.BASE_FLAGS[1:]
    libs = [native.load(build_in(a.old_src, flags)), native.load(native.build(flags))]
    print(f"-march={a.march}; old: {a.old_src}; new: this checkout\n")
    print("| op | shape | bitwise | old µs | new µs | old / new |\n|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for M, N, K in GEMMS:
        x = torch.randn(M, K, generator=g).bfloat16()
        w = torch.randn(N, K, generator=g).bfloat16()
        print(compare("bf16 GEMM", f"{M} × {N} × {K}", lambda: cpu_gemm_bf16.linear_f32(x, w),
                      libs, max(5, int(3e7 / (M * N * K))), a.rounds), flush=True)
    for B, H, Hkv, D, L, Sq in ATTENTION:
        S = B * L + 7
        kp = torch.randn(S, Hkv, D, generator=g).bfloat16()
        vp = torch.randn(S, Hkv, D, generator=g).bfloat16()
        rows = torch.randperm(S, generator=g)[:B * L].view(B, L)
        lens = torch.tensor([L - (i % 3) for i in range(B)])
        q = torch.randn(B, H, Sq, D, generator=g).bfloat16()
        print(compare("paged attention", f"B {B}, H {H}/{Hkv}, D {D}, L {L}, Sq {Sq}",
                      lambda: cpu_attention.paged_attention(q, kp, vp, rows, lens, D ** -0.5),
                      libs, max(5, int(2e6 / (B * H * Sq * L * D))), a.rounds), flush=True)


if __name__ == "__main__":
    main()
