"""GPU check + bandwidth of the fused Triton fake-quant kernels: a thin wrapper over gpu_check.py.

For each kernel case: bitwise check against the torch reference recipe on the GPU (edge-case
tensors in fp32 and bf16, and the large tensor), then effective GB/s (bytes read + written)
against ``y.copy_(x)`` on the same tensor in the same process; goal >= 80 %.

    python benchmarks/gpu_quant.py                 # 64M bf16 elements on cuda:0
    python benchmarks/gpu_quant.py --n 16777216 --json out.json
    python benchmarks/gpu_quant.py --cpu-smoke     # no GPU: tiny tensors in the Triton interpreter

The full report (``gpu.json``, ``gpu.md``) goes to ``--out`` (default ``$OUT``, else
``./gpu_check_out``); ``--json FILE`` also writes the quant section alone (with ``copy_gbs``, ``n``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="elements (bf16) of the large tensor, multiple of 4096")
    ap.add_argument("--iters", type=int, default=None, help="ignored (gpu_check times a median of 20 calls)")
    ap.add_argument("--json", default=None, help="also write the quant section here")
    ap.add_argument("--out", default=None, help="folder for gpu.json / gpu.md")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny tensors in the interpreter")
    ap.add_argument("--budget", type=float, default=480.0)
    args = ap.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out")
    fwd = [str(out), "--sections", "quant", "--budget", str(args.budget)]
    if args.n:
        fwd += ["--quant-n", str(args.n)]
    if args.cpu_smoke:
        fwd.append("--dry-run")
    code = gpu_check.main(fwd)
    if args.json:
        data = json.loads((out / "gpu.json").read_text())
        sec = data["sections"].get("quant", {})
        copy = next((r for r in sec.get("rows", []) if r.get("recipe") == "copy_"), {})
        sec = dict(sec, copy_gbs=copy.get("gbs"), n=args.n or (None if args.cpu_smoke else 64 * 2**20),
                   env=data.get("env"))
        Path(args.json).write_text(json.dumps(sec, indent=1, default=str))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
