"""PackedRoutes: R3 expert routes for a ragged batch, in one contiguous buffer.

Layout (no padding): ``values[Σ tokens, L, k]`` holds, for each token position of each sequence and each
MoE layer (dense layers are not counted), the ``k`` expert ids the router chose, in the order the router
produced them; ``cu_seqlens[B+1]`` (int32) gives sequence ``b`` the rows ``cu[b]:cu[b+1]``. ``values``
uses the smallest unsigned dtype that holds the ids ``0..E-1`` (uint8 for E <= 256, uint16 for
E <= 65536, else uint32): 4x smaller than the int32 ``[T, L, k]`` tensors other stacks ship, and no
``[B, max_len]`` padding.

Convention (what a row covers): the routes of a sequence cover the positions the *inference engine* ran
through the model for it: prompt + response, **except the final sampled token**, which the engine
samples but never feeds back. So a sequence with ``n = len(prompt) + len(response)`` tokens has
``n - 1`` route rows. The trainer's forward over those ``n`` tokens uses the recorded routes for
positions ``0..n-2`` and its own router at position ``n-1``; by causality position ``n-1`` only
changes the logits at ``n-1``, which predict nothing (no token follows), so every logprob the trainer
uses is computed with the engine's routes. A capture that records ``n`` rows (e.g. :func:`record_routes`
on the trainer itself) is accepted as well; replay then uses all of them.

Serialized form (``to_buffer``): one uint8 array, a 64-byte header, then ``cu_seqlens`` and ``values``,
each starting on a 64-byte boundary. The header (format version 2) holds magic, version, flags, id
itemsize, bit width, E, L, k, B, T, the value byte count and an xxh3-64 digest of the whole buffer
(header with the digest field zeroed, cu_seqlens, padding, values). ``from_buffer`` checks every
field against the others (itemsize = that of E's id dtype; bit width ``ceil(log2 E)`` when
bit-packed, 0 otherwise; sizes; buffer length exact) and the digest before it returns anything,
so a flipped bit is an :class:`~skyrl_numerics.errors.InputError`, never other routes. ``from_buffer`` returns numpy views on that memory (zero-copy;
also through the Ray object store, whose ``ray.get`` maps the buffer read-only). An optional bit-packed
form stores ``ceil(log2 E)`` bits per id; loading it unpacks (one copy).

A capture can fill routes in place: ``PackedRoutes.empty(seq_lens, L, k, E)`` allocates the final
buffer, the capture writes ``routes.seq(b)[...] = ids``, then ``routes.validate()``.
"""
from __future__ import annotations

import struct
import warnings
from typing import Callable, Iterable, Sequence

import numpy as np

from skyrl_numerics.errors import InputError

from .bitpack import bits_for, pack_bits, packed_nbytes, unpack_bits


def exact_ints(x, field: str) -> np.ndarray:
    """``x`` (list, numpy or torch) as int64, refusing what would silently become other integers:
    bools, and floats that are not whole finite numbers (``2.7`` is not a length, ``1.9`` not a
    token id)."""
    if hasattr(x, "detach"):                      # torch, without importing it here
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype == object:
        try:
            a = a.astype(np.float64)
        except (TypeError, ValueError):
            raise InputError(f"expected integers, got {str(x)[:60]}", field=field) from None
    if a.dtype.kind == "b" or a.dtype.kind not in "iuf":
        raise InputError(f"expected integers, got dtype {a.dtype}", field=field)
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.floor(a))
        if bad.any():
            i = int(np.argmax(bad.reshape(-1)))
            raise InputError(f"value {a.reshape(-1)[i].item()!r} is not an integer", field=field, index=i)
    return a.astype(np.int64)


