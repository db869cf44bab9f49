"""OCP Microscaling: MXFP8 (E4M3 / E5M2 elements) and MXFP4 (E2M1), blocks of 32, E8M0 scales.

Two ways to pick the shared power-of-two scale ``X = 2^(b - 127)`` of a block with amax ``a``:

``floor`` (OCP MX v1.0 section 6.3, torchao ``ScaleCalculationMode.FLOOR``)::

    b = clamp(E(a) - 127 - emax_elem, -127, 128) + 127        # E(a): a's fp32 biased exponent field
    y = clamp(x / X, -max_elem, max_elem)                     # X = 2^(b - 127); b = 0: X = 2^-127

with ``emax_elem`` = 8 (E4M3), 15 (E5M2), 2 (E2M1). ``a / X`` lies in [2^emax, 2^(emax+1)), so the
top of the block can exceed ``max_elem`` and saturates (E2M1: values in (6, 8) -> 6). ``E(a)`` is
the raw field, so an fp32-subnormal or zero amax gives ``b = 0``; NaN amax gives ``b = 255``.

The same ``X`` encodes and decodes (OCP MX v1.0 6.3). **The one exception to "equals torchao
FLOOR bitwise"** (torchao 0.18 ``to_mx`` / ``to_dtype``, any finite fp32 or bf16 input, E4M3,
E5M2, E2M1): a block with ``b = 0``, i.e. amax below ``2^(emax_elem - 126)`` (2^-118 for E4M3,
2^-111 for E5M2, 2^-124 for E2M1; every block of subnormals is one). torchao encodes it with
``max(X, 2^-126)`` (its ``F32_MIN_NORMAL`` clamp, a Triton workaround its own comment calls less
correct than 2^-127) and decodes with ``2^-127``, so its codes are ``e(x * 2^126)`` and its round
trip halves the block; ours are ``e(clamp(x * 2^127))``, decoded with the same ``2^-127``. Scale
codes are equal, and so is everything in ``b >= 1`` blocks. Measured on 64 blocks of 32 random
values below the smallest normal of the input dtype: 2038 of 2048 E4M3 codes differ for fp32
input (2021 for bf16), 2048 (2021) of E5M2; 0 of 64 scales; a block of zeros: 0.
tests/quant/test_vendor_subnormal.py predicts every differing element (hypothesis, any finite
block).

``rceil`` (NVIDIA cuBLAS / TE ``cvt.rp.satfinite.ue8m0``, torchao ``RCEIL``)::

    d = a / max_elem                                           # float32 division
    b = clamp(ceil(log2 d), -127, 127) + 127                   # exact round-up to a power of two
    y = clamp(x * (b == 0 ? 1 : 2^(127 - b)), -max_elem, max_elem)

torchao computes ``ceil(log2(d))`` with a float log2, which rounds ``d`` within an ulp above
``2^k`` down to ``2^k``; the hardware instruction (and this reference) rounds it up. That is the
only difference from torchao's RCEIL (subnormal and zero blocks included: ``d <= 2^-127`` gives
``b = 0`` in both, and a multiplier of 1, so their elements encode to 0).

Elements are RNE-encoded; ``x_hat = decode(y) * 2^(b - 127)`` (NaN where ``b = 255``). A block
holding NaN gets ``b = 255`` and zero element codes, so it decodes to NaN.
"""
from __future__ import annotations

import torch

from skyrl_numerics.errors import InputError

from . import codecs as C
from .blocks import (block_amax, block_amax_fused, codes_to_blocks, from_blocks, fused_apply, resolve_block,
                     to_blocks)
from .qtensor import QTensor

EMAX = {"e4m3fn": 8, "e5m2": 15, "e2m1": 2}


