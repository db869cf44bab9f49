"""Element codecs: the bit-exact torch reference for every low-precision element format.

Formats (sign-magnitude minifloats, plus the scale and integer formats used by the recipes):

===========  =====  =====  ====  ============  ==========================================
format       ebits  mbits  bias  max finite    specials
===========  =====  =====  ====  ============  ==========================================
e4m3fn       4      3      7     448           no inf; NaN = S.1111.111 (0x7F / 0xFF)
e5m2         5      2      15    57344         inf = S.11111.00; NaN = S.11111.{01,10,11}
e2m1         2      1      1     6             none (16 codes: +-{0,.5,1,1.5,2,3,4,6})
e8m0         8      0      127   2^127         unsigned, no zero; 0xFF = NaN
int4         -      -      -     7 (min -8)    two's complement nibble
===========  =====  =====  ====  ============  ==========================================

Encoding is round-to-nearest, ties-to-even (RNE), the rounding of the hardware ``cvt.rn`` and of
ml_dtypes. For a finite magnitude ``a``::

    e = max(floor(log2 a), emin)        # emin = 1 - bias (subnormals share the min-normal quantum)
    q = 2^(e - mbits) * rne(a / 2^(e - mbits))

which is exact in the input's own float type (division by a power of two). The sign bit is copied
from the input, so ``-0.0`` encodes to the negative-zero code and ``-tiny`` rounds to ``-0``.

Out-of-range input — the documented choices (``saturate=True`` is the serving-side default,
PTX ``cvt.rn.satfinite``, vLLM/TE/torchao clamps):

* e4m3fn: finite overflow -> +-448; +-inf -> +-448; NaN -> 0x7F (sign kept: 0xFF for -NaN).
  With ``saturate=False`` it matches ml_dtypes / torch: overflow and inf -> NaN.
* e5m2: finite overflow and +-inf -> +-57344; NaN -> 0x7E (0xFE). ``saturate=False`` matches
  ml_dtypes: overflow rounds to +-inf (>= 61440), inf stays inf.
* e2m1: always saturates (overflow and +-inf -> +-6, as ml_dtypes). It has no NaN code, so NaN
  raises :class:`InputError` (ml_dtypes silently returns a zero code). Recipes never hand NaN to
  it: a block containing NaN gets a NaN *scale* and zero element codes, so it decodes to NaN.
* e8m0: encodes a positive scale; 0, negative, inf and NaN -> 0xFF (NaN), as ml_dtypes. Rounding
  mode ``nearest`` (mantissa >= 1.5 rounds up: ml_dtypes), ``floor`` or ``ceil``; results clamp
  to [2^-127, 2^127] (``floor``/``ceil`` saturate like ``cvt.rp.satfinite``; ``nearest`` rounding
  past 2^127 gives NaN, as ml_dtypes).
* int4: RNE then clamp to [-8, 7]; NaN raises :class:`InputError` (ml_dtypes truncates and wraps).

Decoding is a table lookup built from the bit fields, so it is exact for every code.
FP4 packing: two codes per byte, **low nibble first** (element 2i in bits 0..3, element 2i+1 in
bits 4..7), as vLLM / modelopt / compressed-tensors NVFP4 checkpoints and torchao store them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from skyrl_numerics.errors import InputError

__all__ = [
    "MiniFloat", "E4M3", "E5M2", "E2M1", "FORMATS",
    "encode", "decode", "round_to", "encode_e8m0", "decode_e8m0",
    "encode_int4", "decode_int4", "pack_fp4", "unpack_fp4", "pack_int4", "unpack_int4",
]


@dataclass(frozen=True)
class MiniFloat:
    """A sign-magnitude minifloat format; ``nan_code`` is the positive NaN code (None: no NaN)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_finite: float
    inf_code: int | None
    nan_code: int | None

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def nbits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)

    def code_value(self, code: int) -> float:
        """Value of one code, computed from its bit fields (float64, exact)."""
        sign = -1.0 if code & self.sign_bit else 1.0
        mag = code & (self.sign_bit - 1)
        if self.nan_code is not None and self._is_nan(mag):
            return float("nan")
        if self.inf_code is not None and mag == self.inf_code:
            return sign * float("inf")
        exp_field, mant = mag >> self.mbits, mag & ((1 << self.mbits) - 1)
        if exp_field == 0:
            return sign * mant * 2.0 ** (self.emin - self.mbits)
        return sign * (1 + mant / 2 ** self.mbits) * 2.0 ** (exp_field - self.bias)

    def _is_nan(self, mag: int) -> bool:
        if self.name == "e5m2":
            return mag > 0x7C
        return mag == self.nan_code


