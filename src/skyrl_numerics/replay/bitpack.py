"""Bit-packing of small unsigned integers (expert ids) to ``b`` bits per value.

Expert ids lie in ``[0, E)``, so ``b = ceil(log2 E)`` bits hold one id (``b >= 1``). Value ``i`` occupies
bits ``[i*b, (i+1)*b)`` of the little-endian bit stream, least significant bit first; the stream is cut
into bytes with ``np.packbits(..., bitorder="little")`` so byte ``j`` holds stream bits ``[8j, 8j+8)``.
``packed_nbytes(n, b) = ceil(n*b / 8)``.

Packing costs one pass that expands each value to ``b`` bit-bytes (processed in chunks to bound the
temporary), so it is for storage/transfer where the ``8/b``-fold (uint8 ids) size cut matters; the unpacked
form is what replay indexes.
"""
from __future__ import annotations

import math

import numpy as np

from skyrl_numerics.errors import InputError

_CHUNK = 1 << 20  # values per chunk: bounds the bit-matrix temporary to b MiB


def bits_for(num_experts: int) -> int:
    """Bits needed for ids in ``[0, num_experts)``: ``max(1, ceil(log2 num_experts))``."""
    if num_experts < 1:
        raise InputError(f"num_experts must be >= 1, got {num_experts}", field="num_experts")
    return max(1, math.ceil(math.log2(num_experts)))


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of a stream of ``n`` values at ``bits`` bits each: ``ceil(n*bits/8)``."""
    return (n * bits + 7) // 8


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack the flat unsigned ``values`` into a uint8 stream at ``bits`` bits per value.

    Raises InputError if a value needs more than ``bits`` bits.
    """
    if not 1 <= bits <= 32:
        raise InputError(f"bits must be in [1, 32], got {bits}", field="bits")
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.dtype.kind != "u":
        raise InputError(f"values must be unsigned integers, got dtype {flat.dtype}", field="values")
    if flat.size and bits < 8 * flat.dtype.itemsize:
        vmax = int(flat.max())
        if vmax >> bits:
            idx = int(np.argmax(flat >> np.array(bits, dtype=flat.dtype) != 0))
            raise InputError(f"value {vmax} does not fit in {bits} bits", field="values", index=idx)
    out = np.empty(packed_nbytes(flat.size, bits), dtype=np.uint8)
    shifts = np.arange(bits, dtype=np.uint32)
    # chunk boundaries on multiples of 8 values keep every chunk byte-aligned in the stream
    step = _CHUNK - _CHUNK % 8
    for lo in range(0, flat.size, step):
        chunk = flat[lo:lo + step].astype(np.uint32, copy=False)
        bitmat = ((chunk[:, None] >> shifts) & 1).astype(np.uint8)
        packed = np.packbits(bitmat.reshape(-1), bitorder="little")
        start = lo * bits // 8
        out[start:start + packed.size] = packed
    return out


def unpack_bits(stream: np.ndarray, n: int, bits: int, dtype=np.uint32) -> np.ndarray:
    """Inverse of :func:`pack_bits`: the first ``n`` values of ``stream`` as ``dtype`` (flat)."""
    stream = np.asarray(stream, dtype=np.uint8).reshape(-1)
    need = packed_nbytes(n, bits)
    if stream.size < need:
        raise InputError(f"bit stream has {stream.size} bytes, {n} values at {bits} bits need {need}",
                         field="values")
    out = np.empty(n, dtype=dtype)
    weights = (np.uint64(1) << np.arange(bits, dtype=np.uint64))
    step = _CHUNK - _CHUNK % 8
    for lo in range(0, n, step):
        m = min(step, n - lo)
        start = lo * bits // 8
        bitvec = np.unpackbits(stream[start:start + packed_nbytes(m, bits)], count=m * bits,
                               bitorder="little")
        out[lo:lo + m] = bitvec.reshape(m, bits).astype(np.uint64) @ weights
    return out
