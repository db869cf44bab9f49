"""Would AVX512-BF16's ``vdpbf16ps`` make the invariant bf16 GEMM faster? The prototype kernel
``benchmarks/dpbf16/gemm_bf16_dp.c`` (the instruction's exact arithmetic, emulated bit for bit
without it: ``benchmarks/dpbf16/probe.c`` measured that arithmetic) against the package's fma
kernel (``kernels/csrc/gemm_bf16.c``) and stock torch's bf16 ``F.linear`` (oneDNN / AMX on an
AVX512-BF16 + AMX host), at Qwen3-8B (dense) and Qwen3-30B-A3B expert shapes.

First a check: the prototype built for this CPU (the instruction), for AVX-512 without BF16
(``-march=skylake-avx512``: the vector emulation), for AVX2 + FMA (``-march=x86-64-v3``) and
without ``-march`` (scalar) give the same bits, and those of :func:`linear_dp_spec` (torch ops),
on random rows and on rows with denormals, values near 2^-126, inf and NaN. Then the timings:
one thread, calls interleaved round by round, each call's CPU time of this thread
(``time.thread_time``: a loaded host's waiting is not counted), medians, and per call the
median over rounds of the ratio to the fma kernel built the same way (> 1: the prototype is
faster).

    PYTHONPATH=src .venv/bin/python benchmarks/dpbf16_ab.py [--rounds 5] [--check-only]

Prints a markdown table.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from skyrl_numerics.kernels import cpu_gemm_bf16, native
from skyrl_numerics.kernels.fixed_order import fma

HERE = Path(__file__).resolve().parent
PROTO = HERE / "dpbf16" / "gemm_bf16_dp.c"
BUILDS = {   # name: -march flags (the rest of native.BASE_FLAGS is added)
    "host": ("-O3", "-march=native"),
    "avx512": ("-O3", "-march=skylake-avx512"),
    "avx2": ("-O3", "-march=x86-64-v3"),
    "scalar": ("-O2",),
}
PATHS = {2: "vdpbf16ps", 1: "emulated (vector fma)", 0: "emulated (scalar)"}
SHAPES = [   # (name, M, K, N)
    ("Qwen3-8B gate/up, 1 row", 1, 4096, 12288),
    ("Qwen3-8B down, 1 row", 1, 12288, 4096),
    ("Qwen3-8B o_proj, 4 rows", 4, 4096, 4096),
    ("Qwen3-8B down, 8 rows", 8, 12288, 4096),
    ("Qwen3-8B o_proj, 64 rows", 64, 4096, 4096),
    ("Qwen3-8B gate/up, 128 rows", 128, 4096, 12288),
    ("Qwen3-8B o_proj, 256 rows", 256, 4096, 4096),
    ("30B-A3B expert gate, 2 rows", 2, 2048, 768),
    ("30B-A3B expert down, 8 rows", 8, 768, 2048),
    ("30B-A3B expert gate, 64 rows", 64, 2048, 768),
]
LANES, BLOCK = 16, 32
MIN_NORMAL = 2.0 ** -126
TINY_EDGE = 2.0 ** -126 - 2.0 ** -151


# -- the torch specification of the prototype (its header comment, op for op) ------------------

def _daz(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t.abs() < MIN_NORMAL, torch.copysign(torch.zeros_like(t), t), t)


def dp(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``dp(c, a, b)``: denormals read as zero; a·b + c rounded once; a result that rounds (24
    bits, unbounded exponent) below 2^-126 becomes zero of its sign."""
    a, b, c = _daz(a), _daz(b), _daz(c)
    r = fma(a, b, c)
    p = a.double() * b.double()            # exact: 8 x 8 significant bits
    cd = c.double()
    s = cd + p
    bv = s - cd                            # TwoSum: s + t = a·b + c exactly
    t = (cd - (s - bv)) + (p - bv)
    below = (s.abs() < TINY_EDGE) | ((s.abs() == TINY_EDGE) & (t != 0) & ((t < 0) != (s < 0)))
    tiny = (r.abs() < MIN_NORMAL) | ((r.abs() == MIN_NORMAL) & below)
    return torch.where(tiny, torch.copysign(torch.zeros_like(r), r), r)


def linear_dp_spec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.float()
    M, K = x.shape
    N = w.shape[0]
    K32 = -(-K // BLOCK) * BLOCK
    xp = torch.zeros(M, K32)
    xp[:, :K] = x
    wp = torch.zeros(N, K32)
    wp[:, :K] = w.float()
    acc = torch.zeros(M, N, LANES)
    for u in range(0, K32, BLOCK):
        for first in (1, 0):               # the odd element of each pair first
            sl = slice(u + first, u + BLOCK, 2)
            acc = dp(acc, xp[:, None, sl], wp[None, :, sl])
    h = acc[..., :8] + acc[..., 8:]
    b = h[..., :4] + h[..., 4:]
    q = b[..., :2] + b[..., 2:]
    o = q[..., 0] + q[..., 1]
    return torch.where(torch.isnan(o), torch.full_like(o, float("nan")), o)


# -- the prototype through ctypes ----------------------------------------------------------------

def build(name: str, out_dir: str) -> ctypes.CDLL:
    path = Path(out_dir) / f"dpbf16_{name}.so"
    cmd = ["cc", *BUILDS[name], *native.BASE_FLAGS[1:], "-I", str(native.CSRC), "-o", str(path),
           str(PROTO), "-lm"]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(path))
    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.skyrl_bf16_pack_rows.restype = i64
    lib.skyrl_bf16_pack_rows.argtypes = [vp, i32, i64, i64, i64, vp, vp, vp]
    lib.skyrl_gemm_bf16_dp.restype = i32
    lib.skyrl_gemm_bf16_dp.argtypes = [vp, i64, vp, vp, i64, vp, i64, i64, i64, i64, i64]
    lib.skyrl_gemm_bf16_dp_path.restype = i32
    return lib


