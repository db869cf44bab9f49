"""``quantize`` / ``dequantize`` / ``fake_quant`` over the named recipes.

=============  =============================================================================
recipe         format and source convention (formulas in each ``quantize_*`` docstring)
=============  =============================================================================
fp8_tensor     E4M3, one float32 scale; vLLM QuantFP8 (dynamic ``amax/448`` or static scale)
fp8_channel    E4M3, one scale per row (output channel); compressed-tensors weights
fp8_token      E4M3, one scale per row (token); vLLM dynamic per-token, ``scale_ub``
fp8_block      E4M3, 1x128 / 128x128 blocks; DeepSeek-V3 / vLLM group quant, optional UE8M0;
               ``convention`` vllm | skyrl (SkyRL's FP8 weight-sync cast: ``amax/448``)
mxfp8          E4M3 or E5M2, 1x32 blocks, E8M0 scale; ``scale_mode`` floor (OCP) | rceil (TE)
mxfp4          E2M1, 1x32 blocks, E8M0 scale
nvfp4          E2M1, 1x16 (or 16x16) blocks, E4M3 scale, FP32 global; ``convention``
               vllm | te | modelopt | torchao | compressed_tensors | modelopt<0.45 | torchao<0.17
int4_g32       INT4 symmetric groups of 32, scale in the weight dtype, ``amax/7.5``, codes [-8, 7];
               compressed-tensors W4A16 (llm-compressor RTN)
int4_g32_kimi  the same with ``amax/7.0``, codes [-7, 7]; Kimi K2-Thinking / K2.6 (SkyRL
               ``fake_int4_qat`` with ``scale_divisor=7.0``)
=============  =============================================================================
"""
from __future__ import annotations

import inspect
import math
import numbers
from typing import Callable

import torch

from skyrl_numerics.errors import InputError

from . import recipes_fp8, recipes_int4, recipes_mx, recipes_nvfp4
from .qtensor import QTensor

_Q: dict[str, Callable[..., QTensor]] = {
    "fp8_tensor": recipes_fp8.quantize_fp8_tensor,
    "fp8_channel": recipes_fp8.quantize_fp8_channel,
    "fp8_token": recipes_fp8.quantize_fp8_token,
    "fp8_block": recipes_fp8.quantize_fp8_block,
    "mxfp8": recipes_mx.quantize_mxfp8,
    "mxfp4": recipes_mx.quantize_mxfp4,
    "nvfp4": recipes_nvfp4.quantize_nvfp4,
    "int4_g32": recipes_int4.quantize_int4,
    "int4_g32_kimi": recipes_int4.quantize_int4_kimi,
}
_DQ: dict[str, Callable[[QTensor], torch.Tensor]] = {
    "fp8_tensor": recipes_fp8.dequantize_fp8,
    "fp8_channel": recipes_fp8.dequantize_fp8,
    "fp8_token": recipes_fp8.dequantize_fp8,
    "fp8_block": recipes_fp8.dequantize_fp8,
    "mxfp8": recipes_mx.dequantize_mx,
    "mxfp4": recipes_mx.dequantize_mx,
    "nvfp4": recipes_nvfp4.dequantize_nvfp4,
    "int4_g32": recipes_int4.dequantize_int4,
    "int4_g32_kimi": recipes_int4.dequantize_int4,
}

#: the recipe names ``quantize`` accepts
RECIPES: tuple[str, ...] = tuple(_Q)


def recipe_options(recipe: str) -> tuple[str, ...]:
    """The keyword options a recipe accepts."""
    _check_recipe(recipe)
    return tuple(p for p in inspect.signature(_Q[recipe]).parameters if p != "x")


