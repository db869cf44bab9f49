"""FP8 E4M3 recipes with float32 scales: per-tensor, per-channel, per-token, DeepSeek-V3 blocks.

All compute in float32 (bf16/fp16 inputs are upcast first, exactly); elements are encoded with
RNE after a clamp to +-448 (so overflow saturates; NaN stays NaN: code 0x7F). Dequantization is
``decode(code) * scale`` in float32, then cast to the input dtype.
"""
from __future__ import annotations

import torch

from skyrl_numerics.errors import InputError

from . import codecs as C
from .blocks import (block_amax, block_amax_fused, codes_to_blocks, from_blocks, fused_apply, resolve_block,
                     to_blocks)
from .qtensor import QTensor

FP8_MAX = 448.0
#: vLLM ``_FP8_MIN_SCALING_FACTOR``: the smallest dynamic per-tensor / per-token scale
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
#: fp32(1/448), the constant vLLM's Triton group-quant kernel multiplies the amax by
RCP_448 = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)


def _static_scale(scale, nblocks: tuple[int, int], field: str = "scale") -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32)
    if s.numel() == 1:
        s = s.reshape(1, 1).expand(*nblocks)
    if tuple(s.shape) != nblocks:
        raise InputError(f"static scale has shape {tuple(s.shape)}, expected {nblocks} or a scalar",
                         field=field)
    if not bool(torch.isfinite(s).all() & (s > 0).all()):
        raise InputError("static scale must be positive and finite", field=field)
    return s.reshape(nblocks[0], 1, nblocks[1], 1)


def _encode_e4m3(y: torch.Tensor) -> torch.Tensor:
    return C.encode(y.clamp(-FP8_MAX, FP8_MAX), C.E4M3)


def _pack(recipe, x, codes_b, s, info, opts) -> QTensor:
    codes = from_blocks(codes_b, info).view(torch.float8_e4m3fn)
    _, R, Cc, br, bc = info
    return QTensor(recipe, codes, s.reshape(s.shape[0], s.shape[2]), None, (br, bc),
                   tuple(x.shape), x.dtype, opts)


def dequantize_fp8(q: QTensor) -> torch.Tensor:
    """``decode_e4m3(code) * scale`` in float32 (all fp8 recipes)."""
    info = (q.shape, *resolve_block(torch.Size(q.shape), q.block))
    cb = codes_to_blocks(q.codes.view(torch.uint8), info)
    s = q.scales.to(torch.float32)
    y = C.decode(cb, C.E4M3) * s.reshape(s.shape[0], 1, s.shape[1], 1)
    return from_blocks(y, info)


def _vllm_fp8(recipe, x, block, scale, scale_ub) -> QTensor:
    xb, info = to_blocks(x, block)
    nblocks = (xb.shape[0], xb.shape[2])
    if scale is None:
        amax = block_amax(xb)
        if scale_ub is not None:
            amax = amax.clamp(max=float(scale_ub))
        s = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        s = _static_scale(scale, nblocks)
    codes_b = _encode_e4m3(xb * s.reciprocal())
    return _pack(recipe, x, codes_b, s, info, {})


def quantize_fp8_tensor(x: torch.Tensor, scale=None) -> QTensor:
    """Per-tensor FP8 (vLLM ``QuantFP8`` per-tensor, dynamic or static).

    dynamic: ``s = max(amax(|x|) / 448, 1/(448*512))``; static: ``s = scale`` (e.g. a checkpoint's
    ``input_scale``). ``y = e4m3_rne(clamp(x * (1/s), -448, 448))`` — vLLM multiplies by the
    reciprocal rather than dividing. ``x_hat = y * s``.
    An inf in ``x`` makes ``s = inf``: the codes of finite elements are 0 and the inf element's
    NaN (as vLLM), so ``x_hat = code * inf`` is NaN everywhere (``0 · inf``).
    """
    return _vllm_fp8("fp8_tensor", x, (-1, -1), scale, None)


