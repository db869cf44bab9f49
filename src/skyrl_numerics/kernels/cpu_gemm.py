"""Batch-invariant GEMMs on CPU (no Triton): stock torch (MKL) GEMMs arranged so that a row's
bits never depend on the batch.

Stock torch on CPU is NOT batch-invariant (measured here, torch 2.13 + MKL, 2 threads): rows of
an fp32 ``torch.mm`` with M <= 5 differ from the same rows inside a larger M (MKL takes a GEMV /
small-M kernel). What this module does instead:

  * matmul: every GEMM runs as row blocks of exactly ``ROW_BLOCK`` (16) rows — M padded up to a
    multiple — and every block is one fp32 MKL GEMM of the same shape (ROW_BLOCK, K) x (K, N),
    on ONE thread, with both operands contiguous and 64-byte aligned. A row's bits then depend
    only on (K, N) and its own values, never on M, on the row's position, on the number of
    threads or on how the blocks are batched into calls. (Two weaker schemes fail on this
    machine's MKL, measured: "pad M to >= 16, one GEMM" gives other bits from M ~ 200 rows on
    when K >= 1024 even on one thread — Thinking Machines' test, fp32 M = 1 vs 2048 with
    K = N = 4096, failed —, and a multi-threaded batched GEMM changes a block's bits with the
    number of blocks.) Parallelism comes from splitting the blocks over a small thread pool
    (:mod:`.pool`), each worker running single-threaded GEMMs; bits are the same for any split
    (tested). N below ``MIN_ROWS`` (16) is padded too: MKL takes GEMV-like kernels for a skinny
    side. bf16/fp16 are computed in fp32 (exact products) and rounded once, like the Triton
    kernels. The calls go to ``baddbmm_``'s stock CPU kernel, taken before the mode overrides
    that op too, so this serves as the override of the whole matmul family without recursing.
  * zero padding of the reduced dimension changes no bits either (a right-padded batch: the
    keys of a short sequence inside a longer batch, whose probabilities are 0): ``bmm`` cuts K
    into chunks of ``K_CHUNK`` (128) at fixed positions, each chunk one GEMM of exactly that
    depth (zero-padded), and folds the chunk products left to right (measured on this MKL: a
    GEMM of depth K <= 192 accumulates in k order, so trailing zeros are exact no-ops, while
    from ~193 (AVX2) / ~305 (AVX-512) on the K-blocking moves with K and 45 % of zero-extended
    products change bits). ``matmul_2d`` (weights: K is a model dimension) does not chunk.
  * two bfloat16 operands (a model's activations times its weights) go to
    :mod:`.cpu_gemm_bf16` instead: the weight read as stored (no float32 copy), one fixed-order
    dot product per output, the same bits on every CPU.

:func:`check_cpu_invariance` checks this machine's BLAS against the scheme.
"""
from __future__ import annotations

import threading

import torch

from ._util import compute_dtype as _compute_dtype
from .pool import pool

MIN_ROWS = 16          # smallest N (columns) a GEMM is given
ROW_BLOCK = 16         # rows per GEMM block (fixed: the bits of a row depend on it). 16, not 32:
                       # a decode step of 16 requests is one block, and an expert's few rows
                       # pad to less (same speed per row as 32 on large M up to K = 1024)
K_CHUNK = 128          # bmm depth per GEMM (module doc); below every MKL K-block measured (193+)
_ALIGN = 64            # bytes: operand base addresses MKL sees (its reproducibility condition)
_PAR_MIN_FLOPS = 1 << 22   # below this a call stays on the calling thread (pool overhead ~50 us)

_GEMM_LOCK = threading.Lock()


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % _ALIGN == 0


