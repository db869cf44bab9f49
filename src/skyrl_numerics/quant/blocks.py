"""Block views shared by the recipes.

Every recipe sees its input as a 2-D matrix ``[R, C]`` (``C`` = last dim, ``R`` = product of the
others) cut into ``br x bc`` blocks, as the 4-D view ``[R/br, br, C/bc, bc]``. A block amax is then
``amax(|x|, dims=(1, 3))`` and a per-block scale of shape ``[R/br, 1, C/bc, 1]`` broadcasts onto the
view. Shapes that do not divide are zero-padded (zeros do not change an amax; vLLM and DeepGEMM
pad the same way) and cropped afterwards. ``-1`` in a block shape means "the whole axis".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from skyrl_numerics.errors import InputError


def resolve_block(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int, int, int]:
    """-> (R, C, br, bc) for an input of ``shape`` and a block spec with -1 = whole axis."""
    if len(shape) == 0:
        raise InputError("cannot quantize a 0-d tensor; reshape to at least 1-D", field="x")
    C = int(shape[-1])
    R = 1
    for d in shape[:-1]:
        R *= int(d)
    br, bc = block
    br = R if br == -1 else int(br)
    bc = C if bc == -1 else int(bc)
    if br <= 0 or bc <= 0:
        raise InputError(f"block sizes must be positive, got {block}", field="block")
    return R, C, max(br, 1), max(bc, 1)


def to_blocks(x: torch.Tensor, block: tuple[int, int], dtype=torch.float32) -> tuple[torch.Tensor, tuple]:
    """``x`` -> zero-padded 4-D block view in ``dtype`` and the info needed to undo it."""
    R, C, br, bc = resolve_block(x.shape, block)
    x2 = x.reshape(R, C).to(dtype)
    pr, pc = (-R) % br, (-C) % bc
    if pr or pc:
        x2 = F.pad(x2, (0, pc, 0, pr))
    Rp, Cp = R + pr, C + pc
    return x2.view(Rp // br, br, Cp // bc, bc), (tuple(x.shape), R, C, br, bc)


def from_blocks(xb: torch.Tensor, info: tuple) -> torch.Tensor:
    """Inverse of :func:`to_blocks` (crops the padding, restores the shape)."""
    shape, R, C, _, _ = info
    nR, br, nC, bc = xb.shape
    return xb.reshape(nR * br, nC * bc)[:R, :C].reshape(shape)


def block_amax(xb: torch.Tensor) -> torch.Tensor:
    """amax(|x|) per block, NaN-propagating, shape ``[nR, 1, nC, 1]``."""
    return xb.abs().amax(dim=(1, 3), keepdim=True)


def codes_to_blocks(codes: torch.Tensor, info: tuple, fill: int = 0) -> torch.Tensor:
    """Element codes in the original shape -> the padded 4-D block view (padding = code ``fill``)."""
    shape, R, C, br, bc = info
    c2 = codes.reshape(R, C)
    pr, pc = (-R) % br, (-C) % bc
    if pr or pc:
        c2 = F.pad(c2, (0, pc, 0, pr), value=fill)
    return c2.view((R + pr) // br, br, (C + pc) // bc, bc)


def block_amax_fused(xb: torch.Tensor) -> torch.Tensor:
    """:func:`block_amax` (same values, NaN-propagating) for the fused paths: 1-row blocks by a
    max-pool over each block (a reduction over a short inner dim is ~3x slower on CPU)."""
    nR, br, nC, bc = xb.shape
    if br != 1 or bc == 1:
        return block_amax(xb)
    return F.max_pool1d(xb.abs().view(nR, 1, nC * bc), bc, bc).view(nR, 1, nC, 1)


#: elements per chunk of the fused fake-quant paths (16 MiB float32 buffers). Fewer, larger ops:
#: under CPU contention each parallel region of a 2-thread pool can stall on a descheduled
#: thread, and 256K-element chunks (in L2) measured 4-40x slower than 4M ones on a loaded host.
FUSED_CHUNK = 1 << 22


def fused_apply(x: torch.Tensor, block: tuple[int, int], fn, dtype=torch.float32,
                chunk: int | None = None) -> torch.Tensor | None:
    """``fn(xb) -> yb`` over chunks of whole block-rows of ``x``'s ``[R, C]`` view, where ``xb`` is
    the chunk's 4-D block view ``[nR, br, nC, bc]`` as a fresh ``dtype`` copy (``fn`` may work in
    place on it); the results are cast back to ``x.dtype`` into one output. ``None`` when the
    shape does not divide into blocks (the caller then runs the reference, which pads)."""
    if x.numel() == 0 or x.dim() == 0:
        return None
    R, C, br, bc = resolve_block(x.shape, block)
    if C % bc or R % br:
        return None
    x2 = x.reshape(R, C)
    chunk = chunk or FUSED_CHUNK
    out = torch.empty((R, C), dtype=x.dtype, device=x.device)
    rows = max(br, chunk // max(C, 1) // br * br)
    buf = torch.empty((min(rows, R), C), dtype=dtype, device=x.device)
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        xb = buf[:r1 - r0]
        xb.copy_(x2[r0:r1])
        yb = fn(xb.view((r1 - r0) // br, br, C // bc, bc))
        out[r0:r1].copy_(yb.reshape(r1 - r0, C))
    return out.reshape(x.shape)
