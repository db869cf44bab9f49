"""The data movement around a grouped MoE layer's GEMMs on CPU: one C kernel each
(``csrc/moe_rows.c``) and its torch specification, the same bits. The invariant forward
(:func:`skyrl_numerics.invariant.blocks.routed_experts`) sorts the (token, slot) pairs
``p = t·k + s`` by expert, pads each expert's rows to whole GEMM row blocks, and calls:

- :func:`gather_rows`: ``out[c, dest[p]] = float32(x[src[p]])`` for each copy ``c``, every other
  row +0 (the blocks' padding) — the GEMM operands of the gate and up projections
  (:func:`expert_operand`: the same rows kept in bfloat16 where the GEMM runs on AMX tiles);
- :func:`slot_rows`: ``rows[t, s] = y[rowmap[t·k + s], :H]`` rounded to the model dtype;
- :func:`combine`: the slot-order weighted sum of those rows, every product and sum rounded to
  the model dtype as torch's ops round them (:func:`weighted_slot_sum`)::

      w_s = dtype(weights[t, s]);  acc = r_0 · w_0;  acc = acc + r_s · w_s   for s = 1 .. k-1

The order itself is :func:`sort_pairs` (a counting sort in C, numpy's stable argsort without
it: the same order). The C kernels run for bf16 when the library is built; the index arrays are
numpy ``int64``.
"""
from __future__ import annotations

import numpy as np
import torch

from . import cpu_gemm_amx
from .fixed_order import lib


