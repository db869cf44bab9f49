"""INT4 symmetric groups (``pack-quantized`` W4A16 checkpoints), in two conventions that differ in
the scale divisor and the code range.

For each group of ``group`` (32) consecutive elements of the last dimension, operation by
operation::

    s = (amax(|w_g|) in scale_dtype) / D          # the quotient rounded once to scale_dtype
    s = eps(scale_dtype) where s == 0             # bf16 eps = 2^-7
    q = round_half_even(clamp(w / s, q_min, 7))   # w / s in torch's promoted dtype (bf16 for bf16 w)
    w_hat = q.to(scale_dtype) * s                 # product rounded to scale_dtype

=================  =======  =====  ===================================================================
recipe             D        q_min  source
=================  =======  =====  ===================================================================
``int4_g32``       7.5      -8     compressed-tensors 0.17.0 ``calculate_qparams`` (symmetric:
                                   ``amax / ((7 - (-8)) / 2)``) + ``_quantize`` / ``_dequantize``:
                                   llm-compressor RTN W4A16; SkyRL 0.4.0 ``fake_int4_quantize_ste``
                                   with ``scale_divisor=7.5, q_min=-8`` (its default)
``int4_g32_kimi``  7.0      -7     SkyRL 0.4.0 ``fake_int4_quantize_ste`` with ``scale_divisor=7.0,
                                   q_min=-7``, which its docstring names the Kimi K2-Thinking / K2.6 /
                                   Miles QAT grid (the max-|w| element of a group codes to +-7)
=================  =======  =====  ===================================================================

Both are checked bitwise against those functions (tests/quant/test_recipes_sources.py,
tests/integrations/test_skyrl_quant.py), up to two things SkyRL's fake-quant does not store: it
keeps ``s = 0`` for an all-zero group (and divides by 1: the same zeros), and returns ``-0`` for a
negative element whose code is 0, where the checkpoint's code 0 decodes to ``+0`` (as here).

``scale_dtype`` defaults to the weight's dtype (the checkpoint's ``weight_scale`` dtype). Both
divisions and the product round in that dtype, so bf16 weights see bf16 double rounding exactly
as the serving checkpoint was produced. Codes are int8 values in ``[q_min, 7]``; the checkpoint
packs them eight per int32 (``pack_int4_to_int32``) with an offset of 8.
"""
from __future__ import annotations

import torch

from skyrl_numerics.errors import InputError

from . import codecs as C
from .blocks import (block_amax, block_amax_fused, codes_to_blocks, from_blocks, fused_apply, resolve_block,
                     to_blocks)
from .qtensor import QTensor


#: per recipe: (scale divisor D, lowest code q_min); codes lie in [q_min, 7] (module doc)
INT4_GRIDS = {"int4_g32": (7.5, -8), "int4_g32_kimi": (7.0, -7)}


def quantize_int4(x: torch.Tensor, group: int = 32, scale_dtype: torch.dtype | None = None,
                  scale=None) -> QTensor:
    """compressed-tensors INT4 groups, ``s = amax / 7.5``, codes ``[-8, 7]`` (module doc).
    ``scale``: stored group scales (``[R, C/group]``) to re-encode with (static)."""
    return _quantize_int4(x, "int4_g32", group, scale_dtype, scale)


def quantize_int4_kimi(x: torch.Tensor, group: int = 32, scale_dtype: torch.dtype | None = None,
                       scale=None) -> QTensor:
    """Kimi INT4 groups (SkyRL 0.4.0 ``fake_int4_qat``), ``s = amax / 7.0``, codes ``[-7, 7]``
    (module doc). ``scale``: stored group scales (``[R, C/group]``) to re-encode with (static)."""
    return _quantize_int4(x, "int4_g32_kimi", group, scale_dtype, scale)