def proto_linear(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (bfloat16) times ``w [N, K].T`` with the prototype, one thread, float32."""
    M, K = x.shape
    N = w.shape[0]
    K32 = -(-K // BLOCK) * BLOCK
    xb = torch.empty(M, K32, dtype=torch.bfloat16)
    exact = np.empty(M, dtype=np.uint8)
    minexp = np.empty(M, dtype=np.int32)
    lib.skyrl_bf16_pack_rows(x.data_ptr(), 1, K, M, K, xb.data_ptr(), exact.ctypes.data,
                             minexp.ctypes.data)
    out = torch.empty(M, N)
    rc = lib.skyrl_gemm_bf16_dp(xb.data_ptr(), K32, minexp.ctypes.data, w.data_ptr(), K,
                                out.data_ptr(), N, M, K, 0, N)
    if rc != 0:
        raise RuntimeError(f"skyrl_gemm_bf16_dp rc {rc}")
    return out


def _cases():
    g = torch.Generator().manual_seed(0)
    out = []
    for M, K, N in [(1, 64, 8), (3, 70, 13), (5, 131, 64), (17, 768, 50), (1, 2048, 97), (4, 15, 9)]:
        out.append((torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()))
    # specials: denormals, values whose products and partial sums sit at 2^-126, inf, NaN
    x = (torch.randn(6, 96, generator=g) * 2.0 ** -60).bfloat16()
    w = (torch.randn(11, 96, generator=g) * 2.0 ** -66).bfloat16()
    x[0, :5] = torch.tensor([2.0 ** -130, -(2.0 ** -127), 2.0 ** -126, 1.0, -1.0]).bfloat16()
    w[0, :5] = torch.tensor([1.0, 2.0 ** -133, 2.0 ** 1, 2.0 ** -126, 2.0 ** -126]).bfloat16()
    x[1, 7] = float("inf")
    w[2, 9] = float("nan")
    x[3, 1] = -0.0
    out.append((x, w))
    # a denormal weight against large activations (every exponent sum of normal values >= 143)
    x = ((torch.rand(3, 40, generator=g) + 1) * 2.0 ** 20).bfloat16()
    w = torch.randn(5, 40, generator=g).bfloat16()
    w[1] = 0.0
    w[1, 3] = 2.0 ** -130                  # alone in its row: read unflushed it would give ~2^-110 x
    w[2, 0] = -(2.0 ** -133)
    out.append((x, w))
    return out


def check(libs: dict) -> None:
    for i, (x, w) in enumerate(_cases()):
        want = linear_dp_spec(x, w).view(torch.int32)
        for name, lib in libs.items():
            got = proto_linear(lib, x, w).view(torch.int32)
            if not torch.equal(got, want):
                bad = int((got != want).sum())
                raise SystemExit(f"case {i}: build {name} differs from the spec in {bad} outputs")
    print("check: " + ", ".join(f"{n} ({PATHS[int(lib.skyrl_gemm_bf16_dp_path())]})" for n, lib in libs.items())
          + f" == torch spec on {len(_cases())} cases (specials included)")


def _time(fns: dict, rounds: int) -> dict:
    for f in fns.values():
        f()
    t = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.thread_time()
            f()
            t[k].append(time.thread_time() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp()
    os.environ.setdefault("SKYRL_NUMERICS_CACHE_DIR", tmp)
    libs = {name: build(name, tmp) for name in BUILDS}
    check(libs)
    if args.check_only:
        return
    fma_libs = {"host": native.load(native.build()),
                "avx2": native.load(native.build(("-O3", "-march=x86-64-v3") + native.BASE_FLAGS[1:]))}
    print(f"host: torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| shape (M × K × N) | stock ms | fma ms | dp ms | fma/dp | stock/fma | stock/dp "
          "| AVX2: fma ms | AVX2: dp emulated ms | AVX2 fma/dp |")
    print("|---" * 10 + "|")
    g = torch.Generator().manual_seed(0)
    for name, M, K, N in SHAPES:
        x = torch.randn(M, K, generator=g).bfloat16()
        w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
        xf = x.float()

        def fma_kernel(lib):
            def run():
                native._LIB = lib          # the library cpu_gemm_bf16 calls (native.lib())
                cpu_gemm_bf16.linear_f32(xf, w)
            return run
        fns = {"stock": lambda: torch.nn.functional.linear(x, w),
               "fma": fma_kernel(fma_libs["host"]), "dp": lambda: proto_linear(libs["host"], x, w),
               "fma2": fma_kernel(fma_libs["avx2"]), "dp2": lambda: proto_linear(libs["avx2"], x, w)}
        t = _time(fns, args.rounds)
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}

        def ratio(a, b):
            return statistics.median(p / q for p, q in zip(t[a], t[b]))
        print(f"| {name}, {M} × {K} × {N} | {med['stock']:.2f} | {med['fma']:.2f} | {med['dp']:.2f} | "
              f"{ratio('fma', 'dp'):.2f}× | {ratio('stock', 'fma'):.2f}× | {ratio('stock', 'dp'):.2f}× | "
              f"{med['fma2']:.2f} | {med['dp2']:.2f} | {ratio('fma2', 'dp2'):.2f}× |", flush=True)


if __name__ == "__main__":
    main()
