"""GPU check + bandwidth of the fused Triton fake-quant kernels (run where a CUDA GPU exists).

For each kernel case: (1) bitwise check against the torch reference recipe on the GPU,
(2) time the kernel and report effective GB/s (bytes read + written) against the card's copy
bandwidth measured in the same process (``y.copy_(x)`` on the same tensor); goal >= 80 %.

    python benchmarks/gpu_quant.py                 # 64M bf16 elements on cuda:0
    python benchmarks/gpu_quant.py --n 16777216 --json out.json
    python benchmarks/gpu_quant.py --cpu-smoke     # no GPU: tiny tensors in the Triton interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import sys

CASES = [
    ("fp8_block", {}), ("fp8_block", {"ue8m0": True}), ("mxfp8", {}), ("mxfp8", {"scale_mode": "rceil"}),
    ("mxfp4", {}), ("nvfp4", {"convention": "vllm"}), ("nvfp4", {"convention": "te"}),
    ("nvfp4", {"convention": "modelopt"}), ("nvfp4", {"convention": "torchao"}),
    ("nvfp4", {"convention": "compressed_tensors"}),
]


def _time_ms(fn, iters: int) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64 * 2**20, help="elements (bf16), multiple of 4096")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: run tiny tensors in the interpreter")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from skyrl_numerics.quant import fake_quant
    from skyrl_numerics.quant.triton_fq import fake_quant_triton

    if args.cpu_smoke:
        dev, n = "cpu", 8 * 4096
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; use --cpu-smoke to exercise the script", file=sys.stderr)
            return 2
        dev, n = "cuda", args.n
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(n // 4096, 4096, generator=g, device=dev) *
         torch.exp(torch.randn(n // 4096, 1, generator=g, device=dev))).to(torch.bfloat16)
    rows = []
    copy_gbs = None
    if dev == "cuda":
        y = torch.empty_like(x)
        ms = _time_ms(lambda: y.copy_(x), args.iters)
        copy_gbs = 2 * x.numel() * x.element_size() / ms / 1e6
        print(f"{torch.cuda.get_device_name()}  copy: {copy_gbs:.0f} GB/s  ({x.numel():,} bf16)")
    for recipe, opts in CASES:
        ref = fake_quant(x, recipe, **opts)
        out = fake_quant_triton(x, recipe, **opts)
        exact = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
        row = {"recipe": recipe, "opts": opts, "bitwise_equal": exact}
        if dev == "cuda":
            ms = _time_ms(lambda: fake_quant_triton(x, recipe, **opts), args.iters)
            gbs = 2 * x.numel() * x.element_size() / ms / 1e6
            row.update(ms=ms, gbs=gbs, frac_of_copy=gbs / copy_gbs)
            print(f"{recipe:10} {str(opts):32} exact={exact}  {ms:.3f} ms  {gbs:.0f} GB/s  "
                  f"{100 * gbs / copy_gbs:.0f}% of copy")
        else:
            print(f"{recipe:10} {str(opts):32} exact={exact}")
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "n": x.numel(), "rows": rows}, f, indent=2)
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
