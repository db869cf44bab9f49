"""The bf16 GEMM on Intel AMX tiles: a second arithmetic for :mod:`.cpu_gemm_bf16`, chosen with
``SKYRL_NUMERICS_GEMM=amx`` on both sides of a bitwise pair.

    out[m, n] = amx_dot(x[m, :], w[n, :])          x, w bfloat16; out float32

    amx_dot(a, b): C = +0; for kb = 0, 1, ...:  C = TDPBF16PS(C, b[32kb : 32kb+32], a[32kb : 32kb+32])
                   (blocks of 32 values in order, the last zero-padded; TDPBF16PS adds the 16 bf16
                   pair products of a block to the float32 accumulator in one instruction)

The instruction's internal order and rounding are the hardware's: one pair is
``ftz(RN(c + ftz(RN(a0 b0 + a1 b1))))`` and no sequential model reproduces 16 pairs
(``benchmarks/dpbf16``), so this arithmetic has no torch specification and its bits are not the
portable :data:`fma <.cpu_gemm_bf16>` arithmetic's. What it keeps is batch invariance: an output
depends on its own row of ``x`` and of ``w`` only, computed by the same instruction sequence
whatever the number of rows, the tile it falls in or the thread (one output element of
TDPBF16PS reads its row of A, its column of B and its accumulator only). Bits are therefore
reproducible between AMX CPUs, not between an AMX CPU and one without: the execution contract's
``kernel_build`` names the arithmetic (``gemm_bf16``), so a trainer and an engine that run
different ones are refused by name.

Why: stock vLLM CPU runs oneDNN's AMX GEMM. The fma arithmetic's 16 fp32 lanes do 32 MACs per
cycle against AMX's 512, so prefill-sized GEMMs ran at 0.2-0.3x of stock on AMX hosts
(BENCHMARKS.md, "bf16 GEMM at real layer shapes"); this kernel does them on the same tiles.

It covers GEMMs whose activations are bfloat16 (the invariant families' linears, experts and LM
head in a bfloat16 model); float32 activations keep the fma arithmetic, on both sides alike.
The kernel is ``csrc/gemm_bf16_amx.c``: ``x`` packed once per call into the tiles' pair layout,
``w`` read as stored (16-row tiles at its row stride), 2 x 2 tiles of accumulators.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from . import native
from .pool import parallel

GEMM_ENV = "SKYRL_NUMERICS_GEMM"
ARITHMETICS = ("fma", "amx")
_CHECKED: dict[str, str] = {}         # SKYRL_NUMERICS_GEMM's raw values that name fma


class GemmArithmeticError(RuntimeError):
    """``SKYRL_NUMERICS_GEMM`` names an arithmetic this process cannot run."""


def available() -> bool:
    """Whether this process can run the AMX kernel: the compiled kernels are loaded, they were
    built for AMX (``-march=native`` on an AMX CPU) and Linux granted the tile state."""
    L = native.lib()
    return L is not None and bool(L.skyrl_amx_available())


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    L = native.lib()
    if L is None:
        return f"the compiled kernels are not loaded ({native.unavailable_reason()})"
    if not L.skyrl_amx_available():
        return ("this CPU or build has no AMX-BF16 (amx_bf16 in /proc/cpuinfo, a compiler that "
                "targets it, and Linux's arch_prctl grant are all needed)")
    return None


def arithmetic() -> str:
    """The bf16 GEMM arithmetic this process runs: ``SKYRL_NUMERICS_GEMM`` (``fma``, the
    default, or ``amx``). ``amx`` on a host that cannot run it raises
    :class:`GemmArithmeticError` (never a silent fallback: the other side would disagree)."""
    raw = os.environ.get(GEMM_ENV, "")
    name = _CHECKED.get(raw)           # (every GEMM asks: fma's spellings are checked once)
    if name is not None:
        return name
    name = raw.strip().lower() or "fma"
    if name not in ARITHMETICS:
        raise GemmArithmeticError(f"{GEMM_ENV}={name!r}: expected one of {', '.join(ARITHMETICS)}")
    if name == "amx" and not available():
        raise GemmArithmeticError(f"{GEMM_ENV}=amx: {unavailable_reason()}")
    if name == "fma":                  # (amx's answer depends on the host: asked every time)
        _CHECKED[raw] = name
    return name


def advice() -> str | None:
    """One line for a user on an AMX CPU who runs the default arithmetic (the doctor logs it),
    else None."""
    if arithmetic() != "fma" or not available():
        return None
    return (f"this CPU has AMX: {GEMM_ENV}=amx on both the trainer and the engine runs the "
            "invariant bf16 GEMMs on AMX tiles, as stock vLLM's oneDNN does (at real layer dims "
            "1.0-1.5x stock tok/s against 0.4-0.8x with the default fma arithmetic; BENCHMARKS.md)")


def uses_amx(x: torch.Tensor) -> bool:
    """Whether a GEMM with activations ``x`` runs on AMX here (bfloat16 ``x`` under ``amx``)."""
    return x.dtype == torch.bfloat16 and arithmetic() == "amx"


def _packed_values(rows: int, K: int) -> int:
    return (rows + 15) // 16 * ((K + 31) // 32) * 512


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1]) else x.contiguous()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (rc {rc})")


def linear_f32(x: torch.Tensor, w: torch.Tensor, ld) -> torch.Tensor:
    """``x [M, K] @ w [N, K].T`` as float32 ``[M, N]``, both bfloat16 (``w`` already unit-stride
    along K; ``ld(t)``: the row stride the C kernels take)."""
    x = _bf16_rows(x)
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N)
    if M == 0 or N == 0:
        return out.zero_()
    L = native.lib()
    xp = torch.empty(_packed_values(M, K), dtype=torch.bfloat16)
    _check(L.skyrl_amx_pack_x(x.data_ptr(), ld(x), M, K, xp.data_ptr()), "skyrl_amx_pack_x")

    def run(lo: int, hi: int) -> None:
        _check(L.skyrl_gemm_bf16_amx(xp.data_ptr(), w.data_ptr(), ld(w), out.data_ptr(), N, M, K,
                                     lo, hi), "skyrl_gemm_bf16_amx")

    parallel(run, N, M * N * K)
    return out


def grouped_f32(x: torch.Tensor, wl: list, goff: np.ndarray, ld) -> torch.Tensor:
    """Rows ``goff[g] .. goff[g + 1]`` of ``x [R, K]`` (bfloat16) times ``wl[g]`` (bfloat16
    ``[N, K]``, equal shapes and strides) -> float32 ``[R, N]`` (rows outside every group 0);
    each row is :func:`linear_f32`'s of its group."""
    x = _bf16_rows(x)
    R, K = x.shape
    N = wl[0].shape[0]
    out = torch.zeros(R, N)
    rows = np.diff(goff)
    xp = torch.empty(max(1, sum(_packed_values(int(r), K) for r in rows)), dtype=torch.bfloat16)
    ptrs = np.array([w.data_ptr() for w in wl], dtype=np.uint64)
    L = native.lib()
    x0 = x[int(goff[0]):]
    offs = goff - goff[0]
    _check(L.skyrl_amx_pack_grouped(x0.data_ptr(), ld(x), offs.ctypes.data, len(wl), K, xp.data_ptr()),
           "skyrl_amx_pack_grouped")
    o0 = out[int(goff[0]):]

    def run(lo: int, hi: int) -> None:
        _check(L.skyrl_gemm_bf16_amx_grouped(xp.data_ptr(), ptrs.ctypes.data, ld(wl[0]), offs.ctypes.data,
                                             len(wl), o0.data_ptr(), N, K, lo, hi),
               "skyrl_gemm_bf16_amx_grouped")

    parallel(run, N, int(rows.sum()) * N * K)
    return out
