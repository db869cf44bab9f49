"""PackedGates: the engine's MoE combine weights, beside the expert ids of :class:`.routes.PackedRoutes`.

``values[Σ tokens, L, k]`` holds, for each route row (same rows, same convention: prompt + response
minus the final sampled token), each MoE layer and each of the ``k`` chosen experts *in the order of
the ids row*, the weight the engine multiplied that expert's output with before summing (the
*combine weight*; vLLM's ``topk_weights`` times the routed scaling factor, see
:mod:`skyrl_numerics.engine.gate_capture`). ``cu_seqlens[B+1]`` (int32) is the routes' own.

Storage format (``dtype``):

* ``"float16"`` (default): 2 B per weight. Weights of a normalized top-k lie in ``(0, 1]`` (DeepSeek-V3:
  ``(0, routed_scaling_factor]``), where fp16 keeps 11 significant bits (relative error <= 2^-11);
  every bf16 value in fp16's normal range ``[2^-14, 65504]`` is exact in fp16, so a weight the engine
  computed in bf16 (vLLM CPU's softmax top-k for Qwen3-MoE) is stored losslessly. Weights below
  ``2^-14`` become fp16 subnormals (absolute error <= 2^-25).
* ``"bfloat16"``: 2 B, 8 significant bits (round to nearest even from float32), stored as its uint16
  bit pattern (numpy has no bf16).
* ``"float32"``: 4 B, the engine's float32 value bit for bit.

Bytes per token: ``L * k * itemsize`` (Qwen3-30B-A3B, L = 48, k = 8: 768 B in fp16, vs 384 B of uint8
ids). Non-finite weights are refused, and so are values fp16 cannot hold.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from skyrl_numerics.errors import InputError

from .routes import check_arrays_digest, exact_ints, xxh3_digest

GATE_DTYPES = {"float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"), "float32": np.dtype("<f4")}
ARRAYS_VERSION = 1


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exact."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def encode_gates(x, dtype: str) -> np.ndarray:
    """Float weights -> the storage array of ``dtype``; refuses non-finite and out-of-range values."""
    if dtype not in GATE_DTYPES:
        raise InputError(f"unknown gate dtype {dtype!r}, expected one of {sorted(GATE_DTYPES)}", field="dtype")
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind != "f":
        raise InputError(f"gate weights must be floats, got dtype {a.dtype}", field="values")
    a32 = a.astype(np.float32)
    bad = ~np.isfinite(a32)
    if dtype == "float16":
        bad |= np.abs(a32) > np.finfo(np.float16).max
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        raise InputError(f"gate weight {a.reshape(-1)[i]!r} is not finite in {dtype}", field="values", index=i)
    if dtype == "bfloat16":
        return bf16_bits(a32)
    return a32.astype(GATE_DTYPES[dtype])


def _arrays_digest(values: np.ndarray, cu: np.ndarray, dtype: str) -> int:
    meta = f"PackedGates|{ARRAYS_VERSION}|{dtype}|{values.dtype.str}|{values.shape}|{cu.dtype.str}|{cu.shape}"
    return xxh3_digest(meta.encode(), cu, values)


class PackedGates:
    """Combine weights ``values[T, L, k]`` (stored as ``dtype``) + ``cu_seqlens[B+1]`` (int32)."""

    __slots__ = ("values", "cu_seqlens", "dtype")

    def __init__(self, values: np.ndarray, cu_seqlens: np.ndarray, dtype: str = "float16"):
        if dtype not in GATE_DTYPES:
            raise InputError(f"unknown gate dtype {dtype!r}, expected one of {sorted(GATE_DTYPES)}", field="dtype")
        values = np.asarray(values)
        if values.ndim != 3:
            raise InputError(f"expected shape [tokens, layers, k], got {values.shape}", field="values")
        if values.dtype != GATE_DTYPES[dtype]:
            raise InputError(f"storage dtype {values.dtype}, expected {GATE_DTYPES[dtype]} for {dtype} "
                             "(encode floats with PackedGates.from_sequences or encode_gates)", field="values")
        cu = np.asarray(cu_seqlens)
        if cu.dtype != np.int32 or cu.ndim != 1 or cu.size < 1:
            raise InputError(f"expected int32 [B+1], got {cu.dtype} {cu.shape}", field="cu_seqlens")
        d = np.diff(cu.astype(np.int64))
        if int(cu[0]) != 0 or (d.size and d.min() < 0) or int(cu[-1]) != values.shape[0]:
            raise InputError(f"must start at 0, not decrease and end at {values.shape[0]} rows",
                             field="cu_seqlens")
        if dtype != "bfloat16" and values.size and not np.isfinite(values).all():
            i = int(np.argmax(~np.isfinite(values).reshape(-1)))
            raise InputError("non-finite gate weight", field="values", index=i)
        self.values, self.cu_seqlens, self.dtype = values, cu, dtype

    @classmethod
    def from_sequences(cls, seqs: Iterable, dtype: str = "float16") -> "PackedGates":
        """Pack per-sequence ``[n_b, L, k]`` float arrays (numpy or torch) into ``dtype`` storage."""
        parts = [encode_gates(s, dtype) for s in seqs]
        if not parts:
            raise InputError("no sequences given", field="seqs")
        shape = parts[0].shape[1:]
        for b, p in enumerate(parts):
            if p.ndim != 3 or p.shape[1:] != shape:
                raise InputError(f"expected [tokens, {shape}], got {p.shape}", field="seqs", index=b)
        cu = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([p.shape[0] for p in parts], out=cu[1:])
        return cls(np.concatenate(parts), cu.astype(np.int32), dtype)

    @classmethod
    def concat(cls, parts: Sequence["PackedGates"]) -> "PackedGates":
        if not parts:
            raise InputError("nothing to concatenate", field="parts")
        dtype = parts[0].dtype
        for i, p in enumerate(parts):
            if p.dtype != dtype or p.values.shape[1:] != parts[0].values.shape[1:]:
                raise InputError(f"part {i} is {p.dtype} {p.values.shape[1:]}, part 0 {dtype} "
                                 f"{parts[0].values.shape[1:]}", field="parts", index=i)
        cu = np.zeros(sum(p.num_seqs for p in parts) + 1, dtype=np.int64)
        np.cumsum(np.concatenate([p.seq_lens for p in parts]), out=cu[1:])
        return cls(np.concatenate([p.values for p in parts]), cu.astype(np.int32), dtype)

    # ---- shape -----------------------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.values.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.values.shape[1])

    @property
    def k(self) -> int:
        return int(self.values.shape[2])

    @property
    def seq_lens(self) -> np.ndarray:
        return np.diff(self.cu_seqlens.astype(np.int64))

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.cu_seqlens.nbytes)

    @property
    def bytes_per_token(self) -> int:
        """``L * k * itemsize``: what one route row's weights cost."""
        return self.num_layers * self.k * GATE_DTYPES[self.dtype].itemsize

    def seq(self, b: int) -> np.ndarray:
        """Storage rows of sequence ``b`` (a view)."""
        return self.values[self.cu_seqlens[b]:self.cu_seqlens[b + 1]]

    def seqs(self, first: int, last: int) -> "PackedGates":
        """Sequences ``first .. last`` (inclusive) as their own PackedGates (views)."""
        cu = self.cu_seqlens[first:last + 2]
        return PackedGates(self.values[cu[0]:cu[-1]], cu - cu[0], self.dtype)

    def rows(self, index) -> np.ndarray:
        """float32 weights of route rows ``index`` (any numpy index), decoded."""
        return self.decode(self.values[index])

    def decode(self, stored: np.ndarray) -> np.ndarray:
        """Storage -> float32 (exact)."""
        if self.dtype == "bfloat16":
            return bf16_to_float32(stored)
        return np.asarray(stored, dtype=np.float32)

    def to_float32(self) -> np.ndarray:
        return self.decode(self.values)

    def check_routes(self, routes) -> None:
        """Same rows and shape as ``routes`` (a :class:`PackedRoutes`), or an ``InputError``."""
        if self.values.shape != routes.values.shape or not np.array_equal(self.cu_seqlens, routes.cu_seqlens):
            raise InputError(f"gates {self.values.shape} over {self.num_seqs} sequences do not match routes "
                             f"{routes.values.shape} over {routes.num_seqs}", field="gates")

    def __eq__(self, other) -> bool:
        return (isinstance(other, PackedGates) and self.dtype == other.dtype
                and np.array_equal(self.cu_seqlens, other.cu_seqlens)
                and self.values.shape == other.values.shape
                and np.array_equal(self.values.view(np.uint8), other.values.view(np.uint8)))

    def __repr__(self) -> str:
        return f"PackedGates(B={self.num_seqs}, T={self.num_tokens}, L={self.num_layers}, k={self.k}, {self.dtype})"

    # ---- arrays ----------------------------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """``{"values", "cu_seqlens", "dtype", "version", "digest"}``; ``dtype`` as its index in
        ``GATE_DTYPES`` (int64 [1]) so every array is numeric (safetensors)."""
        code = list(GATE_DTYPES).index(self.dtype)
        return {"values": self.values, "cu_seqlens": self.cu_seqlens,
                "dtype": np.array([code], dtype=np.int64),
                "version": np.array([ARRAYS_VERSION], dtype=np.int64),
                "digest": np.array([_arrays_digest(self.values, self.cu_seqlens, self.dtype)], dtype=np.uint64)}

    @classmethod
    def from_arrays(cls, d: dict) -> "PackedGates":
        known = ("values", "cu_seqlens", "dtype", "version", "digest")
        for key in d:
            if key not in known:
                raise InputError(f"unknown array {key!r}", field=key)
        for key in ("values", "cu_seqlens", "dtype"):
            if key not in d:
                raise InputError(f"missing array '{key}'", field=key)
        code = exact_ints(d["dtype"], "dtype").reshape(-1)
        if code.size != 1 or not 0 <= int(code[0]) < len(GATE_DTYPES):
            raise InputError(f"dtype code {code.tolist()}, expected one of 0..{len(GATE_DTYPES) - 1}", field="dtype")
        dtype = list(GATE_DTYPES)[int(code[0])]
        values, cu = np.asarray(d["values"]), np.asarray(d["cu_seqlens"])
        check_arrays_digest(d, ARRAYS_VERSION, lambda: _arrays_digest(values, cu, dtype))
        return cls(values, cu, dtype)