def _quantize_int4(x: torch.Tensor, recipe: str, group: int, scale_dtype, scale) -> QTensor:
    if not x.is_floating_point():
        raise InputError(f"int4 quantizes floating-point weights, got {x.dtype}", field="x")
    div, qmin = INT4_GRIDS[recipe]
    sd = scale_dtype or x.dtype
    xb, info = to_blocks(x, (1, group), dtype=x.dtype)
    if scale is None:
        amax = block_amax(xb).to(sd)
        s = amax / div
        s = torch.where(s == 0, torch.tensor(torch.finfo(sd).eps, dtype=sd), s)
    else:
        s = torch.as_tensor(scale)
        nb = (xb.shape[0], xb.shape[2])
        if tuple(s.shape) != nb:
            raise InputError(f"static int4 scales have shape {tuple(s.shape)}, expected {nb}", field="scale")
        s = s.reshape(nb[0], 1, nb[1], 1)
    scaled = xb / s
    if bool(torch.isnan(scaled).any()):
        idx = int(torch.isnan(from_blocks(scaled, info)).flatten().nonzero()[0])
        raise InputError(f"NaN or infinite value in int4 input (flat index {idx})", field="x", index=idx)
    q = C.encode_int4(scaled.clamp(qmin, 7))
    return QTensor(recipe, from_blocks(q, info), s.reshape(s.shape[0], s.shape[2]), None, (1, group),
                   tuple(x.shape), x.dtype, {"group": group, "scale_dtype": s.dtype})


def dequantize_int4(q: QTensor) -> torch.Tensor:
    """``q.to(scale_dtype) * s`` in the scale dtype (compressed-tensors ``_dequantize``)."""
    info = (q.shape, *resolve_block(torch.Size(q.shape), q.block))
    cb = codes_to_blocks(q.codes, info)
    s = q.scales
    return from_blocks(cb.to(s.dtype) * s.reshape(s.shape[0], 1, s.shape[1], 1), info)


def pack_int4_to_int32(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack_to_int32`` layout: ``u = q + 8`` (uint4), eight per int32 along the
    last dim, element ``8i + j`` in bits ``4j .. 4j+3``."""
    if q.shape[-1] % 8:
        raise InputError(f"int32 packing needs the last dim divisible by 8, got {q.shape[-1]}", field="q")
    u = (q.to(torch.int64) + 8).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    packed = (u << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4_from_int32(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4_to_int32` -> int8 ``[..., n]``."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, dtype=torch.int64) * 4
    u = (p.unsqueeze(-1) >> shifts) & 0xF
    return (u.reshape(*packed.shape[:-1], -1)[..., :n] - 8).to(torch.int8)


# -- fused fake-quant (``fake_quant`` fast path) ------------------------------------------------
def fake_quant_int4(x: torch.Tensor, recipe: str = "int4_g32", **opts) -> torch.Tensor | None:
    """``dequantize(quantize(x, recipe, **opts))`` (``int4_g32``, ``int4_g32_kimi``) bit for bit,
    chunked, in the same dtypes (the division and the product round in the scale dtype).
    ``None``: reference only (static scales, another scale dtype, NaN: the reference raises
    naming the index)."""
    if opts.get("scale") is not None:
        return None
    group = int(opts.get("group", 32))
    sd = opts.get("scale_dtype") or x.dtype
    if sd != x.dtype or group <= 0:
        return None
    eps = torch.tensor(torch.finfo(sd).eps, dtype=sd)
    div, qmin = INT4_GRIDS[recipe]
    nan = []

    def fn(xb):
        s = block_amax_fused(xb) / div
        s = torch.where(s == 0, eps, s)
        xb.div_(s)
        if bool(torch.isnan(xb).any()):
            nan.append(True)
        return xb.clamp_(qmin, 7).round_().add_(0.0).mul_(s)    # + 0: the int8 code has no -0

    y = fused_apply(x, (1, group), fn, dtype=x.dtype)
    return None if nan or y is None else y
