"""Quant tests: Triton kernels run in the interpreter on CPU tensors (set before triton imports)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
