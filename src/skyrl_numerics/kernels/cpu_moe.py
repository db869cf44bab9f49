"""The data movement around a grouped MoE layer's GEMMs on CPU: one C kernel each
(``csrc/moe_rows.c``) and its torch specification, the same bits. The invariant forward
(:func:`skyrl_numerics.invariant.blocks.routed_experts`) sorts the (token, slot) pairs
``p = t·k + s`` by expert and calls:

- :func:`expert_operand`: the rows ``x[src[r]]`` in sorted order, bfloat16 as stored (the
  grouped GEMM widens them itself), the operand of the gate and up projections;
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


def _outside(name: str, idx: np.ndarray, n: int, what: str) -> str:
    p = int(np.flatnonzero((idx < 0) | (idx >= n))[0])
    return f"{name}[{p}] = {int(idx[p])} is outside 0 .. {n - 1} ({n} {what})"


def expert_operand(x: torch.Tensor, src) -> torch.Tensor:
    """Rows ``x[src[r]]`` in order, as stored: the experts' GEMM operand (the bf16 GEMM reads
    bfloat16 rows itself, on either arithmetic)."""
    return x.index_select(0, torch.from_numpy(_index(src)))


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