def _index(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def sort_pairs_spec(ids: torch.Tensor, E: int):
    """:func:`sort_pairs` with numpy (its stable argsort)."""
    flat = ids.reshape(-1).numpy()
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    if counts.size > E:
        raise ValueError(f"expert id {int(flat.max())} >= num_experts {E}")
    rowmap = np.empty(flat.size, dtype=np.int64)
    rowmap[order] = np.arange(flat.size, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), order // ids.shape[1], rowmap


def sort_pairs(ids: torch.Tensor, E: int):
    """The (token, slot) pairs ``p = t·k + s`` of ``ids (T, k)`` (expert ids in ``0 .. E-1``)
    sorted by expert, stably: ``(off (E+1,), src (T·k,), rowmap (T·k,))`` int64 — expert ``e``'s
    rows are ``off[e] .. off[e+1]-1``, sorted row ``r`` holds token ``src[r]``, pair ``p`` sits at
    sorted row ``rowmap[p]``. An id outside ``0 .. E-1`` raises ``ValueError`` naming it."""
    L = lib()
    if L is None:
        return sort_pairs_spec(ids, E)
    T, k = ids.shape
    flat = _index(ids.reshape(-1).numpy())
    off = np.empty(E + 1, dtype=np.int64)
    src = np.empty(flat.size, dtype=np.int64)
    rowmap = np.empty(flat.size, dtype=np.int64)
    bad = np.zeros(1, dtype=np.int64)
    rc = L.skyrl_moe_sort(flat.ctypes.data, flat.size, k, E, off.ctypes.data, src.ctypes.data,
                          rowmap.ctypes.data, bad.ctypes.data)
    if rc == -1:
        raise ValueError(f"expert id {int(flat[bad[0]])} (token {int(bad[0]) // k}, slot "
                         f"{int(bad[0]) % k}) outside 0 .. {E - 1} (num_experts {E})")
    if rc != 0:
        raise RuntimeError(f"skyrl_moe_sort failed (rc {rc})")
    return off, src, rowmap


def gather_rows_spec(x: torch.Tensor, src, dest, out_rows: int, copies: int) -> torch.Tensor:
    """:func:`gather_rows` with torch ops."""
    a = torch.zeros(out_rows, x.shape[-1], dtype=torch.float32)
    # (index_select / index_copy_ move the same rows as x[i] / a[i] = ..., several times faster)
    a.index_copy_(0, torch.from_numpy(_index(dest)), x.index_select(0, torch.from_numpy(_index(src))).float())
    return a.expand(copies, out_rows, x.shape[-1]).contiguous()


def gather_rows(x: torch.Tensor, src, dest, out_rows: int, copies: int = 1) -> torch.Tensor:
    """``x (T, H)``'s rows ``src[p]`` at rows ``dest[p]`` of each of ``copies`` float32
    ``(out_rows, H)`` buffers, the other rows +0: ``(copies, out_rows, H)`` contiguous."""
    L = lib() if x.dtype == torch.bfloat16 else None
    if L is None:
        return gather_rows_spec(x, src, dest, out_rows, copies)
    H = x.shape[-1]
    xc = x.contiguous()
    src, dest = _index(src), _index(dest)
    out = torch.empty(copies, out_rows, H)
    if src.size != dest.size:
        raise ValueError(f"gather_rows: {src.size} source rows for {dest.size} destinations")
    rc = L.skyrl_moe_gather(xc.data_ptr(), xc.stride(0), xc.shape[0], H, src.ctypes.data,
                            dest.ctypes.data, src.size, out.data_ptr(), out_rows, copies)
    if rc == -1:
        raise ValueError(_outside("src", src, xc.shape[0], "rows of x"))
    if rc == -2:
        raise ValueError(_outside("dest", dest, out_rows, "out_rows"))
    if rc != 0:
        raise RuntimeError(f"skyrl_moe_gather failed (rc {rc})")
    return out


def _outside(name: str, idx: np.ndarray, n: int, what: str) -> str:
    p = int(np.flatnonzero((idx < 0) | (idx >= n))[0])
    return f"{name}[{p}] = {int(idx[p])} is outside 0 .. {n - 1} ({n} {what})"


def expert_operand(x: torch.Tensor, src) -> torch.Tensor:
    """Rows ``x[src[p]]`` in order, as the experts' GEMM operand: bfloat16 as stored where that
    GEMM runs on AMX tiles (:func:`.cpu_gemm_amx.uses_amx`), else :func:`gather_rows`' float32."""
    if cpu_gemm_amx.uses_amx(x):
        return x.index_select(0, torch.from_numpy(_index(src)))
    n = len(src)
    return gather_rows(x, src, np.arange(n, dtype=np.int64), n)[0]


def slot_rows(y: torch.Tensor, rowmap, T: int, k: int, H: int, dtype) -> torch.Tensor:
    """``rows (T, k, H)`` in ``dtype``: ``rows[t, s] = y[rowmap[t·k + s], :H]``."""
    return y.index_select(0, torch.from_numpy(_index(rowmap)))[:, :H].to(dtype).view(T, k, H)


def weighted_slot_sum(rows: torch.Tensor, weights: torch.Tensor, dtype) -> torch.Tensor:
    """``sum_s rows[:, s] * weights[:, s]`` in slot order, weights cast to ``dtype`` first."""
    w = weights.to(dtype)
    acc = rows[:, 0] * w[:, 0:1]
    for s in range(1, rows.shape[1]):
        acc = acc + rows[:, s] * w[:, s:s + 1]
    return acc


def combine_spec(y: torch.Tensor, rowmap, weights: torch.Tensor, H: int, dtype) -> torch.Tensor:
    """:func:`combine` with torch ops."""
    T, k = weights.shape
    return weighted_slot_sum(slot_rows(y, rowmap, T, k, H, dtype), weights, dtype)


def combine(y: torch.Tensor, rowmap, weights: torch.Tensor, H: int, dtype) -> torch.Tensor:
    """Each token's ``k`` expert rows of float32 ``y`` (``y[rowmap[t·k + s], :H]``) summed with
    ``weights (T, k)`` in slot order (module doc): ``(T, H)`` in ``dtype``."""
    L = lib() if dtype == torch.bfloat16 else None
    if L is None:
        return combine_spec(y, rowmap, weights, H, dtype)
    T, k = weights.shape
    if y.stride(-1) != 1 or y.dtype != torch.float32:
        y = y.float().contiguous()
    rowmap = _index(rowmap)
    wf = weights.float().contiguous()
    out = torch.empty(T, H, dtype=dtype)
    if rowmap.size != T * k or H > y.shape[-1]:
        raise ValueError(f"combine: rowmap of {rowmap.size} for weights {tuple(weights.shape)}, "
                         f"H {H} of y's {y.shape[-1]} columns")
    rc = L.skyrl_moe_combine(y.data_ptr(), y.stride(0), y.shape[0], H, rowmap.ctypes.data,
                             wf.data_ptr(), T, k, out.data_ptr())
    if rc == -1:
        raise ValueError(_outside("rowmap", rowmap, y.shape[0], "rows of y"))
    if rc != 0:
        raise RuntimeError(f"skyrl_moe_combine failed (rc {rc})")
    return out
