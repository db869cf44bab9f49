"""The matmul family of aten ops under :func:`~.mode.batch_invariant_mode`: every overload a
trainer reaches (functional, in place, ``.out``, ``out_dtype``), computed from the two
batch-invariant primitives of one backend (:mod:`.cpu` on the CPU key, the Triton kernels on CUDA)::

    mm(a, b, out_dtype)    a (M, K) @ b (K, N)        row m of the result depends on row m of a only
    bmm(a, b, out_dtype)   a (B, M, K) @ b (B, K, N)  the same, per matrix

Notation: W is the wide dtype (float64 for float64 operands, else float32); P the product
accumulated in W and not rounded (``mm(a, b, W)``); ``round`` one rounding to the result's dtype
(the operands' dtype, or ``out_dtype`` for the ``.dtype`` overloads)::

    mm, bmm                       round(P)
    addmm, baddbmm                round(alpha·P + beta·self)    (in W; beta = 0: self not read, NaN
                                                               included, as torch)
    addbmm                        the addmm of (M, B·K) @ (B·K, N): the B products side by side in K
    mv, addmv                     mm / addmm with the vector as one column, (N, K) @ (K, 1): the
                                  matrix's rows are the batch
    dot, vdot                     mm of (1, K) @ (K, 1) (real dtypes: vdot = dot)
    _addmm_activation             relu, or gelu(tanh) when use_gelu, of the addmm
    <op>.dtype, <op>.dtype_out    the same, rounded to out_dtype (torch has them on CUDA only; on
                                  the CPU key the mode provides them, the same formulas)
    <op>_ (in place)              self.copy_(the result), self returned (TRL's LM-head backward
                                  accumulates with acc.addmm_(a, b))
    <op>.out                      out resized to the result and copied into

``matmul`` and ``linear`` are composite ops: they reach aten as mm / addmm / bmm / mv / dot (N-d
operands folded to 2-d), so they are covered through these; ``einsum``, ``tensordot``,
``chain_matmul`` likewise. Integer and complex operands are refused (:class:`NotInvariant`): the
primitives compute in floating point.
"""
from __future__ import annotations

from typing import Callable

import torch

from skyrl_numerics.errors import NotInvariant

from ._util import compute_dtype

Primitive = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def _check(op: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if not t.is_floating_point():
            raise NotInvariant(f"aten::{op}", f"{t.dtype} operands: the invariant GEMM computes in "
                               "floating point")
    if any(t.dtype != ts[0].dtype for t in ts[1:]):
        raise RuntimeError(f"{op}: expected operands of one dtype, got {[t.dtype for t in ts]}")


def _combine(p: torch.Tensor, self_: torch.Tensor, beta, alpha, dtype: torch.dtype) -> torch.Tensor:
    """round(alpha·p + beta·self) in p's (wide) dtype; beta = 0 leaves self unread."""
    out = p if alpha == 1 else p * alpha
    if beta != 0:
        s = self_.to(p.dtype)
        out = out + (s if beta == 1 else s * beta)
    return out.to(dtype)


def out_variant(fn: Callable) -> Callable:
    """``<op>.out``: the functional result, ``out`` resized to it and copied into."""
    def impl(*args, out, **kwargs):
        res = fn(*args, **kwargs)
        out.resize_(res.shape)
        return out.copy_(res)
    return impl


def _inplace(fn: Callable) -> Callable:
    """``<op>_``: the functional result copied into ``self`` (computed whole first, so operands
    that alias self are read before it is written)."""
    def impl(self_, *args, **kwargs):
        return self_.copy_(fn(self_, *args, **kwargs))
    return impl


class MatmulFamily:
    """The formulas of the module doc over one backend's ``mm`` and ``bmm`` primitives."""

    def __init__(self, mm: Primitive, bmm: Primitive):
        self._mm, self._bmm = mm, bmm

    def mm(self, a, b, out_dtype=None):
        _check("mm", a, b)
        return self._mm(a, b, out_dtype or a.dtype)

    def bmm(self, a, b, out_dtype=None):
        _check("bmm", a, b)
        return self._bmm(a, b, out_dtype or a.dtype)

    def addmm(self, self_, a, b, out_dtype=None, *, beta=1, alpha=1):
        _check("addmm", a, b)
        return _combine(self._mm(a, b, compute_dtype(a)), self_, beta, alpha, out_dtype or a.dtype)

    def baddbmm(self, self_, a, b, out_dtype=None, *, beta=1, alpha=1):
        _check("baddbmm", a, b)
        return _combine(self._bmm(a, b, compute_dtype(a)), self_, beta, alpha, out_dtype or a.dtype)

    def addbmm(self, self_, b1, b2, *, beta=1, alpha=1):
        B, M, K = b1.shape
        side = b1.transpose(0, 1).reshape(M, B * K)
        return self.addmm(self_, side, b2.reshape(B * K, b2.shape[2]), beta=beta, alpha=alpha)

    def mv(self, m, v):
        return self.mm(m, v[:, None])[:, 0]

    def addmv(self, self_, m, v, *, beta=1, alpha=1):
        _check("addmv", m, v)
        return _combine(self._mm(m, v[:, None], compute_dtype(m))[:, 0], self_, beta, alpha, m.dtype)

    def dot(self, a, b):
        return self.mm(a[None], b[:, None])[0, 0]

    def addmm_activation(self, self_, a, b, *, beta=1, alpha=1, use_gelu=False):
        y = self.addmm(self_, a, b, beta=beta, alpha=alpha)
        return torch.nn.functional.gelu(y, approximate="tanh") if use_gelu else torch.relu(y)

    def table(self) -> dict[str, Callable]:
        """aten op name -> kernel, for every overload of the family."""
        fns = {"mm": self.mm, "bmm": self.bmm, "addmm": self.addmm, "baddbmm": self.baddbmm,
               "addbmm": self.addbmm, "mv": self.mv, "addmv": self.addmv, "dot": self.dot,
               "vdot": self.dot, "_addmm_activation": self.addmm_activation}
        table = {**fns, **{f"{op}.out": out_variant(fn) for op, fn in fns.items()}}
        for op in ("mm", "bmm", "addmm", "baddbmm"):
            table[f"{op}.dtype"] = fns[op]
            table[f"{op}.dtype_out"] = out_variant(fns[op])
        for op in ("addmm", "baddbmm", "addbmm", "addmv"):
            table[f"{op}_"] = _inplace(fns[op])
        return table