def _check_recipe(recipe: str) -> None:
    if not isinstance(recipe, str) or recipe not in _Q:
        raise InputError(f"unknown recipe {recipe!r}; expected one of {', '.join(RECIPES)}", field="recipe")


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_opts(recipe: str, x, opts: dict) -> None:
    """The options' types, and the input, before a recipe reads them: each is the project's
    error naming the option (a string scale or a float block used to raise TypeError deep in a
    recipe, a negative ``eps`` or ``scale_ub`` to be taken silently). Values a recipe checks
    itself (block sizes, element formats, static scale tensors) are left to it."""
    bad = sorted(set(opts) - set(recipe_options(recipe)))
    if bad:
        raise InputError(f"recipe {recipe!r} has no option(s) {bad}; it accepts {list(recipe_options(recipe))}",
                         field="opts")
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        raise InputError("a 0-d tensor has no blocks to quantize; reshape it to [1, 1]", field="x")
    for k, v in opts.items():
        if v is None:
            continue
        ok = True
        if k in ("scale", "global_scale", "global_amax"):
            ok = isinstance(v, torch.Tensor) or _is_number(v)
        elif k == "eps":
            ok = _is_number(v) and math.isfinite(v) and v >= 0
        elif k == "scale_ub":
            ok = _is_number(v) and math.isfinite(v) and v > 0
        elif k in ("block", "tile"):
            ok = (isinstance(v, (tuple, list)) and len(v) == 2
                  and all(isinstance(b, int) and not isinstance(b, bool) for b in v))
        elif k == "group":
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif k == "ue8m0":
            ok = isinstance(v, bool)
        elif k == "scale_dtype":
            ok = isinstance(v, torch.dtype) and v.is_floating_point
        elif k in ("elem", "scale_mode", "convention", "observer"):
            ok = isinstance(v, str)
        if not ok:
            raise InputError(f"option {k}={v!r} is not valid for {recipe!r}", field=k)


