"""GPU bitwise checks + TFLOP/s of skyrl_numerics.kernels: a thin wrapper over gpu_check.py.

    python benchmarks/gpu_kernels.py [OUT_DIR]            # kernels + matmul_perf + attention_perf
    python benchmarks/gpu_kernels.py [OUT_DIR] --check    # only the bitwise checks (kernels, mode)
    python benchmarks/gpu_kernels.py [OUT_DIR] --dry-run  # CPU: Triton interpreter, tiny shapes

Other options (``--budget``, ``--shim``, ...) pass through to ``benchmarks/gpu_check.py``, which
writes ``gpu.json`` and ``gpu.md`` to OUT_DIR (default ``$OUT``, else ``./gpu_check_out``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sections = "kernels,matmul_perf,attention_perf"
    if "--check" in argv:
        argv.remove("--check")
        sections = "kernels,mode"
    if not any(a == "--sections" or a.startswith("--sections=") for a in argv):
        argv += ["--sections", sections]
    return gpu_check.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
