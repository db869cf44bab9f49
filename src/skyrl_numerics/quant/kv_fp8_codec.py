"""FP8 KV-cache simulation: what vLLM writes into an FP8 cache and what attention reads back.

``fp8`` KV (``reshape_and_cache_flash``, ``kv_cache_dtype="fp8"`` = E4M3)::

    write: code = e4m3_satfinite_rne(float(x) / k_scale)      # fp8::scaled_convert, true division
    read:  x_hat = float(decode(code)) * k_scale

MLA latent cache (``concat_and_cache_mla``): one row per token ``[kv_c (kv_lora_rank) | k_pe
(rope dim)]`` where ``kv_c`` is the normalised latent and ``k_pe`` the post-RoPE key part, both
written with the **same per-layer** ``k_scale`` by the formula above.

DeepSeek-V3.2 ``fp8_ds_mla`` (``concat_and_cache_ds_mla``), 656 bytes per token::

    bytes [0, 512)    kv_c as E4M3, four tiles of 128: code = e4m3_satfinite_rne(x / s_t)
    bytes [512, 528)  four float32 tile scales s_t = max(amax(|x_tile|) / 448, FLT_MIN)
    bytes [528, 656)  k_pe as 64 bfloat16 values, copied verbatim (not quantized)

Reading it back gives ``decode(code) * s_t`` and the exact bf16 ``k_pe``. NaN stays NaN; inf in
``x`` saturates to +-448 * scale (satfinite), except in ``fp8_ds_mla`` where an inf makes the
tile scale inf (then finite elements read back as 0 and the inf one as NaN).
"""
from __future__ import annotations

import torch

from skyrl_numerics.errors import InputError

from . import codecs as C

FLT_MIN = torch.finfo(torch.float32).tiny
DS_MLA_NOPE, DS_MLA_ROPE, DS_MLA_TILE, DS_MLA_BYTES = 512, 64, 128, 656


def _scale(k_scale) -> torch.Tensor:
    s = torch.as_tensor(k_scale, dtype=torch.float32)
    if s.numel() != 1 or not bool(torch.isfinite(s).all() & (s > 0).all()):
        raise InputError(f"k_scale must be one positive finite number, got {s.tolist()}", field="k_scale")
    return s.reshape(())


def fp8_kv_write(x: torch.Tensor, k_scale) -> torch.Tensor:
    """E4M3 codes (uint8) that vLLM stores for ``x`` with a per-layer ``k_scale``."""
    return C.encode(x.float() / _scale(k_scale), C.E4M3)


def fp8_kv_read(codes: torch.Tensor, k_scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``decode(code) * k_scale`` as ``dtype``: the fp32 product rounded to ``dtype``, taken from
    a 256-entry table of exactly those values (:func:`_read_table`) with one gather — a cache
    read decodes the whole history every step, and the per-element decode, multiply and cast
    were 3 passes over it (same bits for every code, NaNs included: tested)."""
    c = codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)
    table = _read_table(float(_scale(k_scale)), dtype, c.device)
    take = _take() if c.device.type == "cpu" and c.numel() >= _TAKE_MIN else None
    if take is None:
        return table.index_select(0, c.reshape(-1).to(torch.int32)).view(c.shape)
    # on CPU the compiled lookup (3.4x faster on a 16 x 96 x 576 history): the same bits
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[table.element_size()]
    out = torch.empty(c.shape, dtype=table.dtype)
    take(c.contiguous().view(-1).numpy(), table.view(word).numpy(), out.view(word).view(-1).numpy())
    return out


_TAKE = None
_TAKE_MIN = 4096      # elements below which the compiled call's overhead is not worth it


def _take():
    """The compiled lookup (:mod:`skyrl_numerics.quant._kv_fp8_read_numba`), or None when numba does not
    import or ``SKYRL_NUMERICS_NUMBA=0`` (then the torch gather, the same bits)."""
    global _TAKE
    import os

    if os.environ.get("SKYRL_NUMERICS_NUMBA", "1") == "0":
        return None
    if _TAKE is None:
        try:
            from skyrl_numerics.quant import _kv_fp8_read_numba
        except Exception:                 # noqa: BLE001 (missing or broken numba: the torch gather)
            _TAKE = False
        else:
            _TAKE = _kv_fp8_read_numba.take
    return _TAKE or None


_READ_TABLES: dict = {}


def _read_table(scale: float, dtype: torch.dtype, device) -> torch.Tensor:
    """``(decode(code) * scale).to(dtype)`` for the 256 E4M3 codes (cached per scale/dtype)."""
    key = (scale, dtype, str(device))
    t = _READ_TABLES.get(key)
    if t is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        t = (C.decode(codes, C.E4M3) * torch.tensor(scale, dtype=torch.float32)).to(dtype).to(device)
        if len(_READ_TABLES) > 256:
            _READ_TABLES.clear()
        _READ_TABLES[key] = t
    return t


def fp8_kv_roundtrip(x: torch.Tensor, k_scale) -> torch.Tensor:
    """What attention sees after ``x`` went through an FP8 cache, in ``x``'s dtype."""
    return fp8_kv_read(fp8_kv_write(x, k_scale), k_scale, x.dtype)


def mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, k_scale) -> torch.Tensor:
    """``concat_and_cache_mla`` with an fp8 cache: uint8 rows ``[kv_c | k_pe]``, one ``k_scale``."""
    if kv_c.shape[:-1] != k_pe.shape[:-1]:
        raise InputError(f"kv_c {tuple(kv_c.shape)} and k_pe {tuple(k_pe.shape)} disagree on tokens", field="k_pe")
    return torch.cat([fp8_kv_write(kv_c, k_scale), fp8_kv_write(k_pe, k_scale)], dim=-1)