def quantize(x: torch.Tensor, recipe: str, **opts) -> QTensor:
    """Quantize ``x`` with a named recipe -> :class:`QTensor` (codes, scales, global scale, layout)."""
    _check_recipe(recipe)
    _check_opts(recipe, x, opts)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise InputError(f"expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}", field="x")
    with torch.no_grad():
        return _Q[recipe](x.detach(), **opts)


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode a :class:`QTensor` to ``dtype`` (default: the original dtype). The QTensor is
    checked against its recipe's layout first (:func:`check_qtensor`): codes, scales or a
    layout that do not belong together are refused, never decoded into other numbers."""
    check_qtensor(q)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InputError(f"dtype {dtype!r}: dequantize returns a floating-point tensor", field="dtype")
    with torch.no_grad():
        return _DQ[q.recipe](q).to(dtype or q.dtype)


_FP8_CODES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_qtensor(q: QTensor) -> None:
    """InputError unless ``q`` is laid out as its recipe writes it (:class:`QTensor`): for the
    2-D view ``[R, C]`` of ``q.shape``, codes of the recipe's dtype in the input's shape (FP4:
    ``[..., C/2]`` bytes), block scales ``[ceil(R/br), ceil(C/bc)]`` of the recipe's scale dtype
    (not negative where they are a float type), and NVFP4's one float32 global scale (its
    value is the convention's, as a checkpoint stores it: checked by whoever reads it)."""
    if not isinstance(q, QTensor):
        raise InputError(f"expected a QTensor, got {type(q).__name__}", field="q")
    _check_recipe(q.recipe)
    r = q.recipe

    def bad(what, field):
        return InputError(f"QTensor ({r}): {what}", field=field)
    shape = tuple(q.shape) if isinstance(q.shape, (tuple, list, torch.Size)) else None
    if (not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)):
        raise bad(f"shape {q.shape!r} is not a tuple of sizes", "shape")
    if not (isinstance(q.dtype, torch.dtype) and q.dtype.is_floating_point):
        raise bad(f"dtype {q.dtype!r} is not a floating-point dtype", "dtype")
    blk = tuple(q.block) if isinstance(q.block, (tuple, list)) else ()
    if len(blk) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blk):
        raise bad(f"block {q.block!r} is not two positive sizes", "block")
    for name in ("codes", "scales"):
        if not isinstance(getattr(q, name), torch.Tensor):
            raise bad(f"{name} is {type(getattr(q, name)).__name__}, not a tensor", name)
    C = shape[-1]
    R = 1
    for d in shape[:-1]:
        R *= d
    fp4 = r in ("mxfp4", "nvfp4")
    want_codes = (torch.uint8,) if fp4 else (torch.int8,) if r in recipes_int4.INT4_GRIDS else _FP8_CODES
    if q.codes.dtype not in want_codes:
        raise bad(f"codes are {q.codes.dtype}, expected {' or '.join(map(str, want_codes))}", "codes")
    want_shape = shape[:-1] + (C // 2,) if fp4 else shape
    if tuple(q.codes.shape) != want_shape or (fp4 and C % 2):
        raise bad(f"codes have shape {tuple(q.codes.shape)}, expected {want_shape} for shape {shape}",
                  "codes")
    want_scales = (-(-R // blk[0]), -(-C // blk[1]))
    if tuple(q.scales.shape) != want_scales:
        raise bad(f"scales have shape {tuple(q.scales.shape)}, expected {want_scales} (blocks "
                  f"{blk} of [{R}, {C}])", "scales")
    sd = q.scales.dtype
    if r in ("mxfp8", "mxfp4"):
        ok = sd == torch.float8_e8m0fnu
    elif r == "nvfp4":
        ok = sd == torch.float8_e4m3fn
    else:
        ok = sd.is_floating_point and sd not in _FP8_CODES + (torch.float8_e8m0fnu,)
    if not ok:
        raise bad(f"scales are {sd}, not the recipe's scale dtype", "scales")
    # (inf / NaN scales are what quantize makes of inf / NaN inputs: decoded as documented)
    if r not in ("mxfp8", "mxfp4", "nvfp4") and bool((q.scales < 0).any()):
        raise bad("scales hold a negative value", "scales")
    if r == "nvfp4":
        g = q.global_scale
        if not (isinstance(g, torch.Tensor) and g.numel() == 1 and g.dtype == torch.float32):
            raise bad(f"global_scale must be one float32, got {g!r}", "global_scale")
    elif q.global_scale is not None:
        raise bad("global_scale is set, but only nvfp4 has one", "global_scale")


def requantize(x: torch.Tensor, like: QTensor) -> QTensor:
    """Encode ``x`` with the scales of ``like`` held fixed (static): same recipe, options, block
    scales and global scale. ``requantize(dequantize(q), q).codes == q.codes`` is the round-trip
    a serving checkpoint must pass (``qat_check``)."""
    _check_recipe(like.recipe)
    opts = {k: v for k, v in like.opts.items() if k in recipe_options(like.recipe)}
    opts["scale"] = like.scales
    if like.global_scale is not None:
        opts["global_scale"] = like.global_scale
    return quantize(x, like.recipe, **opts)


_FAST: dict[str, Callable[..., torch.Tensor | None]] = {
    "fp8_tensor": recipes_fp8.fake_quant_fp8,
    "fp8_channel": recipes_fp8.fake_quant_fp8,
    "fp8_token": recipes_fp8.fake_quant_fp8,
    "fp8_block": recipes_fp8.fake_quant_fp8,
    "mxfp8": recipes_mx.fake_quant_mx,
    "mxfp4": recipes_mx.fake_quant_mx,
    "int4_g32": recipes_int4.fake_quant_int4,
    "int4_g32_kimi": recipes_int4.fake_quant_int4,
    "nvfp4": recipes_nvfp4.fake_quant_nvfp4,
}


def fake_quant(x: torch.Tensor, recipe: str, **opts) -> torch.Tensor:
    """``dequantize(quantize(x, recipe, **opts))`` in ``x``'s dtype (no gradient; see ``ste``).

    On CPU a fused path computes the same values without materializing codes (scale, encode and
    decode per block, in cache-sized chunks; element rounding by :func:`codecs.round_grid`),
    bitwise equal to the two-step reference (tests/quant/test_recipes_fast.py); options it does
    not cover (static scales, shapes that need padding) take the reference."""
    _check_recipe(recipe)
    _check_opts(recipe, x, opts)
    fast = _FAST.get(recipe)
    if (fast is not None and isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == "cpu"):
        with torch.no_grad():
            y = fast(x.detach(), recipe, **opts)
        if y is not None:
            return y
    return _fake_quant_reference(x, recipe, **opts)


def _fake_quant_reference(x: torch.Tensor, recipe: str, **opts) -> torch.Tensor:
    """The spec: quantize to codes and scales, then decode."""
    return dequantize(quantize(x, recipe, **opts), x.dtype)
