"""GPU benchmark + bitwise checks for skyrl_numerics.kernels (run on an H200; no GPU here).

    python benchmarks/gpu_kernels.py            # invariance checks + TFLOP/s table
    python benchmarks/gpu_kernels.py --check    # only the bitwise invariance checks
    python benchmarks/gpu_kernels.py --dry-run  # CPU: parse args, list the shapes, exit

Matmul: invariant persistent kernel vs torch.matmul (cuBLAS), bf16, M in {1,16,128,1024,4096},
N = K in {4096, 8192}; goal >= 90 % of cuBLAS. Attention (prefill / decode) and log_softmax vs
torch. Timing: CUDA events, median of 20 after 5 warm-ups, in the same process.
"""
from __future__ import annotations

import argparse
import statistics

MS = (1, 16, 128, 1024, 4096)
NKS = (4096, 8192)


def _time(fn, reps=20, warm=5):
    import torch
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def check():
    """Bitwise invariance on the GPU (the interpreter cannot vouch for the MMA hardware)."""
    import torch
    from skyrl_numerics import kernels as K
    torch.manual_seed(0)
    ok = True
    a, b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    full = K.matmul(a, b)
    for m in (1, 7, 16, 127, 1000):
        same = torch.equal(K.matmul(a[:m], b), full[:m])
        ok &= same
        print(f"matmul rows invariant m={m}: {same}   (torch.matmul: {torch.equal(a[:m] @ b, (a @ b)[:m])})")
    x = torch.randn(64, 151936, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 151936, (64,), device="cuda")
    lp, ent = K.token_logprob_entropy(x, t)
    lp1, ent1 = K.token_logprob_entropy(x[:1], t[:1])
    same = torch.equal(lp1, lp[:1]) and torch.equal(ent1, ent[:1])
    ok &= same
    print(f"token_logprob_entropy invariant: {same}")
    B, H, Hkv, S, D = 2, 16, 4, 1500, 128
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    pre = K.attention(q, k, v)
    bad = sum(not torch.equal(K.attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1]), pre[:, :, i:i + 1])
              for i in range(0, S, 37))
    ok &= bad == 0
    print(f"attention decode==prefill mismatches: {bad}")
    return ok


def bench():
    import torch
    import torch.nn.functional as F
    from skyrl_numerics import kernels as K
    print("| op | shape | invariant ms | torch ms | invariant TFLOP/s | torch TFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for nk in NKS:
        b = torch.randn(nk, nk, device="cuda", dtype=torch.bfloat16)
        for m in MS:
            a = torch.randn(m, nk, device="cuda", dtype=torch.bfloat16)
            ti, tt = _time(lambda: K.matmul(a, b)), _time(lambda: a @ b)
            fl = 2 * m * nk * nk / 1e9
            print(f"| matmul | M={m} N=K={nk} | {ti:.3f} | {tt:.3f} | {fl / ti:.1f} | {fl / tt:.1f} | {tt / ti:.2f} |")
    for S in (1024, 4096):
        q = torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        ti = _time(lambda: K.attention(q, k, v))
        tt = _time(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
        print(f"| attention prefill | S={S} H=32 Hkv=8 D=128 | {ti:.3f} | {tt:.3f} | | | {tt / ti:.2f} |")
        qd = q[:, :, -1:]
        ti = _time(lambda: K.attention(qd, k, v))
        tt = _time(lambda: F.scaled_dot_product_attention(qd, kr, vr))
        print(f"| attention decode | S={S} | {ti:.3f} | {tt:.3f} | | | {tt / ti:.2f} |")
    for rows in (1, 256, 4096):
        x = torch.randn(rows, 151936, device="cuda", dtype=torch.bfloat16)
        ti, tt = _time(lambda: K.log_softmax(x)), _time(lambda: torch.log_softmax(x, -1))
        print(f"| log_softmax | {rows} x 151936 | {ti:.3f} | {tt:.3f} | | | {tt / ti:.2f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only the bitwise invariance checks")
    p.add_argument("--dry-run", action="store_true", help="list shapes and exit (no GPU needed)")
    args = p.parse_args(argv)
    if args.dry_run:
        print("matmul shapes:", [(m, nk) for nk in NKS for m in MS])
        return 0
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine (or use --dry-run)")
        return 2
    ok = check()
    if not args.check:
        bench()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