def exact_int(v, field: str) -> int:
    """One integer (not a bool, not a float)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InputError(f"expected an integer, got {v!r}", field=field)
    return int(v)

MAGIC = b"SKRNRT01"
# magic, version, flags, itemsize, bits, pad, E, L, k, B, T, nbytes, digest (xxh3-64)
_HEADER = struct.Struct("<8sHHBBHIIIQQQQ")
_DIGEST_AT = _HEADER.size - 8
HEADER_BYTES = 64
ALIGN = 64
VERSION = 2
FLAG_BITPACKED = 1
ARRAYS_VERSION = 1          # to_arrays(): version of the {"values", "cu_seqlens", ...} form
_MAX_ELEMS = 1 << 40        # refuse absurd header sizes before allocating or slicing


def xxh3_digest(*parts) -> int:
    """xxh3-64 of the concatenated byte-like parts (numpy arrays without a copy)."""
    import xxhash

    h = xxhash.xxh3_64()
    for p in parts:
        if isinstance(p, np.ndarray):
            p = memoryview(np.ascontiguousarray(p).reshape(-1).view(np.uint8)) if p.size else b""
        h.update(p)
    return h.intdigest()


def _buffer_digest(arr: np.ndarray) -> int:
    head = bytearray(arr[:HEADER_BYTES].tobytes())
    head[_DIGEST_AT:_DIGEST_AT + 8] = bytes(8)
    return xxh3_digest(bytes(head), arr[HEADER_BYTES:])


def _arrays_digest(values: np.ndarray, cu: np.ndarray, num_experts: int) -> int:
    meta = f"PackedRoutes|{ARRAYS_VERSION}|{num_experts}|{values.dtype.str}|{values.shape}|{cu.dtype.str}|{cu.shape}"
    return xxh3_digest(meta.encode(), cu, values)


def check_arrays_digest(d, version: int, digest: Callable[[], int] | None) -> None:
    """The optional ``version`` + ``digest`` pair of a ``to_arrays()`` dict (PackedRoutes and
    PackedSupport): both or neither; ``version`` must be ``version``; ``digest`` a uint64 [1]
    equal to ``digest()`` (``None``: the arrays' shape cannot be digested; checked later)."""
    if ("version" in d) != ("digest" in d):
        raise InputError("'version' and 'digest' come together", field="version" if "version" not in d else "digest")
    if "version" not in d:
        return
    v = int_scalar(d["version"], "version", 0, 1 << 62)
    if v != version:
        raise InputError(f"unsupported version {v}, expected {version}", field="version")
    dg = np.asarray(d["digest"])
    if dg.dtype != np.uint64 or dg.shape != (1,):
        raise InputError(f"expected uint64 [1], got {dg.dtype} {dg.shape}", field="digest")
    if digest is not None and int(dg[0]) != digest():
        raise InputError("digest does not match the arrays (corrupt or edited)", field="digest")


def int_scalar(x, field: str, lo: int, hi: int) -> int:
    a = np.asarray(x)
    if a.dtype.kind not in "iu" or a.size != 1:
        raise InputError(f"expected one integer, got {a.dtype} of shape {a.shape}", field=field)
    v = int(a.reshape(-1)[0])
    if not lo <= v <= hi:
        raise InputError(f"value {v} outside [{lo}, {hi}]", field=field)
    return v


def id_dtype(num_experts: int) -> np.dtype:
    """Smallest unsigned dtype holding expert ids ``0..num_experts-1``."""
    if num_experts < 1:
        raise InputError(f"num_experts must be >= 1, got {num_experts}", field="num_experts")
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    if num_experts < 1 << 32:
        return np.dtype(np.uint32)
    raise InputError(f"num_experts {num_experts} does not fit the uint32 header field", field="num_experts")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _check_cu_seqlens(cu: np.ndarray, num_tokens: int | None = None, field: str = "cu_seqlens") -> None:
    if cu.ndim != 1 or cu.size < 1:
        raise InputError(f"must be a 1-D array of length B+1 >= 1, got shape {cu.shape}", field=field)
    if int(cu[0]) != 0:
        raise InputError(f"must start at 0, got {int(cu[0])}", field=field, index=0)
    d = np.diff(cu.astype(np.int64))
    if d.size and d.min() < 0:
        i = int(np.argmax(d < 0)) + 1
        raise InputError(f"must be non-decreasing, got {int(cu[i - 1])} then {int(cu[i])}", field=field, index=i)
    if num_tokens is not None and int(cu[-1]) != num_tokens:
        raise InputError(f"last entry {int(cu[-1])} != number of route rows {num_tokens}",
                         field=field, index=cu.size - 1)


class PackedRoutes:
    """Expert ids ``values[T, L, k]`` (smallest unsigned dtype) + ``cu_seqlens[B+1]`` (int32) + ``num_experts``.

    Construct from arrays (validated; no copy when dtypes already match), from per-sequence arrays
    (:meth:`from_sequences`), in place for a capture (:meth:`empty`), or from a buffer (:meth:`from_buffer`).
    """

    __slots__ = ("values", "cu_seqlens", "num_experts", "_buffer")

    def __init__(self, values: np.ndarray, cu_seqlens: np.ndarray, num_experts: int, *, validate: bool = True):
        num_experts = int_scalar(num_experts, "num_experts", 1, (1 << 32) - 1)
        dt = id_dtype(num_experts)
        values = np.asarray(values)
        if values.ndim != 3:
            raise InputError(f"expected shape [tokens, layers, k], got {values.shape}", field="values")
        if values.dtype != dt:
            if values.dtype.kind not in "ui":
                raise InputError(f"expert ids must be integers, got dtype {values.dtype}", field="values")
            if values.size and values.dtype.kind == "i" and int(values.min()) < 0:
                raise InputError(f"negative expert id {int(values.min())}", field="values",
                                 index=int(np.argmin(values.reshape(values.shape[0], -1).min(1))))
            self._check_ids(values, num_experts)
            values = values.astype(dt)
        cu = np.asarray(cu_seqlens)
        if cu.dtype != np.int32:
            if cu.dtype.kind not in "iu":
                raise InputError(f"must be integers, got dtype {cu.dtype} (not truncated)", field="cu_seqlens")
            if cu.ndim != 1:
                raise InputError(f"must be 1-D, got shape {cu.shape}", field="cu_seqlens")
            if cu.size and cu.max() >= 2 ** 31:
                raise InputError("total tokens exceed int32", field="cu_seqlens", index=int(np.argmax(cu >= 2 ** 31)))
            if cu.size and cu.dtype.kind == "i" and cu.min() < 0:
                raise InputError(f"negative entry {int(cu.min())}", field="cu_seqlens", index=int(np.argmin(cu)))
            cu = cu.astype(np.int32)
        self.values, self.cu_seqlens, self.num_experts = values, cu, num_experts
        self._buffer = None
        if validate:
            self.validate()

    # ---- construction -------------------------------------------------------------------------------
    @staticmethod
    def _check_ids(values: np.ndarray, num_experts: int, seq: int | None = None) -> None:
        if values.size == 0:
            return
        dt = values.dtype
        if dt.kind == "u" and num_experts >= (1 << (8 * dt.itemsize)):
            return  # dtype cannot hold an out-of-range id
        vmax = int(values.max())
        if vmax >= num_experts:
            row = int(np.argmax((values.reshape(values.shape[0], -1) >= num_experts).any(axis=1)))
            if seq is None:
                raise InputError(f"expert id {vmax} >= num_experts {num_experts} (row {row})", field="values",
                                 index=row)
            raise InputError(f"expert id {vmax} >= num_experts {num_experts} (sequence {seq}, position {row})",
                             field="seqs", index=seq)

    @classmethod
    def empty(cls, seq_lens: Sequence[int] | np.ndarray, num_layers: int, k: int, num_experts: int) -> "PackedRoutes":
        """Allocate the final contiguous buffer for ``seq_lens`` rows; fill ``seq(b)`` in place, then ``validate()``."""
        seq_lens = exact_ints(seq_lens, "seq_lens").reshape(-1)
        num_layers, k = exact_int(num_layers, "num_layers"), exact_int(k, "k")
        num_experts = exact_int(num_experts, "num_experts")
        if seq_lens.size and seq_lens.min() < 0:
            raise InputError(f"negative sequence length {int(seq_lens.min())}", field="seq_lens",
                             index=int(np.argmin(seq_lens)))
        if num_layers < 0 or k < 1:
            raise InputError(f"need num_layers >= 0 and k >= 1, got {num_layers}, {k}", field="shape")
        dt = id_dtype(num_experts)
        cu = np.zeros(seq_lens.size + 1, dtype=np.int64)
        np.cumsum(seq_lens, out=cu[1:])
        if cu[-1] >= 2 ** 31:
            raise InputError(f"total tokens {int(cu[-1])} exceed int32", field="seq_lens")
        T = int(cu[-1])
        buf, cu_view, val_view = _allocate(seq_lens.size, T, num_layers, k, dt, 0, 0)
        cu_view[:] = cu
        _write_header(buf, num_experts, num_layers, k, seq_lens.size, T, dt.itemsize, 0, val_view.nbytes)
        out = cls.__new__(cls)
        out.values, out.cu_seqlens, out.num_experts, out._buffer = val_view, cu_view, int(num_experts), buf
        return out

    @classmethod
    def from_sequences(cls, seqs: Iterable[np.ndarray], num_experts: int) -> "PackedRoutes":
        """Pack per-sequence ``[n_b, L, k]`` integer arrays (any int dtype) straight into the final buffer."""
        seqs = [np.asarray(s) for s in seqs]
        if not seqs:
            raise InputError("no sequences given", field="seqs")
        L, k = seqs[0].shape[1:] if seqs[0].ndim == 3 else (None, None)
        for b, s in enumerate(seqs):
            if s.ndim != 3:
                raise InputError(f"expected [tokens, layers, k], got shape {s.shape}", field="seqs", index=b)
            if s.shape[1:] != (L, k):
                raise InputError(f"layers/k {s.shape[1:]} differ from sequence 0's {(L, k)}",
                                 field="seqs", index=b)
            if s.dtype.kind not in "ui":
                raise InputError(f"expert ids must be integers, got dtype {s.dtype}", field="seqs", index=b)
        out = cls.empty([s.shape[0] for s in seqs], L, k, num_experts)
        for b, s in enumerate(seqs):
            if s.size and s.dtype.kind == "i" and int(s.min()) < 0:
                raise InputError(f"negative expert id {int(s.min())} in sequence {b}", field="seqs", index=b)
            if s.dtype.itemsize > out.values.itemsize:
                cls._check_ids(s, num_experts, seq=b)  # before narrowing, which could wrap a bad id
                np.copyto(out.seq(b), s, casting="unsafe")
            else:
                dst = out.seq(b)
                np.copyto(dst, s, casting="unsafe")
                cls._check_ids(dst, num_experts, seq=b)  # on the copy, while it is hot in cache
        return out

    @classmethod
    def from_vllm(cls, encoded: Sequence[str | bytes | np.ndarray], num_experts: int, *,
                  prompt_lens: Sequence[int] | None = None, response_lens: Sequence[int] | None = None,
                  prompt_start: int | Sequence[int] = 0, moe_layers: Sequence[int] | None = None) -> "PackedRoutes":
        """From vLLM's ``routed_experts``, one entry per choice (base64 str of ``.npy`` as the server sends it,
        raw ``.npy`` bytes, or the ndarray of ``CompletionOutput.routed_experts``): ``[n, L_total, k]``, any
        integer dtype (vLLM: uint8 for E <= 256, else uint16); see :mod:`.vllm_wire`.

        ``moe_layers``: the hidden-layer indices that route (strictly increasing); only those are kept, in
        order, so ``L = len(moe_layers)`` as the replay convention wants. vLLM indexes all hidden layers and
        leaves the others at 0, so a dropped layer holding a non-zero id is refused (wrong ``moe_layers``).
        ``None`` keeps every layer (right only when every layer is MoE).
        ``prompt_lens`` + ``response_lens`` (together): each choice must have exactly
        ``prompt_len + response_len - 1 - prompt_start`` rows. ``prompt_start`` (vLLM's
        ``routed_experts_prompt_start``, int or per choice) must be 0: the rows before it are not sent and
        a PackedRoutes covers every position from 0, so ``> 0`` is refused (no padding with made-up
        routes); build such multi-turn deltas with :func:`decode_vllm_routes` + ``RouteTrace.add(delta, start)``.
        Every malformed entry (base64, ``.npy`` header or size, dtype, ndim, shape, row count, id outside
        ``[0, E)``) is an InputError naming the choice (``row``) and position (``index``). No pickle."""
        from .vllm_wire import routes_from_vllm

        return routes_from_vllm(encoded, num_experts, prompt_lens=prompt_lens, response_lens=response_lens,
                                prompt_start=prompt_start, moe_layers=moe_layers)

    def to_vllm(self, b: int, *, num_hidden_layers: int | None = None,
                moe_layers: Sequence[int] | None = None) -> str:
        """Sequence ``b`` as vLLM sends ``routed_experts`` (the string ``numpy2base64`` gives for the same
        array; ids keep :func:`id_dtype`, vLLM's for E <= 65536). With ``moe_layers`` the rows go back to
        those indices of ``num_hidden_layers`` layers, the others 0, as vLLM captures them."""
        from .vllm_wire import routes_to_vllm

        return routes_to_vllm(self, b, num_hidden_layers, moe_layers)

    @classmethod
    def concat(cls, parts: Sequence["PackedRoutes"]) -> "PackedRoutes":
        """Batch several PackedRoutes (same L, k, E) into one, sequences in order."""
        if not parts:
            raise InputError("nothing to concatenate", field="parts")
        E, L, k = parts[0].num_experts, parts[0].num_layers, parts[0].k
        for i, p in enumerate(parts):
            if (p.num_experts, p.num_layers, p.k) != (E, L, k):
                raise InputError(f"(E, L, k)={(p.num_experts, p.num_layers, p.k)} differs from part 0's {(E, L, k)}",
                                 field="parts", index=i)
        out = cls.empty(np.concatenate([p.seq_lens for p in parts]), L, k, E)
        row = 0
        for p in parts:
            out.values[row:row + p.num_tokens] = p.values
            row += p.num_tokens
        return out

    # ---- properties / views -------------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.size - 1

    @property
    def num_tokens(self) -> int:
        return self.values.shape[0]

    @property
    def num_layers(self) -> int:
        return self.values.shape[1]

    @property
    def k(self) -> int:
        return self.values.shape[2]

    @property
    def seq_lens(self) -> np.ndarray:
        """Route rows per sequence (int64)."""
        return np.diff(self.cu_seqlens.astype(np.int64))

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.cu_seqlens.nbytes

    def __len__(self) -> int:
        return self.num_seqs

    def seq(self, b: int) -> np.ndarray:
        """View (no copy) of sequence ``b``'s routes, shape ``[n_b, L, k]``."""
        b = exact_int(b, "seq")
        if not -self.num_seqs <= b < self.num_seqs:
            raise InputError(f"sequence {b} out of range for {self.num_seqs} sequences", field="seq", index=b)
        b %= self.num_seqs
        return self.values[self.cu_seqlens[b]:self.cu_seqlens[b + 1]]

    __getitem__ = seq

    def torch_values(self):
        """``values`` as a torch tensor sharing memory (read-only buffers: do not write to it)."""
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # non-writable numpy arrays (Ray buffers)
            return torch.from_numpy(self.values)

    def validate(self) -> "PackedRoutes":
        """Check shapes, cu_seqlens (0-based, non-decreasing, ends at T) and ids < num_experts."""
        if self.values.ndim != 3:
            raise InputError(f"expected shape [tokens, layers, k], got {self.values.shape}", field="values")
        if self.values.shape[2] < 1:
            raise InputError("k must be >= 1", field="values")
        _check_cu_seqlens(self.cu_seqlens, self.num_tokens)
        self._check_ids(self.values, self.num_experts)
        return self

    def __eq__(self, other) -> bool:
        return (isinstance(other, PackedRoutes) and self.num_experts == other.num_experts
                and np.array_equal(self.cu_seqlens, other.cu_seqlens)
                and self.values.shape == other.values.shape and np.array_equal(self.values, other.values))

    def __repr__(self) -> str:
        return (f"PackedRoutes(seqs={self.num_seqs}, tokens={self.num_tokens}, layers={self.num_layers}, "
                f"k={self.k}, experts={self.num_experts}, dtype={self.values.dtype}, bytes={self.nbytes})")

    # ---- arrays (safetensors) -----------------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """``{"values", "cu_seqlens", "num_experts", "version", "digest"}`` (the last three int64 /
        uint64 shape [1]; ``digest`` is xxh3-64 of version, E, dtypes, shapes and both arrays);
        no copies of the arrays."""
        return {"values": self.values, "cu_seqlens": self.cu_seqlens,
                "num_experts": np.array([self.num_experts], dtype=np.int64),
                "version": np.array([ARRAYS_VERSION], dtype=np.int64),
                "digest": np.array([_arrays_digest(self.values, self.cu_seqlens, self.num_experts)], dtype=np.uint64)}

    @classmethod
    def from_arrays(cls, d: dict[str, np.ndarray]) -> "PackedRoutes":
        """Inverse of :meth:`to_arrays`: exact dtypes (``values`` = E's id dtype, ``cu_seqlens`` int32),
        no unknown keys; ``version`` and ``digest`` checked when present (both or neither)."""
        known = ("values", "cu_seqlens", "num_experts", "version", "digest")
        for key in d:
            if key not in known:
                raise InputError(f"unknown array {key!r}", field=key)
        for key in ("values", "cu_seqlens", "num_experts"):
            if key not in d:
                raise InputError(f"missing array '{key}'", field=key)
        E = int_scalar(d["num_experts"], "num_experts", 1, (1 << 32) - 1)
        values, cu = np.asarray(d["values"]), np.asarray(d["cu_seqlens"])
        if values.dtype != id_dtype(E):
            raise InputError(f"dtype {values.dtype}, expected {id_dtype(E)} for {E} experts", field="values")
        if cu.dtype != np.int32:
            raise InputError(f"dtype {cu.dtype}, expected int32", field="cu_seqlens")
        check_arrays_digest(d, ARRAYS_VERSION,
                            (lambda: _arrays_digest(values, cu, E)) if values.ndim == 3 else None)
        return cls(values, cu, E)

    # ---- buffer -------------------------------------------------------------------------------------
    def to_buffer(self, *, bitpack: bool = False) -> np.ndarray:
        """One contiguous uint8 array (header + cu_seqlens + values). Returns the backing buffer itself
        (no copy) when the routes already live in one, e.g. after :meth:`empty`/:meth:`from_buffer`."""
        if not bitpack and self._buffer is not None:
            buf = self._buffer
            if buf.flags.writeable:            # values may have been written in place since
                _seal(buf)
            return buf
        dt = self.values.dtype
        bits = bits_for(self.num_experts) if bitpack else 0
        nvals = self.values.size
        vbytes = packed_nbytes(nvals, bits) if bitpack else self.values.nbytes
        buf, cu_view, val_view = _allocate(self.num_seqs, self.num_tokens, self.num_layers, self.k, dt, bits, vbytes)
        cu_view[:] = self.cu_seqlens
        if bitpack:
            val_view[:] = pack_bits(self.values, bits)
        else:
            val_view[...] = self.values
        _write_header(buf, self.num_experts, self.num_layers, self.k, self.num_seqs, self.num_tokens, dt.itemsize,
                      bits, vbytes)
        _seal(buf)
        if not bitpack:
            self.values, self.cu_seqlens, self._buffer = val_view, cu_view, buf
        return buf

    def to_bytes(self, *, bitpack: bool = False) -> bytes:
        return self.to_buffer(bitpack=bitpack).tobytes()

    @classmethod
    def from_buffer(cls, buf, *, validate: bool = True) -> "PackedRoutes":
        """Views on ``buf`` (bytes, bytearray, memoryview, uint8 ndarray): zero-copy unless bit-packed.

        The header fields, the buffer length and the digest are always checked; ``validate``
        adds the value checks (cu_seqlens monotone, ids < E)."""
        try:
            arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
        except (TypeError, ValueError) as e:
            raise InputError(f"not a byte buffer ({type(buf).__name__}: {e})", field="buffer") from None
        if arr.dtype != np.uint8:
            arr = arr.view(np.uint8)
        if arr.size < HEADER_BYTES:
            raise InputError(f"buffer has {arr.size} bytes, header needs {HEADER_BYTES}", field="buffer")
        magic, version, flags, itemsize, bits, pad, E, L, k, B, T, vbytes, dg = _HEADER.unpack_from(arr[:HEADER_BYTES])
        if magic != MAGIC:
            raise InputError(f"bad magic {magic!r}, expected {MAGIC!r}", field="buffer")
        if version != VERSION:
            raise InputError(f"unsupported version {version}, expected {VERSION}", field="version")
        if flags & ~FLAG_BITPACKED:
            raise InputError(f"unknown flags {flags:#x}", field="flags")
        if pad != 0 or any(arr[_HEADER.size:HEADER_BYTES]):
            raise InputError("reserved header bytes are not zero", field="buffer")
        if E < 1:
            raise InputError(f"num_experts {E} < 1", field="num_experts")
        dt = id_dtype(E)
        if itemsize != dt.itemsize:
            raise InputError(f"id itemsize {itemsize} does not match {E} experts ({dt})", field="itemsize")
        bitpacked = bool(flags & FLAG_BITPACKED)
        want_bits = bits_for(E) if bitpacked else 0
        if bits != want_bits:
            raise InputError(f"bit width {bits}, expected {want_bits} for {E} experts "
                             f"({'ceil(log2 E)' if bitpacked else 'not bit-packed'})", field="bits")
        if k < 1:
            raise InputError(f"k = {k}, expected >= 1", field="k")
        if B + 1 > _MAX_ELEMS or T >= 2 ** 31 or T * L * k > _MAX_ELEMS:
            raise InputError(f"absurd sizes in header: {B} seqs, {T} tokens, {L} layers, k={k}", field="buffer")
        cu_off = HEADER_BYTES
        v_off = _align(cu_off + 4 * (B + 1))
        expect_v = packed_nbytes(T * L * k, bits) if bitpacked else T * L * k * itemsize
        if vbytes != expect_v or arr.size != v_off + vbytes:
            raise InputError(f"buffer of {arr.size} bytes is truncated or inconsistent: header says {B} seqs, "
                             f"{T} tokens, {L} layers, k={k}, {vbytes} value bytes", field="buffer")
        if _buffer_digest(arr) != dg:
            raise InputError("digest does not match header + payload (corrupt buffer)", field="digest")
        cu = arr[cu_off:cu_off + 4 * (B + 1)].view(np.int32)
        raw = arr[v_off:v_off + vbytes]
        if bitpacked:
            values = unpack_bits(raw, T * L * k, bits, dtype=dt).reshape(T, L, k)
        else:
            values = raw.view(dt).reshape(T, L, k)
        out = cls.__new__(cls)
        out.values, out.cu_seqlens, out.num_experts = values, cu, int(E)
        out._buffer = None if bitpacked else arr
        if validate:
            out.validate()
        return out

    @classmethod
    def from_bytes(cls, data, **kw) -> "PackedRoutes":
        return cls.from_buffer(data, **kw)

    def __reduce__(self):
        # pickle protocol 5 (Ray) ships the uint8 buffer out of band: ray.get maps it without a copy.
        return (_from_buffer, (self.to_buffer(),))


def _from_buffer(buf) -> PackedRoutes:
    """Module-level (picklable by reference) constructor used by ``PackedRoutes.__reduce__``."""
    return PackedRoutes.from_buffer(buf)


def _allocate(B: int, T: int, L: int, k: int, dt: np.dtype, bits: int, vbytes: int):
    cu_off = HEADER_BYTES
    v_off = _align(cu_off + 4 * (B + 1))
    if not bits:
        vbytes = T * L * k * dt.itemsize
    buf = np.empty(v_off + vbytes, dtype=np.uint8)
    buf[:v_off] = 0
    cu = buf[cu_off:cu_off + 4 * (B + 1)].view(np.int32)
    raw = buf[v_off:v_off + vbytes]
    vals = raw if bits else raw.view(dt).reshape(T, L, k)
    return buf, cu, vals


def _write_header(buf, E, L, k, B, T, itemsize, bits, vbytes):
    flags = FLAG_BITPACKED if bits else 0
    _HEADER.pack_into(buf, 0, MAGIC, VERSION, flags, itemsize, bits, 0, E, L, k, B, T, vbytes, 0)


def _seal(buf: np.ndarray) -> None:
    """Write the digest of header + payload into the header."""
    struct.pack_into("<Q", buf, _DIGEST_AT, 0)
    struct.pack_into("<Q", buf, _DIGEST_AT, _buffer_digest(buf))
