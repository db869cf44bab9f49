"""Batch-invariant GEMMs against bfloat16 weights on CPU: the weights are read as stored (no
float32 copy), widened in registers, and every output is one fixed-order dot product.

    out[m, n] = dot16(float32(x[m, :]), float32(w[n, :]))           w: bfloat16 [N, K]

    dot16(a, b): lane c (0..15) runs acc_c = fma(a[16u + c], b[16u + c], acc_c) over
                 u = 0, 1, ... in order from +0 (a tail shorter than 16 fills the first lanes by
                 the same fma); the lanes are then folded h_i = l_i + l_(i+8) (i = 0..7),
                 ((h0 + h4) + (h2 + h6)) + ((h1 + h5) + (h3 + h7))

fma is IEEE 754's fused multiply-add (one rounding; :func:`.fixed_order.fma`), every other sum
one IEEE binary32 addition, so an output's bits depend only on its own row of ``x`` and of
``w``: not on the number of rows, on which rows share a call, on the thread, on the vector width
or on the CPU (the 16 lanes are one AVX-512 register or two AVX2 registers, or scalar ``fmaf``
without either: the same bits, tested with each build). With ``x`` in bfloat16 every product is
exact in float32 (8 + 8 significant bits) unless it is below 2^-133, so there the fma gives what
a multiply then an add would. bfloat16 -> float32 is exact, so ``x`` in bfloat16 is the same as
its float32 widening. The result is rounded once to the output dtype.

This is the spec of every bfloat16 GEMM the invariant CPU path runs with a weight: the
``linear`` layers, the experts and the LM head of the invariant families, and ``matmul`` with
two bfloat16 operands (the trainer's autograd forward), on the engine and the trainer side alike.
float32/float16 GEMMs and the attention products keep :mod:`.cpu_gemm`'s MKL row blocks.

A second arithmetic, for AMX hosts: with ``SKYRL_NUMERICS_GEMM=amx`` the GEMMs whose activations
are bfloat16 run on AMX tiles instead (:mod:`.cpu_gemm_amx`: batch-invariant, reproducible
between AMX CPUs, no torch specification; the contract names it). The default is this fma one.

The kernel is ``csrc/gemm_bf16.c`` (tiles of up to 4 rows x 4 columns of 16-lane accumulators
sharing each loaded vector on AVX-512, 2 x 3 on AVX2; column panels of 48); :func:`linear_spec`
is its torch specification (the fallback without a C compiler: the same bits, much slower).
Calls split their columns over :mod:`.pool` (each output is computed whole by one thread, so the
split changes no bit).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import cpu_gemm_amx
from .fixed_order import DTYPE_CODES as _CODES, fma, kernel_operand, lib
from .pool import parallel

_SPEC_CHUNK = 1 << 20   # floats of lane accumulators the spec holds at once
LANES = 16


def _weight(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` bfloat16 with unit stride along K (a bfloat16 copy only when it is not)."""
    if w.dtype != torch.bfloat16:
        raise TypeError(f"weight dtype {w.dtype}: the bf16 GEMM takes bfloat16 weights")
    if w.dim() != 2:
        raise ValueError(f"weight of shape {tuple(w.shape)}: expected [N, K]")
    if w.stride(1) != 1 or (w.shape[0] > 1 and w.stride(0) < w.shape[1]):
        w = w.contiguous()
    return w


