"""Small shared helpers: input checks (raising InputError), interpreter detection, backends.

Backends of every op function:
  ``"auto"``      CUDA tensors -> Triton kernels, CPU tensors -> the fast CPU path (``cpu.py``)
  ``"triton"``    the Triton kernels (on CPU tensors only under ``TRITON_INTERPRET=1``)
  ``"cpu"``       the batch-invariant CPU path built from stock torch ops (``cpu.py``)
  ``"reference"`` the plain-torch reference (``reference.py``): the spec, NOT batch-invariant
"""
from __future__ import annotations

import os

import torch

from skyrl_numerics.errors import InputError

BACKENDS = ("auto", "triton", "cpu", "reference")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Pick the concrete backend for ``tensors`` (see module docstring)."""
    if backend not in BACKENDS:
        raise InputError(f"expected one of {BACKENDS}, got {backend!r}", field="backend")
    if backend != "auto":
        if backend == "triton" and not tensors[0].is_cuda and not interpreting():
            raise InputError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors",
                             field="backend")
        return backend
    return "triton" if tensors[0].is_cuda else "cpu"


def check_float(name: str, t: torch.Tensor, ndim: int | tuple[int, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"expected a torch.Tensor, got {type(t).__name__}", field=name)
    if t.dtype not in FLOAT_DTYPES:
        raise InputError(f"expected dtype in (float32, bfloat16, float16), got {t.dtype}", field=name)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            raise InputError(f"expected {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}",
                             field=name)


def check_same(name: str, got, expected, what: str) -> None:
    if got != expected:
        raise InputError(f"{what}: expected {expected}, got {got}", field=name)


def check_dtype_match(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise InputError(f"dtype {b.dtype} does not match {a_name}'s {a.dtype}", field=b_name)
    if a.device != b.device:
        raise InputError(f"device {b.device} does not match {a_name}'s {a.device}", field=b_name)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the CPU path computes ``t`` in: float64 stays, everything else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def pad_last(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` zero-padded on the right of its last dim to ``n`` (``x`` itself when already ``n``)."""
    return x if x.shape[-1] == n else torch.nn.functional.pad(x, (0, n - x.shape[-1]))