def quantize_fp8_token(x: torch.Tensor, scale_ub=None, scale=None) -> QTensor:
    """Dynamic per-token FP8 (vLLM ``dynamic_per_token_scaled_fp8_quant`` / ``QuantFP8`` per-token).

    For each row of the last dimension: ``a = min(amax(|x_row|), scale_ub)``,
    ``s = max(a / 448, 1/(448*512))``, ``y = e4m3_rne(clamp(x * (1/s), -448, 448))``, ``x_hat = y*s``.
    """
    return _vllm_fp8("fp8_token", x, (1, -1), scale, scale_ub)


def quantize_fp8_channel(x: torch.Tensor, scale=None, block=(1, -1), scale_dtype: torch.dtype | None = None) -> QTensor:
    """Per-output-channel FP8 weights (compressed-tensors ``channel`` strategy, one scale per row);
    ``block=(128, 128)`` gives its ``block`` strategy, ``block=(-1, -1)`` one scale per tensor
    (compressed-tensors ``tensor``, modelopt FP8 weights: ``amax / 448``).

    ``s = amax(|w_blk|) / 448`` (an all-zero block gets ``s = eps(scale dtype)`` as
    compressed-tensors does), ``y = e4m3_rne(clamp(w / s, -448, 448))`` (true division),
    ``w_hat = y * s``. ``scale_dtype``: the dtype the statistics and the division are computed in
    (compressed-tensors computes them in its observer's dtype, which is the stored
    ``weight_scale`` dtype; a bf16 scale means ``w / s`` rounds in bf16 before the FP8 cast);
    default float32.
    """
    sd = scale_dtype or torch.float32
    xb, info = to_blocks(x, tuple(block), dtype=torch.float32 if sd == torch.float32 else x.dtype)
    if scale is None:
        s = block_amax(xb).to(sd) / FP8_MAX
        s = torch.where(s == 0, torch.tensor(torch.finfo(sd).eps, dtype=sd), s)
    else:
        s = _static_scale(scale, (xb.shape[0], xb.shape[2])).to(sd)
    y = (xb / s).float()
    q = _pack("fp8_channel", x, _encode_e4m3(y), s, info, {"block": tuple(block), "scale_dtype": sd})
    return q


def ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s, exactly (frexp; no log2 rounding). 0 stays 0, NaN stays NaN."""
    m, e = torch.frexp(s)
    up = torch.where(m == 0.5, e - 1, e)             # m == 0.5 <=> s is already a power of two
    p = torch.ldexp(torch.ones_like(s), up)
    return torch.where((s == 0) | ~torch.isfinite(s), s, p)


#: ``quantize_fp8_block`` conventions (how the block scale is computed; the module doc's encode)
FP8_BLOCK_CONVENTIONS = ("vllm", "skyrl")


def fp8_block_scale(amax: torch.Tensor, eps: float, ue8m0: bool, convention: str) -> torch.Tensor:
    """The float32 block scale of ``quantize_fp8_block`` from the block amax ``a``:

    - ``vllm``: ``s = max(a, eps) * fp32(1/448)``; ``ue8m0``: the smallest power of two >= s,
      exactly (:func:`ceil_pow2`).
    - ``skyrl``: ``s = max(a, eps) / 448`` (true division); ``ue8m0``: ``2^ceil(log2 s)`` as torch
      computes it in float32 (``log2`` may round ``s`` just above a power of two down to it).
    """
    a = amax.clamp(min=eps)
    if convention == "skyrl":
        s = a / FP8_MAX
        return torch.pow(2.0, torch.ceil(torch.log2(s))) if ue8m0 else s
    s = a * RCP_448
    return ceil_pow2(s) if ue8m0 else s


def quantize_fp8_block(x: torch.Tensor, block=(1, 128), eps: float = 1e-10, ue8m0: bool = False,
                       scale=None, convention: str = "vllm") -> QTensor:
    """DeepSeek-V3 block FP8: 1x128 activation tiles, 128x128 weight blocks (pass ``block``).

    ``s`` per block from its amax (:func:`fp8_block_scale`), ``y = e4m3_rne(clamp(x / s))``,
    ``x_hat = y * s``; blocks that do not divide the shape are zero-padded. Weight checkpoints
    store ``s`` as ``weight_scale_inv`` (one per block). ``convention``:

    - ``"vllm"``: vLLM ``per_token_group_quant_fp8`` (the Triton kernel), ``eps = 1e-10``;
      ``ue8m0=True`` is DeepGEMM on Blackwell, computed exactly here (vLLM's
      ``exp2(ceil(log2(s)))`` can miss by one binade when ``s`` is within an fp32 ulp above a
      power of two).
    - ``"skyrl"``: SkyRL 0.4.0 ``blockwise_cast_to_fp8`` (its FP8 weight-sync wire, 128x128),
      ``power_2_scale`` = ``ue8m0``, its ``log2`` rounding included.
    """
    if convention not in FP8_BLOCK_CONVENTIONS:
        raise InputError(f"unknown fp8_block convention {convention!r}; expected one of "
                         f"{FP8_BLOCK_CONVENTIONS}", field="convention")
    br, bc = block
    xb, info = to_blocks(x, (br, bc))
    if scale is None:
        s = fp8_block_scale(block_amax(xb), eps, ue8m0, convention)
    else:
        s = _static_scale(scale, (xb.shape[0], xb.shape[2]))
    opts = {"block": tuple(block), "ue8m0": ue8m0, "eps": eps, "convention": convention}
    return _pack("fp8_block", x, _encode_e4m3(xb / s), s, info, opts)


# -- fused fake-quant (``fake_quant`` fast path): same formulas, no codes, chunked in cache ----------
def _fq_e4m3(y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``decode(encode_e4m3(clamp(y))) * s`` computed in place on ``y``."""
    y.clamp_(-FP8_MAX, FP8_MAX)
    return C.round_grid(y, C.E4M3).mul_(s)