def _floor_code(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    field = (amax.to(torch.float32).view(torch.int32) >> 23) & 0xFF
    b = (field - 127 - emax_elem).clamp(-127, 128) + 127
    return torch.where(torch.isnan(amax), 255, b).to(torch.int32)


def _rceil_code(amax: torch.Tensor, max_elem: float) -> torch.Tensor:
    d = amax / max_elem
    m, e = torch.frexp(d)
    k = torch.where(m == 0.5, e - 1, e).to(torch.int32)     # exact ceil(log2 d) for finite d > 0
    k = torch.where(d == 0, -127, k)
    k = torch.where(torch.isinf(d), 127, k)
    b = k.clamp(-127, 127) + 127
    return torch.where(torch.isnan(d), 255, b).to(torch.int32)


def quantize_mx(x: torch.Tensor, elem: str = "e4m3fn", scale_mode: str = "floor", block: int = 32,
                recipe: str = "mxfp8", scale=None) -> QTensor:
    """MX quantization of the last dimension in blocks of ``block``; formulas in the module doc.
    ``scale``: stored E8M0 scales (``[R, C/32]``, float8_e8m0fnu or uint8) to re-encode with."""
    if elem not in EMAX:
        raise InputError(f"unknown MX element format {elem!r}; expected one of {sorted(EMAX)}", field="elem")
    if scale_mode not in ("floor", "rceil"):
        raise InputError(f"unknown scale_mode {scale_mode!r}; expected 'floor' or 'rceil'", field="scale_mode")
    fmt = C.FORMATS[elem]
    if elem == "e2m1" and x.shape[-1] % 2:
        raise InputError(f"mxfp4 packs two codes per byte: last dim must be even, got {x.shape[-1]}",
                         field="x")
    xb, info = to_blocks(x, (1, block))
    amax = block_amax(xb)
    if scale is not None:
        sc = torch.as_tensor(scale)
        nb = (xb.shape[0], xb.shape[2])
        if tuple(sc.shape) != nb:
            raise InputError(f"static E8M0 scales have shape {tuple(sc.shape)}, expected {nb}", field="scale")
        b = sc.view(torch.uint8).to(torch.int32).reshape(nb[0], 1, nb[1], 1)
    if scale_mode == "floor":
        b = _floor_code(amax, EMAX[elem]) if scale is None else b
        X = C.decode_e8m0(b.clamp(max=254).to(torch.uint8))        # exact 2^(b-127), b = 0 -> 2^-127
        y = xb / X
    else:
        b = _rceil_code(amax, fmt.max_finite) if scale is None else b
        inv = torch.where(b == 0, 1.0, torch.exp2((127 - b).to(torch.float32)))
        y = xb * inv
    nan_block = b == 255
    y = torch.where(nan_block, torch.zeros_like(y), y).clamp(-fmt.max_finite, fmt.max_finite)
    codes_b = C.encode(y, fmt)
    codes = from_blocks(codes_b, info)
    if elem == "e2m1":
        codes = C.pack_fp4(codes)
    else:
        codes = codes.view(torch.float8_e4m3fn if elem == "e4m3fn" else torch.float8_e5m2)
    scales = b.reshape(b.shape[0], b.shape[2]).to(torch.uint8).view(torch.float8_e8m0fnu)
    opts = {"scale_mode": scale_mode} if recipe == "mxfp4" else {"elem": elem, "scale_mode": scale_mode}
    return QTensor(recipe, codes, scales, None, (1, block), tuple(x.shape), x.dtype, opts)


def dequantize_mx(q: QTensor) -> torch.Tensor:
    """``decode(code) * 2^(b - 127)`` in float32; NaN where ``b = 255``."""
    elem = q.opts.get("elem", "e2m1")
    codes = q.codes.view(torch.uint8)
    if elem == "e2m1":
        codes = C.unpack_fp4(codes)
    info = (q.shape, *resolve_block(torch.Size(q.shape), q.block))
    cb = codes_to_blocks(codes, info)
    X = C.decode_e8m0(q.scales.view(torch.uint8))
    y = C.decode(cb, elem) * X.reshape(X.shape[0], 1, X.shape[1], 1)
    return from_blocks(y, info)


def quantize_mxfp8(x: torch.Tensor, elem: str = "e4m3fn", scale_mode: str = "floor", scale=None) -> QTensor:
    """MXFP8: E4M3 (or ``elem='e5m2'``) elements, 1x32 blocks, E8M0 scale (``floor`` | ``rceil``)."""
    if elem not in ("e4m3fn", "e5m2"):
        raise InputError(f"mxfp8 elements are e4m3fn or e5m2, got {elem!r}", field="elem")
    return quantize_mx(x, elem, scale_mode, 32, "mxfp8", scale)


def quantize_mxfp4(x: torch.Tensor, scale_mode: str = "floor", scale=None) -> QTensor:
    """MXFP4: E2M1 elements (packed two per byte), 1x32 blocks, E8M0 scale, RNE elements."""
    return quantize_mx(x, "e2m1", scale_mode, 32, "mxfp4", scale)


# -- fused fake-quant (``fake_quant`` fast path) ------------------------------------------------
def fake_quant_mx(x: torch.Tensor, recipe: str, **opts) -> torch.Tensor | None:
    """``dequantize(quantize(x, recipe, **opts))`` for mxfp8 / mxfp4 with dynamic scales, bit for
    bit: the scale code ``b`` as in :func:`quantize_mx`, elements rounded onto the grid and
    multiplied by the decoded ``2^(b-127)`` (NaN where ``b = 255``). ``None``: reference only."""
    if opts.get("scale") is not None:
        return None
    elem = "e2m1" if recipe == "mxfp4" else opts.get("elem", "e4m3fn")
    scale_mode = opts.get("scale_mode", "floor")
    if elem not in EMAX or scale_mode not in ("floor", "rceil") or (recipe == "mxfp8" and elem == "e2m1"):
        return None
    fmt = C.FORMATS[elem]

    def fn(xb):
        amax = block_amax_fused(xb)
        if scale_mode == "floor":
            b = _floor_code(amax, EMAX[elem])
            xb.div_(C.decode_e8m0(b.clamp(max=254).to(torch.uint8)))
        else:
            b = _rceil_code(amax, fmt.max_finite)
            xb.mul_(torch.where(b == 0, 1.0, torch.exp2((127 - b).to(torch.float32))))
        nan_block = b == 255
        if bool(nan_block.any()):
            xb.masked_fill_(nan_block, 0.0)
        xb.clamp_(-fmt.max_finite, fmt.max_finite)
        return C.round_grid(xb, fmt).mul_(C.decode_e8m0(b.to(torch.uint8)))

    return fused_apply(x, (1, 32), fn)
