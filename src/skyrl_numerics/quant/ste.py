"""Straight-through estimators around ``fake_quant``.

Forward: ``x_hat = fake_quant(x, recipe, **opts)`` (bit-exact serving rounding).
Backward, plain STE: ``dL/dx = dL/dx_hat`` (rounding treated as identity).
Backward, clipped STE: ``dL/dx = dL/dx_hat * 1[lo <= x <= hi]`` where ``[lo, hi]`` is the range the
element's block can represent with the scales chosen in the forward pass (``hi`` = largest
positive code times the block scale, ``lo`` = most negative code times it). Elements that the
format saturated (MX floor tops, ``int4_g32``'s +7.5, calibrated static scales) get no gradient, as
in PACT/LSQ-style clipped STE.
"""
from __future__ import annotations

import copy

import torch

from .api import dequantize, quantize
from .qtensor import QTensor
from .recipes_int4 import INT4_GRIDS

# largest positive / most negative element code per storage kind
_MAX_CODE = {torch.float8_e4m3fn: (0x7E, 0xFE), torch.float8_e5m2: (0x7B, 0xFB)}


def _filled(q: QTensor, which: int) -> QTensor:
    """Copy of ``q`` with every element code set to the format's max (0) or min (1) code."""
    r = copy.copy(q)
    if q.recipe in INT4_GRIDS:
        r.codes = torch.full_like(q.codes, 7 if which == 0 else INT4_GRIDS[q.recipe][1])
    elif q.codes.dtype in _MAX_CODE:
        code = _MAX_CODE[q.codes.dtype][which]
        r.codes = torch.full_like(q.codes.view(torch.uint8), code).view(q.codes.dtype)
    else:                                                   # packed E2M1
        nib = 0x7 if which == 0 else 0xF
        r.codes = torch.full_like(q.codes, nib | (nib << 4))
    return r


def representable_range(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element, the (lo, hi) values its block can represent, in float32."""
    return dequantize(_filled(q, 1), torch.float32), dequantize(_filled(q, 0), torch.float32)


class STEFunction(torch.autograd.Function):
    """Straight-through backward shared by the torch and Triton fake-quant functions: the
    gradient passes unchanged, or (``ctx.clip``) only where ``x`` was inside the representable
    range (the mask ``forward`` saved)."""

    @staticmethod
    def backward(ctx, g):
        if ctx.clip:
            (mask,) = ctx.saved_tensors
            g = g * mask.to(g.dtype)
        return g, None, None, None


class _FakeQuantSTE(STEFunction):
    @staticmethod
    def forward(ctx, x, recipe, clip, opts):
        q = quantize(x, recipe, **opts)
        if clip:
            lo, hi = representable_range(q)
            xf = x.detach().float()
            ctx.save_for_backward((xf >= lo) & (xf <= hi))
        ctx.clip = clip
        return dequantize(q, x.dtype)


def ste_fake_quant(x: torch.Tensor, recipe: str, clip: bool = False, **opts) -> torch.Tensor:
    """``fake_quant`` with a straight-through gradient (``clip=True``: clipped STE)."""
    return _FakeQuantSTE.apply(x, recipe, clip, opts)


__all__ = ["ste_fake_quant", "representable_range"]