def prepare_b(b: torch.Tensor) -> torch.Tensor:
    """``b (K, N)`` as every GEMM here takes it: compute dtype, contiguous, 64-byte aligned, N
    padded to a multiple of ``MIN_ROWS`` (so stacked copies keep every matrix aligned too). Idempotent (a prepared operand is returned as is), so a weight can be
    prepared once and reused: the bits are the same as preparing it on every call."""
    cd = _compute_dtype(b)
    K, N = b.shape
    if b.dtype == cd and N % MIN_ROWS == 0 and N > 0 and _aligned(b):
        return b
    Np = -(-max(N, 1) // MIN_ROWS) * MIN_ROWS
    out = torch.empty((K, Np), dtype=cd) if Np == N else torch.zeros((K, Np), dtype=cd)
    out[:, :N] = b                                      # (converts to cd while copying)
    return out


def gemm_blocks(a: torch.Tensor, b: torch.Tensor, b_index: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``a (n, RB, K)`` contiguous (RB = ``ROW_BLOCK``), ``b (K, N)``
    prepared or ``(G, K, N)`` with block i using ``b[b_index[i]]`` -> ``(n, RB, N)`` (into
    ``out`` when given: contiguous fp32): one single-threaded GEMM per block."""
    n, rb = a.shape[0], a.shape[1]
    K, N = b.shape[-2], b.shape[-1]
    if b.dim() == 2:
        bb = b.expand(n, K, N)
    elif b_index is None:
        bb = b
    else:
        bb = b.index_select(0, b_index)
    if out is None:
        out = torch.empty((n, rb, N), dtype=a.dtype)
    # the thread count is process-wide: the lock keeps another Python thread's restore from
    # giving a GEMM in flight more than one thread (which would change its bits)
    with _GEMM_LOCK:
        _gemm_locked(out, a, bb, n, K, N)
    return out


def _gemm_locked(out, a, bb, n: int, K: int, N: int) -> None:
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        work = 2 * n * a.shape[1] * K * N
        if threads > 1 and n > 1 and work >= _PAR_MIN_FLOPS:
            parts = min(threads, n)
            bounds = [n * j // parts for j in range(parts + 1)]
            inference = torch.is_inference_mode_enabled()
            futs = [pool(parts).submit(_gemm_run_worker, out[lo:hi], a[lo:hi], bb[lo:hi], inference)
                    for lo, hi in zip(bounds[:-1], bounds[1:])]
            for f in futs:
                f.result()
        else:
            _gemm_run(out, a, bb)
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


# aten::baddbmm_'s stock CPU kernel (MKL), taken at import, before batch_invariant_mode can
# override the op (it routes baddbmm_ too): every block GEMM here is one call of it, at the CPU
# key (the operands are this module's own buffers: nothing for autograd to record)
_STOCK_BADDBMM_ = torch.library.get_kernel("aten::baddbmm_", "CPU")
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _gemm_run(out, a, b) -> None:
    _STOCK_BADDBMM_.call_boxed(_CPU_KEYS, out, a, b, beta=0)


def _gemm_run_worker(out, a, b, inference: bool) -> None:
    # a pool thread has its own OpenMP thread count (the caller's set_num_threads(1) does not
    # reach it): without this MKL runs the block multi-threaded there and the bits change; and
    # its own inference mode (tensors made under the caller's inference_mode need it to be
    # written in place)
    torch.set_num_threads(1)
    with torch.inference_mode(inference), torch.no_grad():
        _gemm_run(out, a, b)


def row_blocks(a: torch.Tensor, rb: int = ROW_BLOCK) -> tuple[torch.Tensor, int]:
    """(..., M, K) -> (blocks, rb, K) in the compute dtype, zero-padded to whole blocks (a
    fresh, aligned buffer), and the number of blocks per matrix."""
    M, K = a.shape[-2], a.shape[-1]
    nb = max(1, -(-M // rb))
    lead = a.shape[:-2]
    cd = _compute_dtype(a)
    if nb * rb == M:
        buf = torch.empty((*lead, M, K), dtype=cd)
    else:
        buf = torch.zeros((*lead, nb * rb, K), dtype=cd)
    buf[..., :M, :] = a                                 # (converts to cd while copying)
    return buf.view(lead.numel() * nb, rb, K), nb


def matmul_2d(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) (+ bias) with a per-row result independent of M (row blocks of
    ``ROW_BLOCK``, one single-threaded GEMM each; see the module doc). ``b`` may be given
    prepared (:func:`prepare_b`). Both bfloat16: :func:`.cpu_gemm_bf16.linear` of ``b.T``."""
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        from . import cpu_gemm_bf16

        return cpu_gemm_bf16.linear(a, b.t(), bias, out_dtype)
    out_dtype = out_dtype or a.dtype
    cd = _compute_dtype(a)
    M, N = a.shape[0], b.shape[1]
    if M == 0 or N == 0 or a.shape[1] == 0:    # empty product (e.g. an expert without tokens)
        out = torch.zeros((M, N), dtype=cd)
        return (out if bias is None else out + bias.to(cd)).to(out_dtype)
    blocks, _ = row_blocks(a)
    bp = prepare_b(b)
    out = gemm_blocks(blocks, bp).view(-1, bp.shape[1])[:M, :N]
    if bias is not None:
        out = out + bias.to(cd)
    return out.to(out_dtype)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(..., K) @ (K, N)."""
    lead = a.shape[:-1]
    out = matmul_2d(a.reshape(lead.numel(), a.shape[-1]), b, bias)
    return out.reshape(*lead, b.shape[1])


def bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a (B, M, K) @ b (B, K, N): each matrix's rows in blocks of ``ROW_BLOCK`` (as
    :func:`matmul_2d`), all blocks of all matrices in one batched call of single-threaded GEMMs,
    so a row's bits depend neither on M nor on B; K beyond ``K_CHUNK`` in chunks of exactly
    ``K_CHUNK`` folded left to right, so zero padding of K changes no bits (module doc)."""
    cd = _compute_dtype(a)
    B, M, K = a.shape
    N = b.shape[2]
    if 0 in (B, M, K, N):
        return torch.zeros((B, M, N), dtype=cd).to(out_dtype or a.dtype)
    if K <= K_CHUNK:
        out = _bmm_blocks(a, b, cd)
    else:
        out = None
        for lo in range(0, K, K_CHUNK):
            hi = min(K, lo + K_CHUNK)
            ac, bc = a[:, :, lo:hi], b[:, lo:hi]
            if hi - lo < K_CHUNK:                  # the last chunk at the full depth, zero-padded
                ac = torch.nn.functional.pad(ac.to(cd), (0, K_CHUNK - (hi - lo)))
                bc = torch.nn.functional.pad(bc.to(cd), (0, 0, 0, K_CHUNK - (hi - lo)))
            part = _bmm_blocks(ac, bc, cd)
            out = part if out is None else out.add_(part)
    return out.to(out_dtype or a.dtype)


def _bmm_blocks(a: torch.Tensor, b: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """:func:`bmm` of one depth (no K chunks) in the compute dtype."""
    B, M, K = a.shape
    N = b.shape[2]
    blocks, nb = row_blocks(a)
    Np = -(-max(N, MIN_ROWS) // MIN_ROWS) * MIN_ROWS   # each matrix starts 64-byte aligned
    bp = torch.empty((B, K, Np), dtype=cd) if Np == N else torch.zeros((B, K, Np), dtype=cd)
    bp[:, :, :N] = b                                   # (converts to cd while copying)
    if B == 1:
        out = gemm_blocks(blocks, bp[0])
    elif nb == 1:
        out = gemm_blocks(blocks, bp)
    else:                        # (no per-block copy of the matrices: each call reads them in place)
        by = blocks.view(B, nb, ROW_BLOCK, K)
        out = torch.empty((B, nb, ROW_BLOCK, Np), dtype=cd)
        if B <= nb:
            for i in range(B):
                gemm_blocks(by[i], bp[i], out=out[i])
        else:
            for j in range(nb):
                out[:, j] = gemm_blocks(by[:, j].contiguous(), bp)
    return out.view(B, nb * ROW_BLOCK, Np)[:, :M, :N]


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e]:offsets[e+1] of x times w[e] (K, N), one invariant GEMM per expert."""
    out = torch.zeros((x.shape[0], w.shape[2]), dtype=x.dtype)
    offs = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = matmul_2d(x[lo:hi], w[e])
    return out


def check_cpu_invariance(shapes=((64, 256, 256), (64, 1024, 128), (260, 1024, 256)),
                         dtype=torch.float32, seed: int = 0) -> bool:
    """True when this machine's BLAS gives :func:`matmul_2d` rows independent of M (M in 1..M),
    on the current thread count and on one thread."""
    g = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    try:
        for M, K, N in shapes:
            a = torch.randn(M, K, generator=g).to(dtype)
            b = torch.randn(K, N, generator=g).to(dtype)
            full = matmul_2d(a, b)
            for m in (1, 2, 3, 5, 8, 15, 17, 31, 33, M // 2, M - 1):
                if not torch.equal(matmul_2d(a[:m], b), full[:m]):
                    return False
            torch.set_num_threads(1)
            one = matmul_2d(a, b)
            torch.set_num_threads(threads)
            if not torch.equal(one, full):
                return False
    finally:
        torch.set_num_threads(threads)
    return True