def fake_quant_fp8(x: torch.Tensor, recipe: str, **opts) -> torch.Tensor | None:
    """``dequantize(quantize(x, recipe, **opts))`` for the fp8 recipes with dynamic scales, bit for
    bit (tests/quant/test_recipes_fast.py), or ``None`` where only the reference applies (static
    scales, blocks that do not divide the shape, a non-float32 ``scale_dtype``)."""
    if opts.get("scale") is not None:
        return None
    if recipe in ("fp8_tensor", "fp8_token"):
        ub = opts.get("scale_ub")

        def scale(amax):
            if ub is not None:
                amax = amax.clamp(max=float(ub))
            return (amax / FP8_MAX).clamp(min=MIN_SCALE)

        def elem(xb, s):
            return _fq_e4m3(xb.mul_(s.reciprocal()), s)
        block = (-1, -1) if recipe == "fp8_tensor" else (1, -1)
    elif recipe == "fp8_channel":
        sd = opts.get("scale_dtype")
        if sd not in (None, torch.float32):
            return None
        block = tuple(opts.get("block", (1, -1)))

        def scale(amax):
            s = amax / FP8_MAX
            return torch.where(s == 0, torch.tensor(torch.finfo(torch.float32).eps), s)

        def elem(xb, s):
            return _fq_e4m3(xb.div_(s), s)
    elif recipe == "fp8_block":
        block = tuple(opts.get("block", (1, 128)))
        eps, ue8m0 = opts.get("eps", 1e-10), opts.get("ue8m0", False)
        conv = opts.get("convention", "vllm")
        if conv not in FP8_BLOCK_CONVENTIONS:
            return None

        def scale(amax):
            return fp8_block_scale(amax, eps, ue8m0, conv)

        def elem(xb, s):
            return _fq_e4m3(xb.div_(s), s)
    else:
        return None
    R, Cc, br, bc = resolve_block(x.shape, block)
    if br == R and R > 1:                   # one scale over all rows: amax of the whole tensor first
        if Cc % bc or x.numel() == 0:
            return None
        amax = x.detach().reshape(R, Cc // bc, bc).abs().amax(dim=(0, 2)).to(torch.float32)
        s = scale(amax.reshape(1, 1, -1, 1))
        return fused_apply(x, (1, bc), lambda xb: elem(xb, s))
    return fused_apply(x, (br, bc), lambda xb: elem(xb, scale(block_amax_fused(xb))))
