"""Fused Triton fake-quant kernels (fast path) for ``fp8_block``, ``mxfp8`` / ``mxfp4`` and ``nvfp4``.

One program reads ``BPP`` blocks of ``BLK`` contiguous elements (1xBLK blocks along the last
dimension), computes each block's scale, rounds the elements and writes ``x_hat`` (and, for the
clipped STE, a mask of the elements inside the representable range) in one pass. The arithmetic
is the torch reference's, operation for operation, in float32:

* minifloat rounding is exact and portable: ``e = max(floor_log2(a), emin)`` from the exponent
  bits, ``v = a * 2^(mbits - e)`` (exact), ``rne(v) = (v + 2^23) - 2^23`` (IEEE add rounds to
  nearest even), clamped to the format max; the sign bit is copied so ``-0.0`` survives;
* divisions are ``tl.math.div_rn`` (IEEE), never the approximate ``div.full``, and kernels are
  launched with ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA;
* NVFP4 global scalars are computed on the host with the reference formulas.

The kernels assume finite inputs (NaN/inf handling is the reference's job; see ``codecs``).
Tests run them bitwise against the torch recipes in the Triton interpreter (``TRITON_INTERPRET=1``,
CPU tensors) and compile them for sm_90 and sm_100.
"""
from __future__ import annotations

import torch

from skyrl_numerics.errors import InputError

from .ste import STEFunction

try:  # triton is optional: the reference recipes never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

FLT_MAX = 3.4028234663852886e38

