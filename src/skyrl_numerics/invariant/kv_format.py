"""KV-cache formats of the invariant forward: the bytes a token's cache row is stored as.

The engine writes each token's row into its paged cache with :meth:`KVFormat.encode` and reads
rows back with :meth:`KVFormat.decode`; the trainer sends its own rows through
:meth:`KVFormat.roundtrip` = decode(encode(.)) — the same functions, so both sides attend over the
same values bit for bit. The quantizers are :mod:`skyrl_numerics.quant.kv_fp8_codec`'s, which reproduce
vLLM's cache kernels:

===============  ==========================  =====================================================
format           row (per token, per layer)  bytes
===============  ==========================  =====================================================
``auto``         model dtype, verbatim       GQA ``2·Hkv·D·s``; MLA ``(R + Dr)·s`` (s = 2 for bf16)
``fp8``          E4M3, per-layer scales      GQA: K with ``k_scale``, V with ``v_scale``
                 ``code = e4m3(x / scale)``  (``reshape_and_cache_flash``), ``2·Hkv·D``;
                                             MLA: ``[kv_c | k_pe]`` both with ``k_scale``
                                             (``concat_and_cache_mla``), ``R + Dr``
``fp8_ds_mla``   MLA only (R = 512, Dr = 64) 512 E4M3 latent codes, four fp32 tile scales
                                             ``max(amax/448, FLT_MIN)``, 64 bf16 rope values: 656
===============  ==========================  =====================================================

Read back, values are ``decode(code) * scale`` in fp32, rounded to the model dtype.
Scales are per layer: one number for all layers or a list with one per layer (vLLM's default
without checkpoint scales is 1.0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_numerics.errors import InputError

FORMATS = ("auto", "fp8", "fp8_ds_mla")


def parse_kv_spec(spec) -> dict:
    """``None`` / ``"auto"`` / ``"fp8"`` / ``"fp8_ds_mla"`` / ``{"format", "k_scale", "v_scale"}``
    -> a plain dict (JSON-able: it travels to the engine in the HF config)."""
    if spec is None:
        spec = "auto"
    if isinstance(spec, str):
        spec = {"format": spec}
    if not isinstance(spec, dict):
        raise InputError(f"kv_cache must be a format name or a dict, got {type(spec).__name__}",
                         field="kv_cache")
    unknown = set(spec) - {"format", "k_scale", "v_scale"}
    if unknown:
        raise InputError(f"unknown kv_cache keys {sorted(unknown)}", field="kv_cache")
    fmt = spec.get("format", "auto")
    if fmt not in FORMATS:
        raise InputError(f"kv_cache format {fmt!r} is not one of {FORMATS}", field="kv_cache.format")
    out = {"format": fmt}
    for key in ("k_scale", "v_scale"):
        v = spec.get(key, 1.0)
        vals = list(v) if isinstance(v, (list, tuple)) else [v]
        for j, x in enumerate(vals):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 < float(x) < float("inf")):
                raise InputError(f"{key} must be positive finite numbers, got {x!r}",
                                 field=f"kv_cache.{key}", index=j)
        out[key] = [float(x) for x in vals] if isinstance(v, (list, tuple)) else float(v)
    return out


def _per_layer(v, layer: int, name: str, layers: int) -> float:
    if isinstance(v, list):
        if len(v) != layers:
            raise InputError(f"{name} has {len(v)} entries for {layers} layers", field=f"kv_cache.{name}")
        return v[layer]
    return v


@dataclass(frozen=True)
class KVFormat:
    """A row layout: ``kind`` "gqa" (``[K (Hkv·D) | V (Hkv·D)]``) or "mla" (``[kv_c (R) | k_pe
    (Dr)]``), ``split`` = Hkv·D or R, ``width`` = the row length, the model ``dtype``, the spec."""
    kind: str
    split: int
    width: int
    dtype: torch.dtype
    spec: dict
    layers: int

    def __post_init__(self):
        fmt = self.spec["format"]
        if fmt == "fp8_ds_mla":
            if self.kind != "mla" or self.split != 512 or self.width != 576:
                raise InputError("kv_cache format 'fp8_ds_mla' needs an MLA model with "
                                 f"kv_lora_rank 512 and qk_rope_head_dim 64 (got {self.kind}, "
                                 f"{self.split}, {self.width - self.split})", field="kv_cache.format")

    @property
    def format(self) -> str:
        return self.spec["format"]

    @property
    def row_bytes(self) -> int:
        fmt = self.format
        if fmt == "auto":
            return self.width * torch.finfo(self.dtype).bits // 8
        if fmt == "fp8":
            return self.width
        return 656

    def _scales(self, layer: int) -> tuple[float, float]:
        return (_per_layer(self.spec["k_scale"], layer, "k_scale", self.layers),
                _per_layer(self.spec["v_scale"], layer, "v_scale", self.layers))

    def encode(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """rows ``[T, width]`` (model dtype) -> uint8 ``[T, row_bytes]``."""
        from skyrl_numerics.quant import kv_fp8_codec as Q

        fmt, s = self.format, self.split
        if fmt == "auto":
            return rows.to(self.dtype).contiguous().view(torch.uint8)
        if fmt == "fp8":
            ks, vs = self._scales(layer)
            if self.kind == "mla":
                return Q.mla_cache_write(rows[:, :s], rows[:, s:], ks)
            return torch.cat([Q.fp8_kv_write(rows[:, :s], ks), Q.fp8_kv_write(rows[:, s:], vs)], -1)
        return Q.ds_mla_cache_write(rows[:, :s], rows[:, s:])

    def decode(self, layer: int, data: torch.Tensor) -> torch.Tensor:
        """uint8 ``[..., row_bytes]`` -> rows ``[..., width]`` in the model dtype."""
        from skyrl_numerics.quant import kv_fp8_codec as Q

        fmt, s = self.format, self.split
        if fmt == "auto":
            return data.contiguous().view(self.dtype)
        if fmt == "fp8":    # straight to the model dtype: decode * scale is fp32, rounded once
            ks, vs = self._scales(layer)
            if self.kind == "mla":     # mla_cache_read's [kv_c | k_pe], both with k_scale
                return Q.fp8_kv_read(data, ks, self.dtype)
            return torch.cat([Q.fp8_kv_read(data[..., :s], ks, self.dtype),
                              Q.fp8_kv_read(data[..., s:], vs, self.dtype)], -1)
        c, pe = Q.ds_mla_cache_read(data)
        return torch.cat([c.to(self.dtype), pe.to(self.dtype)], -1)

    def roundtrip(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """What the engine reads back for ``rows``: ``decode(encode(rows))``."""
        if self.format == "auto":
            return rows.to(self.dtype)
        return self.decode(layer, self.encode(layer, rows))
