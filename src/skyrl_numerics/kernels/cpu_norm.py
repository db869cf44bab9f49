"""RMSNorm on CPU in a fixed order: one fused C kernel (``csrc/rms_norm.c``) that the trainer
(forward of ``kernels.rms_norm``, with its own backward) and the vLLM engine both run, and its
torch specification. Per row ``r`` of ``x (M, N)``, in binary32, each operation rounded on its
own::

    ss_r   = dot8(x_r, x_r)                         (:mod:`.fixed_order`: 8 lanes, fixed fold)
    rstd_r = 1 / sqrt(ss_r / N + eps)
    y_rd   = (x_rd * rstd_r) * w_d                  rounded once to x.dtype

``w`` is ``(N,)``, or ``(M, N)`` with a weight row per row (Qwen3's per-head q/k norms laid out
beside their rows). A row's bits depend only on its own values, ``w`` and ``eps``: not on M,
the other rows, the thread count, or the CPU's vector width (torch's own ``sum`` picks its
reduction order by the CPU's instruction set; this one does not).
"""
from __future__ import annotations

import numpy as np
import torch

from .fixed_order import F32, c32, dot8, lib
from .pool import parallel

MAX_N = 65536
_CODES = {torch.float32: 0, torch.bfloat16: 1}


def rms_norm_spec(x: torch.Tensor, w: torch.Tensor, eps: float):
    """The kernel with torch ops (module doc): ``(y in x.dtype, rstd float32 (M,))``."""
    N = x.shape[-1]
    xf = x.reshape(-1, N).float()
    wf = w.float()
    ss = dot8(xf, xf)
    # (full tensors, not scalars: ATen divides by a scalar as a multiply by its reciprocal;
    # numpy's sqrt, not torch's: torch's CPU float sqrt is SLEEF's, not always correctly rounded)
    mean = ss / torch.full_like(ss, float(N))
    s = torch.from_numpy(np.sqrt((mean + c32(float(eps))).numpy()))
    rstd = torch.ones_like(s) / s
    y = ((xf * rstd[:, None]) * wf).to(x.dtype).reshape(x.shape)
    return y, rstd


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float):
    """The fused kernel when built, else :func:`rms_norm_spec`: ``(y, rstd)``, the same bits."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    M = x2.shape[0]
    L = lib()
    if L is None or N > MAX_N or M == 0 or (w.dim() == 2 and w.shape[0] != M):
        return rms_norm_spec(x, w, eps)
    xo = x2 if x2.dtype in _CODES else x2.float()
    if xo.stride(-1) != 1:
        xo = xo.contiguous()
    wo = w if w.dtype in _CODES else w.float()
    if wo.stride(-1) != 1:
        wo = wo.contiguous()
    w_ld = 0 if wo.dim() == 1 else wo.stride(0)
    y_dtype = x.dtype if x.dtype in _CODES else F32
    y = torch.empty((M, N), dtype=y_dtype)
    rstd = torch.empty(M, dtype=F32)
    args = (xo.data_ptr(), _CODES[xo.dtype], xo.stride(0), wo.data_ptr(), _CODES[wo.dtype], w_ld,
            y.data_ptr(), _CODES[y_dtype], rstd.data_ptr())

    def run(lo: int, hi: int) -> None:
        rc = L.skyrl_rms_norm_fwd(*args, lo, hi, N, float(eps))
        if rc != 0:
            raise RuntimeError(f"skyrl_rms_norm_fwd refused its sizes (rc {rc})")

    parallel(run, M, 2 * M * N)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y.reshape(x.shape), rstd