def mla_cache_read(cache: torch.Tensor, k_scale, kv_lora_rank: int, dtype=torch.float32):
    """-> ``(kv_c_hat, k_pe_hat)`` read back from :func:`mla_cache_write` rows."""
    x = fp8_kv_read(cache, k_scale, dtype)
    return x[..., :kv_lora_rank], x[..., kv_lora_rank:]


def ds_mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``fp8_ds_mla``: uint8 ``[..., 656]`` per token (layout in the module doc)."""
    if kv_c.shape[-1] != DS_MLA_NOPE or k_pe.shape[-1] != DS_MLA_ROPE:
        raise InputError(f"fp8_ds_mla needs kv_c [..., 512] and k_pe [..., 64], got {tuple(kv_c.shape)} "
                         f"and {tuple(k_pe.shape)}", field="kv_c")
    lead = kv_c.shape[:-1]
    tiles = kv_c.float().reshape(*lead, 4, DS_MLA_TILE)
    s = torch.clamp(tiles.abs().amax(-1, keepdim=True) / 448.0, min=FLT_MIN)
    codes = C.encode(tiles / s, C.E4M3).reshape(*lead, DS_MLA_NOPE)
    scale_bytes = s.reshape(*lead, 4).contiguous().view(torch.uint8)
    rope_bytes = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([codes, scale_bytes, rope_bytes], dim=-1)


def ds_mla_roundtrip(kv_c: torch.Tensor, k_pe: torch.Tensor):
    """What ``fp8_ds_mla`` hands back for any ``kv_c`` whose last dim is a multiple of 128 (tiles of
    128, float32 tile scales ``max(amax/448, FLT_MIN)``) and ``k_pe`` (rounded to bf16).
    Equals :func:`ds_mla_cache_read` of :func:`ds_mla_cache_write` for the 512/64 geometry."""
    d = kv_c.shape[-1]
    if d % DS_MLA_TILE:
        raise InputError(f"fp8_ds_mla tiles kv_c in 128s; last dim {d} is not a multiple of 128", field="kv_c")
    t = kv_c.float().reshape(*kv_c.shape[:-1], d // DS_MLA_TILE, DS_MLA_TILE)
    s = torch.clamp(t.abs().amax(-1, keepdim=True) / 448.0, min=FLT_MIN)
    back = (C.round_to(t / s, C.E4M3) * s).reshape(kv_c.shape)
    return back.to(kv_c.dtype), k_pe.to(torch.bfloat16).to(k_pe.dtype)


def ds_mla_cache_read(cache: torch.Tensor, dtype=torch.float32):
    """-> ``(kv_c_hat [..., 512] as dtype, k_pe [..., 64] bfloat16)`` from 656-byte rows."""
    if cache.dtype != torch.uint8 or cache.shape[-1] != DS_MLA_BYTES:
        raise InputError(f"expected uint8 [..., 656] fp8_ds_mla rows, got {cache.dtype} {tuple(cache.shape)}",
                         field="cache")
    lead = cache.shape[:-1]
    vals = C.decode(cache[..., :DS_MLA_NOPE], C.E4M3).reshape(*lead, 4, DS_MLA_TILE)
    s = cache[..., DS_MLA_NOPE:DS_MLA_NOPE + 16].contiguous().view(torch.float32).reshape(*lead, 4, 1)
    k_pe = cache[..., DS_MLA_NOPE + 16:].contiguous().view(torch.bfloat16)
    return (vals * s).reshape(*lead, DS_MLA_NOPE).to(dtype), k_pe
