"""Per-element ops on CPU with every element's bits independent of the tensor's size and the
thread count (:func:`elementwise`)."""
from __future__ import annotations

import torch

from ._util import pad_last as _pad_last

VEC_ELEMS = 64       # a multiple of every ATen vector loop step (2 vectors: 32 fp32 / 64 bf16 on AVX-512)
PIECE = 32768        # torch's GRAIN_SIZE: an elementwise call on at most this many elements is one thread


def elementwise(fn, x: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
    """``fn(x, *more)`` for a per-element ``fn`` (sigmoid, silu, gelu, a backward of two
    inputs), with every element computed by ATen's vectorized loop. ATen runs the last
    ``n % (2 · vector width)`` elements of a contiguous loop — and of each thread's chunk —
    through a scalar version of the op, and for sigmoid, silu, gelu and softplus (and bf16
    rsqrt) that version rounds differently (measured here: ~4 % of fp32 sigmoid/silu elements
    differ by an ulp; the same on AVX2 and AVX-512), so an element's bits would depend on the
    size of the tensor it sits in (a router's ``[T, E]`` scores with E = 8 and T odd) and on the
    thread count. Here the inputs (broadcast to one shape) are flattened and cut into pieces of
    ``PIECE`` elements (one thread each), the last zero-padded to a multiple of ``VEC_ELEMS``:
    the same vector code for every element, whatever the shape."""
    xs = (x, *more)
    if more:
        xs = torch.broadcast_tensors(*xs)
    shape, n = xs[0].shape, xs[0].numel()
    if n <= PIECE and n % VEC_ELEMS == 0 and all(t.is_contiguous() for t in xs):
        return fn(*xs)
    padded = -(-n // VEC_ELEMS) * VEC_ELEMS
    flats = [_pad_last(t.reshape(-1), padded) for t in xs]
    if padded <= PIECE:
        out = fn(*(f.contiguous() for f in flats))
    else:
        out = torch.cat([fn(*(f[lo:lo + PIECE].contiguous() for f in flats))
                         for lo in range(0, padded, PIECE)])
    return out[:n].view(shape)
