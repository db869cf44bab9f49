"""The two autograd functions the invariant forward uses when gradients are on: attention whose
forward is the engine's kernel and whose backward is the exact reference formula, and a
straight-through read-back of a KV-cache row format."""
from __future__ import annotations

import torch


class TrainableAttention(torch.autograd.Function):
    """Forward: the invariant kernel (the engine's bits). Backward: the fp64 reference attention
    recomputed on the saved inputs (exact formula; the gradient itself needs no invariance)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        from skyrl_numerics.kernels import attention

        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return attention(q, k, v, causal=True, scale=scale)

    @staticmethod
    def backward(ctx, g):
        from skyrl_numerics.kernels import reference

        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
            out = reference.attention(qq, kk, vv, True, ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (qq, kk, vv), g.double())
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None


class StraightThrough(torch.autograd.Function):
    """Forward ``rt`` (the cache format's read-back), backward identity to ``x``."""

    @staticmethod
    def forward(ctx, x, rt):
        return rt

    @staticmethod
    def backward(ctx, g):
        return g, None