def _ld(t: torch.Tensor) -> int:
    """The row stride the C kernels are given: ``t``'s, or K for a single row (whose stride torch
    may report as anything, e.g. 1 for a column vector seen as a row; never stepped over)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def linear_spec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`linear`'s float32 result with torch ops (the module doc's formula, op for op)."""
    x, wf = x.float(), w.float()
    M, K = x.shape
    N = wf.shape[0]
    k16 = K - K % LANES
    out = torch.empty(M, N)
    step = max(1, _SPEC_CHUNK // max(1, LANES * M))
    for lo in range(0, N, step):
        wc = wf[lo:lo + step]
        acc = torch.zeros(M, wc.shape[0], LANES)
        for u in range(0, k16, LANES):
            acc = fma(x[:, None, u:u + LANES], wc[None, :, u:u + LANES], acc)
        for c in range(K - k16):
            acc[..., c] = fma(x[:, None, k16 + c], wc[None, :, k16 + c], acc[..., c])
        h = acc[..., :8] + acc[..., 8:]
        b = h[..., :4] + h[..., 4:]
        q = b[..., :2] + b[..., 2:]
        out[:, lo:lo + wc.shape[0]] = q[..., 0] + q[..., 1]
    return out


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T`` as float32 ``[M, N]`` (module doc); ``w`` bfloat16."""
    return _gemm(x, w, torch.float32)


def _gemm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`linear_f32`'s result in ``out_dtype``: bfloat16 (or float32) rounded once in the
    kernel, as ``.to(out_dtype)`` of the float32 result rounds it (to nearest even)."""
    w = _weight(w)
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"x has K = {K}, weight {tuple(w.shape)}")
    if cpu_gemm_amx.uses_amx(x):
        return cpu_gemm_amx.linear_f32(x, w, _ld).to(out_dtype)
    if out_dtype not in _CODES:                  # (float16: rounded by torch from float32)
        return _gemm(x, w, torch.float32).to(out_dtype)
    L = lib()
    if L is None:
        return linear_spec(x, w).to(out_dtype)
    x = kernel_operand(x)
    out = torch.empty(M, N, dtype=out_dtype)
    if M == 0 or N == 0:
        return out.zero_()
    args = (x.data_ptr(), _CODES[x.dtype], _ld(x), w.data_ptr(), _ld(w), out.data_ptr(),
            _CODES[out_dtype], N, M, K)

    def run(lo: int, hi: int) -> None:
        rc = L.skyrl_gemm_bf16_io(*args, lo, hi)
        if rc != 0:
            raise RuntimeError(f"skyrl_gemm_bf16_io failed (rc {rc})")

    parallel(run, N, M * N * K)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x (..., K) @ w.T (+ bias)`` in ``out_dtype`` (default ``x.dtype``): the float32 result
    of :func:`linear_f32`, plus ``float32(bias)``, rounded once."""
    out_dtype = out_dtype or x.dtype
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if bias is None:
        out = _gemm(x2, w, out_dtype)
    else:
        out = (linear_f32(x2, w) + bias.float()).to(out_dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], w.shape[0])


@dataclass(frozen=True)
class Groups:
    """The row groups of grouped GEMMs, checked once for every call that shares them (an MoE
    layer's gate, up and down projections): group ``g`` is rows ``off[g] .. off[g + 1] - 1``."""
    off: np.ndarray        # int64 [G + 1], non-decreasing from 0
    used: list             # the groups with rows

    @classmethod
    def of(cls, row_off) -> "Groups":
        offs = np.ascontiguousarray(row_off, dtype=np.int64)
        if offs.ndim != 1 or offs.size < 1 or offs[0] != 0 or bool((offs[1:] < offs[:-1]).any()):
            raise ValueError(f"row_off {offs.tolist()}: expected non-decreasing offsets from 0")
        return cls(offs, np.flatnonzero(offs[1:] > offs[:-1]).tolist())


def grouped(x: torch.Tensor, ws, row_off, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``row_off[g] .. row_off[g + 1]`` of ``x [R, K]`` times ``ws[g]`` (bfloat16 ``[N, K]``,
    one per group: an MoE layer's experts; None for a group without rows) -> ``[R, N]``; each row
    is :func:`linear_f32`'s of its group in ``out_dtype`` (float32, or bfloat16 rounded once: the
    same bits as one call per group, in one C call). Rows after the last group are +0.
    ``row_off``: the offsets, or their :class:`Groups`."""
    grp = row_off if isinstance(row_off, Groups) else Groups.of(row_off)
    if out_dtype not in _CODES:                  # (float16: rounded by torch from float32)
        return grouped(x, ws, grp, torch.float32).to(out_dtype)
    offs, used = grp.off, grp.used
    R, K = x.shape
    if offs[-1] > R:
        raise ValueError(f"row_off {offs.tolist()}: groups past the {R} rows of x")
    if not used:
        first = next((w for w in ws if w is not None), None)
        return torch.zeros(R, first.shape[0] if first is not None else 0, dtype=out_dtype)
    w0 = _weight(ws[used[0]])
    N, ld = w0.shape[0], _ld(w0)
    if w0.shape[1] != K:
        raise ValueError(f"x has K = {K}, expert weights {tuple(w0.shape)}")
    # one C call when every used weight is laid out as the first (checked without copies)
    ptrs = np.zeros(len(offs) - 1, dtype=np.uint64)       # 0 for a group without rows (skipped)
    ptrs[used[0]] = w0.data_ptr()
    shape, stride, same = w0.shape, w0.stride(), True
    for g in used[1:]:
        w = ws[g]
        if w.dtype != torch.bfloat16 or w.shape != shape or w.stride() != stride:
            same = False
            break
        ptrs[g] = w.data_ptr()
    L = lib()
    if same and cpu_gemm_amx.uses_amx(x):
        goff = np.append(offs[used], offs[used[-1] + 1])   # groups without rows drop out
        return cpu_gemm_amx.grouped_f32(x, [w0] + [ws[g] for g in used[1:]], goff, _ld).to(out_dtype)
    if L is None or not same:
        out = torch.zeros(R, N, dtype=out_dtype)
        for g in used:
            out[offs[g]:offs[g + 1]] = _gemm(x[offs[g]:offs[g + 1]], ws[g], out_dtype)
        return out
    x = kernel_operand(x)
    out = torch.empty(R, N, dtype=out_dtype)
    if offs[-1] < R:
        out[int(offs[-1]):].zero_()
    args = (x.data_ptr(), _CODES[x.dtype], _ld(x), ptrs.ctypes.data, ld, offs.ctypes.data,
            len(ptrs), out.data_ptr(), _CODES[out_dtype], N, K)

    def run(lo: int, hi: int) -> None:
        rc = L.skyrl_gemm_bf16_grouped(*args, lo, hi)
        if rc != 0:
            raise RuntimeError(f"skyrl_gemm_bf16_grouped failed (rc {rc})")

    parallel(run, N, (int(offs[-1]) - int(offs[0])) * N * K)
    return out