E4M3 = MiniFloat("e4m3fn", 4, 3, 7, 448.0, None, 0x7F)
E5M2 = MiniFloat("e5m2", 5, 2, 15, 57344.0, 0x7C, 0x7E)
E2M1 = MiniFloat("e2m1", 2, 1, 1, 6.0, None, None)
FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}
FORMATS["e4m3"] = E4M3

_TABLES: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(fmt: MiniFloat, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode table over all codes, sorted non-negative finite values) as float32."""
    key = (fmt.name, torch.device(device))
    if key not in _TABLES:
        n = 1 << fmt.nbits
        dec = torch.tensor([fmt.code_value(c) for c in range(n)], dtype=torch.float64)
        pos = [fmt.code_value(c) for c in range(fmt.sign_bit)]
        finite = torch.tensor([v for v in pos if v == v and abs(v) != float("inf")], dtype=torch.float64)
        _TABLES[key] = (dec.to(torch.float32).to(device), finite.to(torch.float32).to(device))
    return _TABLES[key]


def _fmt(fmt: MiniFloat | str) -> MiniFloat:
    if isinstance(fmt, MiniFloat):
        return fmt
    if fmt not in FORMATS:
        raise InputError(f"unknown element format {fmt!r}; expected one of {sorted(FORMATS)}",
                         field="format")
    return FORMATS[fmt]


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    if not x.is_floating_point():
        raise InputError(f"expected a floating-point tensor, got {x.dtype}", field="x")
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^k for integer tensors k in the normal range of ``dtype``, built from the exponent bits."""
    if dtype == torch.float64:
        return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def _rne_parts(a: torch.Tensor, fmt: MiniFloat) -> tuple[torch.Tensor, torch.Tensor]:
    """For finite ``a >= 0``: ``(e, r)`` with ``e = max(floor(log2 a), emin)`` and the integer
    significand ``r = rne(a / 2^(e - mbits))`` (as a float); the grid value is ``r * 2^(e - mbits)``.
    ``a * 2^(mbits - e)`` is exact, ``torch.round`` is half-to-even."""
    if a.dtype == torch.float64:               # floor(log2 a) from the exponent field; 0 and
        e = ((a.view(torch.int64) >> 52) & 0x7FF).to(torch.int32) - 1023   # subnormals clamp to emin
    else:
        e = ((a.view(torch.int32) >> 23) & 0xFF) - 127
    e = e.clamp(min=fmt.emin)
    return e, torch.round(a * _pow2(fmt.mbits - e, a.dtype))


