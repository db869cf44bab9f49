"""Strict array conversion for :class:`~skyrl_numerics.rollout.Rollout`: array-likes (torch
tensors included) to 1-D numpy arrays of one dtype, refusing what would be truncated or would wrap
(floats or bools into ids, values beyond int64 / float32), and prefix-sum (``cu``) helpers.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from skyrl_numerics.errors import InputError


def cu_from_lengths(lengths: Iterable[int]) -> np.ndarray:
    lengths = np.asarray(list(lengths), dtype=np.int64)
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


ID_MAX = 2 ** 31 - 1           # token ids are int32 and >= 0
I64_MAX = 2 ** 63 - 1
F32_MAX = float(np.finfo(np.float32).max)


def as_numpy(x):
    """numpy view of an array-like (torch tensors included, bf16 upcast exactly)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        t = x.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    return np.asarray(x)


def non_finite(v, path: str = ""):
    """The key path (``["temperature"]``) of the first NaN / infinite float inside a JSON-like
    value, or None."""
    if isinstance(v, float):
        return None if math.isfinite(v) else path or "[]"
    if isinstance(v, dict):
        for k, x in v.items():
            hit = non_finite(x, f"{path}[{k!r}]")
            if hit is not None:
                return hit
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            hit = non_finite(x, f"{path}[{i}]")
            if hit is not None:
                return hit
    return None


def first_index(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad.reshape(-1))[0])


def int_array(x, name: str, lo: int, hi: int, dtype) -> np.ndarray:
    """1-D integer array in [lo, hi] as ``dtype``; refuses floats, bools and values that would wrap."""
    arr = as_numpy(x)
    if arr.ndim != 1:
        raise InputError(f"expected a 1-D array, got shape {arr.shape}", field=name)
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":
            return np.zeros(0, dtype)
        raise InputError(f"dtype {arr.dtype} is not an integer type (floats and bools are not "
                         "truncated into integers)", field=name)
    if arr.size:
        # compare in the array's own kind so nothing wraps (uint64 > 2**63 included)
        if arr.dtype.kind == "i" and int(arr.min()) < lo:
            i = first_index(arr < lo)
            raise InputError(f"value {int(arr[i])} < {lo}", field=name, index=i)
        if int(arr.max()) > hi:
            i = first_index(arr > hi)
            raise InputError(f"value {int(arr[i])} > {hi} (does not fit {np.dtype(dtype).name})",
                             field=name, index=i)
    return np.ascontiguousarray(arr, dtype=dtype)


def float_array(x, name: str) -> np.ndarray:
    """1-D real array as float32; refuses bools, complex, objects and finite values outside float32."""
    arr = as_numpy(x)
    if arr.ndim != 1:
        raise InputError(f"expected a 1-D array, got shape {arr.shape}", field=name)
    if arr.dtype.kind not in "fiu":
        raise InputError(f"dtype {arr.dtype} is not a real number type", field=name)
    if arr.dtype != np.float32 and arr.size:
        a64 = arr.astype(np.float64) if arr.dtype.kind == "f" else None
        if a64 is None:
            big = np.abs(arr.astype(np.float64)) > F32_MAX
        else:
            with np.errstate(invalid="ignore"):
                big = np.isfinite(a64) & (np.abs(a64) > F32_MAX)
        if big.any():
            i = first_index(big)
            raise InputError(f"value {arr[i].item()!r} does not fit float32", field=name, index=i)
    return np.ascontiguousarray(arr, dtype=np.float32)


def is_monotone(cu: np.ndarray) -> bool:
    return cu.ndim == 1 and cu.size >= 1 and cu[0] == 0 and bool((np.diff(cu) >= 0).all())


def locate_row(cu: np.ndarray, i: int) -> tuple[int, int]:
    """(row, index in row) of flat position i under prefix sums cu."""
    row = int(np.searchsorted(cu, i, side="right") - 1)
    return row, int(i - cu[row])