if triton is not None:

    @triton.jit
    def _floor_log2(a):
        return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127

    @triton.jit
    def _pow2(e):
        """2^e for integer e in [-126, 127] (normal fp32)."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _round_mag(a, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr):
        """RNE of a finite a >= 0 onto a minifloat grid, saturating at MAXV."""
        a = tl.minimum(a, MAXV)
        e = tl.maximum(_floor_log2(a), EMIN)
        v = a * _pow2(MBITS - e)
        r = (v + 8388608.0) - 8388608.0
        return r * _pow2(e - MBITS)

    @triton.jit
    def _load_f32(ptr, offs, m):
        """Load as float32. bf16 tensors arrive as int16 bit patterns and are widened by a shift,
        so subnormals survive whatever the backend (or the interpreter) does in casts."""
        raw = tl.load(ptr + offs, mask=m, other=0)
        if ptr.dtype.element_ty == tl.int16:
            return ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        return raw.to(tl.float32)

    @triton.jit
    def _cast_out(v, ptr):
        """float32 -> output dtype with RNE; for bf16 (int16 bit patterns) rounded on the bits."""
        if ptr.dtype.element_ty == tl.int16:
            b = v.to(tl.int32, bitcast=True)
            return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)
        return v.to(ptr.dtype.element_ty)

    @triton.jit
    def _signed(q, x):
        return tl.where(x.to(tl.int32, bitcast=True) < 0, -q, q)

    @triton.jit
    def _fp8_block_kernel(x_ptr, out_ptr, mask_ptr, nblk, eps, rcp448,
                          BLK: tl.constexpr, BPP: tl.constexpr, UE8M0: tl.constexpr, WRITE_MASK: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BPP + tl.arange(0, BPP)
        cols = tl.arange(0, BLK)
        offs = rows[:, None] * BLK + cols[None, :]
        m = (rows < nblk)[:, None]
        x = _load_f32(x_ptr, offs, m)
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.maximum(amax, eps) * rcp448
        if UE8M0:
            bits = s.to(tl.int32, bitcast=True)
            up = (bits & 0x7FFFFF) != 0
            bits = tl.where(up, ((bits >> 23) + 1) << 23, bits)
            s = bits.to(tl.float32, bitcast=True)
        s2 = s[:, None]
        y = tl.math.div_rn(x, s2)
        q = _signed(_round_mag(tl.abs(y), 3, -6, 448.0), y)
        tl.store(out_ptr + offs, _cast_out(q * s2, out_ptr), mask=m)
        if WRITE_MASK:
            hi = 448.0 * s2
            tl.store(mask_ptr + offs, ((x >= -hi) & (x <= hi)).to(tl.int8), mask=m)

    @triton.jit
    def _mx_kernel(x_ptr, out_ptr, mask_ptr, nblk,
                   BLK: tl.constexpr, BPP: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                   MAXV: tl.constexpr, EMAX: tl.constexpr, RCEIL: tl.constexpr, WRITE_MASK: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BPP + tl.arange(0, BPP)
        cols = tl.arange(0, BLK)
        offs = rows[:, None] * BLK + cols[None, :]
        m = (rows < nblk)[:, None]
        x = _load_f32(x_ptr, offs, m)
        amax = tl.max(tl.abs(x), axis=1)
        if RCEIL:
            d = tl.math.div_rn(amax, MAXV)
            bits = d.to(tl.int32, bitcast=True)
            field = (bits >> 23) & 0xFF
            k = field - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            k = tl.where(field == 0, tl.where(d > 5.877471754111438e-39, -126, -127), k)
            b = tl.minimum(tl.maximum(k, -127), 127) + 127
            inv = tl.where(b == 0, 1.0, tl.where(b == 254, 5.877471754111438e-39,
                                                 ((254 - b) << 23).to(tl.float32, bitcast=True)))
            y = x * inv[:, None]
        else:
            field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            b = tl.minimum(tl.maximum(field - 127 - EMAX, -127), 128) + 127
            X = tl.where(b == 0, 5.877471754111438e-39, (b << 23).to(tl.float32, bitcast=True))
            y = tl.math.div_rn(x, X[:, None])
        dec = tl.where(b == 0, 5.877471754111438e-39, (b << 23).to(tl.float32, bitcast=True))[:, None]
        q = _signed(_round_mag(tl.abs(y), MBITS, EMIN, MAXV), y)
        tl.store(out_ptr + offs, _cast_out(q * dec, out_ptr), mask=m)
        if WRITE_MASK:
            hi = MAXV * dec
            tl.store(mask_ptr + offs, ((x >= -hi) & (x <= hi)).to(tl.int8), mask=m)

    @triton.jit
    def _nvfp4_kernel(x_ptr, out_ptr, mask_ptr, glob_ptr, nblk,
                      BPP: tl.constexpr, CONV: tl.constexpr, WRITE_MASK: tl.constexpr):
        """CONV: 0 vllm, 1 te, 2 modelopt, 3 torchao, 4 compressed_tensors, 5 torchao<0.17, 6 modelopt<0.45.
        glob_ptr holds [P0, P1, P2] (host-computed)."""
        pid = tl.program_id(0)
        rows = pid * BPP + tl.arange(0, BPP)
        cols = tl.arange(0, 16)
        offs = rows[:, None] * 16 + cols[None, :]
        m = (rows < nblk)[:, None]
        x = _load_f32(x_ptr, offs, m)
        a = tl.max(tl.abs(x), axis=1)
        p0 = tl.load(glob_ptr)
        p1 = tl.load(glob_ptr + 1)
        p2 = tl.load(glob_ptr + 2)
        if CONV == 0:      # vllm: p0 = G, p1 = fl(1/G)
            s = _round_mag(tl.minimum(p0 * (a * 0.16666666666666666), 448.0), 3, -6, 448.0)
            mult = tl.where(s == 0, 0.0, tl.math.div_rn(1.0, s * p1))
            y = x * mult[:, None]
            f = tl.math.div_rn(s, p0)
        elif CONV == 1:    # te: p0 = S, p1 = fl(1/S), p2 = A
            s = _round_mag(tl.minimum(tl.minimum(tl.math.div_rn(a, 6.0) * p0, 3.4028234663852886e38), 448.0),
                           3, -6, 448.0)
            mult = tl.minimum(tl.math.div_rn(1.0, s * p1), 3.4028234663852886e38)
            y = x * mult[:, None]
            f = (s * p2) * 0.00037202380952380954
        elif CONV == 2 or CONV == 6:    # modelopt: p0 = fl(6 g), p1 = g; >= 0.45 clamps to [2^-9, 448]
            s_hp = tl.math.div_rn(a, p0)
            s_hp = tl.where(s_hp == 0, 1.0, s_hp)
            if CONV == 2:
                s_hp = tl.minimum(tl.maximum(s_hp, 0.001953125), 448.0)
            s = _round_mag(s_hp, 3, -6, 448.0)
            f = s * p1
            y = tl.math.div_rn(x, f[:, None])
            y = tl.where(y != y, float("inf"), y)
            y = tl.where(y == 0, 0.0, y)
        elif CONV == 4:    # compressed_tensors: p0 = G (encode global)
            s = _round_mag(tl.minimum(p0 * tl.math.div_rn(a, 6.0), 448.0), 3, -6, 448.0)
            s = tl.where(s == 0, 0.125, s)
            f = tl.math.div_rn(s, p0)
            y = tl.math.div_rn(x, f[:, None])
            y = tl.where(y == 0, 0.0, y)
        else:              # torchao (3: x * fl(fl(1/g)/s); 5, < 0.17: x / fl(g*s)): p1 = g
            r = tl.math.div_rn(tl.math.div_rn(a, 6.0), p1)
            s = _round_mag(tl.minimum(tl.maximum(r, 0.015625), 448.0), 3, -6, 448.0)
            f = p1 * s
            if CONV == 3:
                y = x * tl.math.div_rn(tl.math.div_rn(1.0, p1), s)[:, None]
            else:
                y = tl.math.div_rn(x, f[:, None])
        y = tl.where(y != y, 0.0, y)   # 0 * inf (the multiplier overflows on tiny globals): 0, as the reference
        y = tl.minimum(tl.maximum(y, -6.0), 6.0)
        q = _signed(_round_mag(tl.abs(y), 1, 0, 6.0), y)
        if CONV == 2 or CONV == 6:     # modelopt decodes code 0b1000 as +0
            q = tl.where(q == 0, 0.0, q)
        f2 = f[:, None]
        tl.store(out_ptr + offs, _cast_out(q * f2, out_ptr), mask=m)
        if WRITE_MASK:
            hi = 6.0 * f2
            tl.store(mask_ptr + offs, ((x >= -hi) & (x <= hi)).to(tl.int8), mask=m)


SUPPORTED = ("fp8_block", "mxfp8", "mxfp4", "nvfp4")
_ELEM = {"e4m3fn": (3, -6, 448.0, 8), "e5m2": (2, -14, 57344.0, 15), "e2m1": (1, 0, 6.0, 2)}
_CONV = {"vllm": 0, "te": 1, "modelopt": 2, "torchao": 3, "compressed_tensors": 4, "torchao<0.17": 5,
         "modelopt<0.45": 6}
#: the options each kernel implements; any other (a static ``scale`` / ``global_scale``, ...) is refused
OPTIONS = {"fp8_block": ("block", "eps", "ue8m0"), "mxfp8": ("elem", "scale_mode"), "mxfp4": ("scale_mode",),
           "nvfp4": ("convention", "global_amax", "tile")}


def _nvfp4_globals(x: torch.Tensor, convention: str, global_amax) -> torch.Tensor | None:
    """[P0, P1, P2] float32 per convention, computed like the reference (None: all-zero output)."""
    from .recipes_nvfp4 import resolve_global_amax, te_encode_global
    A = resolve_global_amax(x, global_amax)
    if convention == "compressed_tensors":
        G = 2688.0 / torch.clamp(A, min=torch.finfo(torch.float32).tiny)
        G = torch.where(torch.isfinite(G), G, torch.tensor(1.0))
        return torch.stack([G, G, G]).to(torch.float32).to(x.device)
    if float(A) == 0.0:
        return None
    if convention == "te":
        S = te_encode_global(A)
        vals = [S, 1.0 / S, A]
    else:
        g = A / 2688.0
        if convention == "vllm":
            G = 1.0 / g
            vals = [G, 1.0 / G, g]
        elif convention in ("modelopt", "modelopt<0.45"):
            vals = [6.0 * g, g, g]
        else:
            vals = [g, g, g]
    return torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()) for v in vals]).to(x.device)


def fake_quant_triton(x: torch.Tensor, recipe: str, *, clip_mask: bool = False, bpp: int = 16, **opts):
    """Fused fake-quant; returns ``x_hat`` (and the clipped-STE mask if ``clip_mask``).

    Bitwise equal to ``fake_quant(x, recipe, **opts)`` for finite ``x`` whose last dimension is a
    multiple of the block. Supported: ``fp8_block`` (``block=(1, 128)``, ``eps``, ``ue8m0``),
    ``mxfp8`` (``elem``, ``scale_mode``), ``mxfp4`` (``scale_mode``), ``nvfp4`` (``convention``,
    ``global_amax``, ``tile=(1, 16)``); any other option (``global_scale``, a static ``scale``) is an
    ``InputError``, never silently ignored.
    """
    if triton is None:
        raise InputError("the Triton fast path needs the 'triton' package", field="recipe")
    if recipe not in SUPPORTED:
        raise InputError(f"no Triton kernel for recipe {recipe!r}; supported: {SUPPORTED}", field="recipe")
    bad = sorted(k for k, v in opts.items() if v is not None and k not in OPTIONS[recipe])
    if bad:
        raise InputError(f"the Triton {recipe} kernel does not implement option(s) {bad} (it takes "
                         f"{list(OPTIONS[recipe])}); use fake_quant", field=bad[0])
    blk = {"fp8_block": 128, "mxfp8": 32, "mxfp4": 32, "nvfp4": 16}[recipe]
    if recipe == "fp8_block" and tuple(opts.get("block", (1, 128))) != (1, 128):
        raise InputError("the Triton fp8_block kernel does 1x128 tiles; use the reference for 2-D blocks",
                         field="block")
    if recipe == "nvfp4" and tuple(opts.get("tile", (1, 16))) != (1, 16):
        raise InputError("the Triton nvfp4 kernel does 1x16 blocks; use the reference for 16x16 tiles", field="tile")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise InputError(f"the Triton kernels take float32 or bfloat16, got {x.dtype}", field="x")
    if x.shape[-1] % blk:
        raise InputError(f"last dim {x.shape[-1]} is not a multiple of the {recipe} block {blk}", field="x")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    xk, ok = (xc.view(torch.int16), out.view(torch.int16)) if x.dtype == torch.bfloat16 else (xc, out)
    nblk = xc.numel() // blk
    mask = torch.empty(xc.shape if clip_mask else (1,), dtype=torch.int8, device=x.device)
    grid = (triton.cdiv(nblk, bpp),)
    if recipe == "fp8_block":
        _fp8_block_kernel[grid](xk, ok, mask, nblk, float(opts.get("eps", 1e-10)), 1.0 / 448.0,
                                BLK=128, BPP=bpp, UE8M0=bool(opts.get("ue8m0", False)), WRITE_MASK=clip_mask,
                                enable_fp_fusion=False)
    elif recipe in ("mxfp8", "mxfp4"):
        elem = "e2m1" if recipe == "mxfp4" else opts.get("elem", "e4m3fn")
        mb, emin, maxv, emax = _ELEM[elem]
        _mx_kernel[grid](xk, ok, mask, nblk, BLK=32, BPP=bpp, MBITS=mb, EMIN=emin, MAXV=maxv, EMAX=emax,
                         RCEIL=opts.get("scale_mode", "floor") == "rceil", WRITE_MASK=clip_mask,
                         enable_fp_fusion=False)
    else:
        conv = opts.get("convention", "vllm")
        if conv not in _CONV:
            raise InputError(f"unknown nvfp4 convention {conv!r}", field="convention")
        glob = _nvfp4_globals(xc, conv, opts.get("global_amax"))
        if glob is None:
            out.zero_()
            if clip_mask:
                mask.fill_(1)
        else:
            _nvfp4_kernel[grid](xk, ok, mask, glob, nblk, BPP=bpp, CONV=_CONV[conv], WRITE_MASK=clip_mask,
                                enable_fp_fusion=False)
    out = out.view(x.shape)
    return (out, mask.view(x.shape)) if clip_mask else out


class _TritonSTE(STEFunction):
    @staticmethod
    def forward(ctx, x, recipe, clip, opts):
        if clip:
            y, mask = fake_quant_triton(x.detach(), recipe, clip_mask=True, **opts)
            ctx.save_for_backward(mask)
        else:
            y = fake_quant_triton(x.detach(), recipe, **opts)
        ctx.clip = clip
        return y


def ste_fake_quant_triton(x: torch.Tensor, recipe: str, clip: bool = False, **opts) -> torch.Tensor:
    """Triton ``fake_quant`` with the plain (identity) or clipped straight-through gradient."""
    return _TritonSTE.apply(x, recipe, clip, opts)