def _rne_magnitude(a: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """RNE of finite non-negative ``a`` onto the format's grid with an unbounded exponent above."""
    e, r = _rne_parts(a, fmt)
    return r * _pow2(e - fmt.mbits, a.dtype)


@functools.lru_cache(maxsize=None)
def _max_mag(fmt: MiniFloat) -> int:
    """Magnitude code of the largest finite value."""
    return max(c for c in range(fmt.sign_bit) if fmt.code_value(c) == fmt.max_finite)


def round_to(x: torch.Tensor, fmt: MiniFloat | str, *, saturate: bool = True) -> torch.Tensor:
    """``decode(encode(x))`` computed arithmetically, in float32 (float64 for float64 input).

    Same special-value rules as :func:`encode`, except e2m1 maps NaN to NaN here (no code needed).
    """
    fmt = _fmt(fmt)
    xf = x.to(_work_dtype(x))
    a = xf.abs()
    finite = torch.isfinite(a)
    q = _rne_magnitude(torch.where(finite, a, torch.zeros_like(a)), fmt)
    over = (q > fmt.max_finite) | torch.isinf(a)
    if saturate or fmt.nan_code is None:
        q = torch.where(over, torch.full_like(q, fmt.max_finite), q)
    elif fmt.inf_code is not None:
        q = torch.where(over, torch.full_like(q, float("inf")), q)
    else:
        q = torch.where(over, torch.full_like(q, float("nan")), q)
    q = torch.where(torch.isnan(a), a, q)
    return torch.where(torch.signbit(xf), -q, q)


def encode(x: torch.Tensor, fmt: MiniFloat | str, *, saturate: bool = True) -> torch.Tensor:
    """Encode ``x`` to ``fmt`` codes (uint8, one code per element), RNE; see module doc for specials."""
    fmt = _fmt(fmt)
    xf = x.to(_work_dtype(x))
    if fmt == E4M3 and saturate and xf.dtype == torch.float32 and xf.device.type == "cpu":
        # torch's own float32 -> float8_e4m3fn cast rounds to nearest even with the same NaN
        # codes (sign kept); clamped to +-448 first (satfinite: inf too; torch 2.13's CPU cast
        # saturates by itself, the clamp keeps that on versions that map overflow to NaN) it
        # equals the path below for every one of the 2^32 float32 inputs (checked exhaustively,
        # torch 2.13 CPU; the test runs every bf16 pattern, the ties and the boundaries). Two
        # passes instead of ~20.
        return xf.clamp(-fmt.max_finite, fmt.max_finite).to(torch.float8_e4m3fn).view(torch.uint8)
    return _encode_arith(xf, fmt, saturate)


def _encode_arith(xf: torch.Tensor, fmt: MiniFloat, saturate: bool) -> torch.Tensor:
    """:func:`encode` computed arithmetically from ``xf`` (float32 or float64), every format."""
    a = xf.abs()
    nan = torch.isnan(a)
    if fmt.nan_code is None and bool(nan.any()):
        idx = int(nan.flatten().nonzero()[0])
        raise InputError(f"NaN has no {fmt.name} code (flat index {idx}); quantize NaN blocks via a recipe",
                         field="x", index=idx)
    finite = torch.isfinite(a)
    e, r = _rne_parts(torch.where(finite, a, torch.zeros_like(a)), fmt)
    # code magnitude = (e - emin) * 2^mbits + r: subnormals (e = emin, r < 2^mbits) and the carry
    # of r = 2^(mbits+1) into the next binade both come out right without a case split
    mag = (e - fmt.emin) * (1 << fmt.mbits) + r.to(torch.int32)
    top = _max_mag(fmt)
    over = (mag > top) | torch.isinf(a)
    mag = torch.where(over, top, mag)
    if not saturate and fmt.nan_code is not None:
        special = fmt.inf_code if fmt.inf_code is not None else fmt.nan_code
        mag = torch.where(over, torch.full_like(mag, special), mag)
    if fmt.nan_code is not None:
        mag = torch.where(nan, torch.full_like(mag, fmt.nan_code), mag)
    code = mag | torch.where(torch.signbit(xf), fmt.sign_bit, 0).to(torch.int32)
    return code.to(torch.uint8)


def decode(codes: torch.Tensor, fmt: MiniFloat | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode uint8 codes (only the low ``nbits`` are read) to ``dtype`` by exact table lookup."""
    fmt = _fmt(fmt)
    if codes.dtype not in (torch.uint8, torch.int32, torch.int64, torch.int16):
        codes = codes.view(torch.uint8)
    dec, _ = _tables(fmt, codes.device)
    idx = (codes.to(torch.int64) & ((1 << fmt.nbits) - 1))
    return dec[idx].to(dtype)


# ----------------------------------------------------------------------------------------- E8M0
def encode_e8m0(s: torch.Tensor, mode: str = "nearest") -> torch.Tensor:
    """Encode positive scales to E8M0 (uint8, value 2^(code-127)).

    ``mode``: ``nearest`` (ml_dtypes: round the float's mantissa, >= 1.5 goes up), ``floor``
    (largest power of two <= s; OCP MX) or ``ceil`` (smallest power of two >= s; PTX
    ``cvt.rp.satfinite.ue8m0``). Exact from frexp, no log2 rounding. 0, negative, inf, NaN -> 0xFF.
    """
    if mode not in ("nearest", "floor", "ceil"):
        raise InputError(f"unknown E8M0 rounding mode {mode!r}; expected nearest, floor or ceil",
                         field="mode")
    sf = s.to(_work_dtype(s))
    m, e = torch.frexp(sf)                       # sf = m * 2^e, m in [0.5, 1)
    k = e.to(torch.int32) - 1                    # floor(log2 s)
    frac = m * 2                                 # in [1, 2)
    if mode == "nearest":
        k = k + (frac >= 1.5).to(torch.int32)
    elif mode == "ceil":
        k = k + (frac > 1).to(torch.int32)
    code = (k + 127).clamp(0, 254)
    bad = ~torch.isfinite(sf) | (sf <= 0)
    if mode == "nearest":                       # ml_dtypes: rounding past 2^127 is NaN, not saturated
        bad = bad | (k > 127)
    return torch.where(bad, torch.full_like(code, 255), code).to(torch.uint8)


def decode_e8m0(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2^(code - 127); code 255 -> NaN. Exact (2^-127 is an fp32 subnormal)."""
    c = codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes
    v = torch.pow(torch.tensor(2.0, dtype=torch.float64, device=c.device), c.to(torch.float64) - 127)
    v = torch.where(c == 255, torch.full_like(v, float("nan")), v)
    return v.to(dtype)


# ----------------------------------------------------------------------------------------- INT4
def encode_int4(x: torch.Tensor) -> torch.Tensor:
    """RNE then clamp to [-8, 7]; returns int8 values. NaN raises InputError."""
    xf = x.to(_work_dtype(x))
    nan = torch.isnan(xf)
    if bool(nan.any()):
        idx = int(nan.flatten().nonzero()[0])
        raise InputError(f"NaN has no int4 code (flat index {idx})", field="x", index=idx)
    return torch.round(xf).clamp(-8, 7).to(torch.int8)


def decode_int4(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int4 values (int8 container, or uint8 nibbles in two's complement) -> float."""
    if q.dtype == torch.uint8:
        q = ((q.to(torch.int16) & 0xF) ^ 0x8) - 0x8
    return q.to(dtype)


# -------------------------------------------------------------------------------------- packing
def _check_even(codes: torch.Tensor, what: str) -> None:
    if codes.shape[-1] % 2:
        raise InputError(f"{what} needs an even last dimension, got shape {tuple(codes.shape)}",
                         field="codes")


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte, low nibble first: ``byte = c[2i] | c[2i+1] << 4``."""
    _check_even(codes, "pack_fp4")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 ``[..., n]`` -> codes ``[..., 2n]``."""
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 values (int8 in [-8, 7]) two per byte, low nibble first, two's complement nibbles."""
    _check_even(q, "pack_int4")
    return pack_fp4((q.to(torch.int16) & 0xF).to(torch.uint8))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4` -> int8 values in [-8, 7]."""
    return decode_int4(unpack_fp4(packed), torch.int16).to(torch.int8)


# ------------------------------------------------------------------------- fused fake-quant helpers
#: (smallest binade exponent emin, mantissa bits) of the element grids the fast paths round onto
_GRID = {"e4m3fn": (-6, 3), "e5m2": (-14, 2), "e2m1": (0, 1)}


def round_grid(y: torch.Tensor, fmt: MiniFloat | str, *, keep_sign: bool = True,
               out: torch.Tensor | None = None, work: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``y`` (already clamped to +-max_finite, or NaN) -> the nearest value of ``fmt``'s
    grid, ties to even: ``decode(encode(y))`` bit for bit (NaN stays NaN).

    The add-and-subtract trick: in ``y``'s binade the grid step is
    ``q = 2^(max(floor(log2|y|), emin) - mbits)``; with ``c = 1.5 * 2^23 * q`` the sum ``y + c``
    lies where the float32 ulp is exactly ``q`` (|y| < 16q), so the addition itself rounds ``y``
    to the grid (RNE) and ``(y + c) - c`` is exact. ``2^floor(log2|y|)`` is ``y``'s exponent
    bits. Four passes instead of the ~12 of :func:`round_to`. The sign is copied back from
    ``y`` (``-tiny -> -0``); ``keep_sign=False`` leaves every zero +0 (modelopt decodes code
    0b1000 as +0). ``out``/``work``: float32 buffers shaped like ``y`` (``out`` may be ``y``
    only when ``keep_sign=False``)."""
    fmt = _fmt(fmt)
    emin, mbits = _GRID[fmt.name]
    c = work if work is not None else torch.empty_like(y)
    torch.bitwise_and(y.view(torch.int32), 0x7F800000, out=c.view(torch.int32))
    c.clamp_(min=2.0 ** emin).mul_(1.5 * 2.0 ** (23 - mbits))
    r = torch.add(y, c, out=out) if out is not None else y + c
    r.sub_(c)
    if keep_sign:
        torch.copysign(r, y, out=r)
    return r
