"""Batch-invariant CPU path (no Triton), fast enough for real use: stock torch ops, and fused
C kernels for attention and RMSNorm (:mod:`.cpu_attention`, :mod:`.cpu_norm`, built by
:mod:`.native`).

Stock torch on CPU is NOT batch-invariant (measured here, torch 2.13 + MKL, 2 threads):
  * fp32 ``torch.mm``: rows of an M<=5 product differ from the same rows inside a larger M
    (MKL takes a GEMV / small-M kernel);
  * ``x.mean(-1)`` / ``x.sum(-1)`` over rows longer than 32768 differ between M=1 and M>1
    (one row is split across threads; several rows are not).
What this module does instead:
  * matmul: every GEMM runs as row blocks of exactly ``ROW_BLOCK`` (16) rows — M padded up to a
    multiple — and every block is one fp32 MKL GEMM of the same shape (ROW_BLOCK, K) x (K, N),
    on ONE thread, with both operands contiguous and 64-byte aligned. A row's bits then depend
    only on (K, N) and its own values, never on M, on the row's position, on the number of
    threads or on how the blocks are batched into calls. (Two weaker schemes fail on this
    machine's MKL, measured: "pad M to >= 16, one GEMM" gives other bits from M ~ 200 rows on
    when K >= 1024 even on one thread — Thinking Machines' test, fp32 M = 1 vs 2048 with
    K = N = 4096, failed —, and a multi-threaded batched GEMM changes a block's bits with the
    number of blocks.) Parallelism comes from splitting the blocks over a small thread pool, each
    worker running single-threaded GEMMs; bits are the same for any split (tested). N below
    ``MIN_ROWS`` (16) is padded too: MKL takes GEMV-like kernels for a skinny side. bf16/fp16
    are computed in fp32 (exact products) and rounded once, like the Triton kernels. The calls
    go through ``baddbmm`` (not ``mm``/``addmm``/``bmm``), so this can serve as the override of
    those ops without recursing.
  * zero padding of the reduced dimension changes no bits either (a right-padded batch: the
    keys of a short sequence inside a longer batch, whose probabilities are 0): ``bmm`` cuts K
    into chunks of ``K_CHUNK`` (128) at fixed positions, each chunk one GEMM of exactly that
    depth (zero-padded), and folds the chunk products left to right (measured on this MKL: a
    GEMM of depth K <= 192 accumulates in k order, so trailing zeros are exact no-ops, while
    from ~193 (AVX2) / ~305 (AVX-512) on the K-blocking moves with K and 45 % of zero-extended
    products change bits). ``matmul_2d`` (weights: K is a model dimension) does not chunk.
  * row sums (:func:`row_sum`): a pairwise tree of IEEE additions at fixed positions — within
    blocks of ``SUM_BLOCK`` (1024) elements by halving (``x[i] + x[i + h]``), then over the block
    sums the same way, each level zero-padded to a power of two. A row of n values followed by
    zeros reduces to the same bits as the n values alone (every extra addition adds +0), the
    order does not depend on the number of rows, threads or the CPU's vector width, and every
    operation is a correctly rounded add: the same bits on every ISA. (torch's ``sum`` lands an
    element in its vectorized body or its scalar tail by the row's length, so trailing zeros
    change its bits: measured in 30 % of padded softmax rows.)
  * attention and RMSNorm: every row computed on its own by a fixed sequence of binary32
    operations (:mod:`.cpu_attention`, :mod:`.cpu_norm` write them out), in C with a
    bitwise-equal torch specification.
Everything else used (exp, log, amax, + - * /) is per element or order-free and computes an
element's bits the same in ATen's vectorized body and its scalar tail (tested per ISA:
``tests/kernels/test_cpu_isa.py``); the ops whose tail rounds differently (sigmoid, silu, gelu,
softplus, their backwards; bf16 rsqrt) go through :func:`elementwise`.
"""
from __future__ import annotations

import threading

import torch

from .pool import parallel, pool

MIN_ROWS = 16          # smallest N (columns) a GEMM is given
ROW_BLOCK = 16         # rows per GEMM block (fixed: the bits of a row depend on it). 16, not 32:
                       # a decode step of 16 requests is one block, and an expert's few rows
                       # pad to less (same speed per row as 32 on large M up to K = 1024)
K_CHUNK = 128          # bmm depth per GEMM (module doc); below every MKL K-block measured (193+)
SUM_BLOCK = 1024       # row_sum's first-level block (a power of two)
_ALIGN = 64            # bytes: operand base addresses MKL sees (its reproducibility condition)
_PAR_MIN_FLOPS = 1 << 22   # below this a call stays on the calling thread (pool overhead ~50 us)

_GEMM_LOCK = threading.Lock()


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


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


def _gemm_blocks(a: torch.Tensor, b: torch.Tensor, b_index: torch.Tensor | None = None,
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


def _gemm_run(out, a, b) -> None:
    out.baddbmm_(a, b, beta=0)


def _gemm_run_worker(out, a, b, inference: bool) -> None:
    # a pool thread has its own OpenMP thread count (the caller's set_num_threads(1) does not
    # reach it): without this MKL runs the block multi-threaded there and the bits change; and
    # its own inference mode (tensors made under the caller's inference_mode need it to be
    # written in place)
    torch.set_num_threads(1)
    with torch.inference_mode(inference), torch.no_grad():
        _gemm_run(out, a, b)


def _row_blocks(a: torch.Tensor, rb: int = ROW_BLOCK) -> tuple[torch.Tensor, int]:
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
    prepared (:func:`prepare_b`)."""
    out_dtype = out_dtype or a.dtype
    cd = _compute_dtype(a)
    M, N = a.shape[0], b.shape[1]
    if M == 0 or N == 0 or a.shape[1] == 0:    # empty product (e.g. an expert without tokens)
        out = torch.zeros((M, N), dtype=cd)
        return (out if bias is None else out + bias.to(cd)).to(out_dtype)
    blocks, _ = _row_blocks(a)
    bp = prepare_b(b)
    out = _gemm_blocks(blocks, bp).view(-1, bp.shape[1])[:M, :N]
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
    blocks, nb = _row_blocks(a)
    Np = -(-max(N, MIN_ROWS) // MIN_ROWS) * MIN_ROWS   # each matrix starts 64-byte aligned
    bp = torch.empty((B, K, Np), dtype=cd) if Np == N else torch.zeros((B, K, Np), dtype=cd)
    bp[:, :, :N] = b                                   # (converts to cd while copying)
    if B == 1:
        out = _gemm_blocks(blocks, bp[0])
    elif nb == 1:
        out = _gemm_blocks(blocks, bp)
    else:                        # (no per-block copy of the matrices: each call reads them in place)
        by = blocks.view(B, nb, ROW_BLOCK, K)
        out = torch.empty((B, nb, ROW_BLOCK, Np), dtype=cd)
        if B <= nb:
            for i in range(B):
                _gemm_blocks(by[i], bp[i], out=out[i])
        else:
            for j in range(nb):
                out[:, j] = _gemm_blocks(by[:, j].contiguous(), bp)
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


def _halve_to_one(x: torch.Tensor) -> torch.Tensor:
    """(..., P) with P a power of two -> (...): ``x = x[..., :h] + x[..., h:]`` until one."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _pad_last(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[-1] == n else torch.nn.functional.pad(x, (0, n - x.shape[-1]))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_NATIVE_SUM_MIN = 4096    # elements below which the torch code is as fast as a C call


def _row_sum_native(lib, x: torch.Tensor) -> torch.Tensor:
    """:func:`row_sum` of float32 ``x`` by ``csrc/row_sum.c`` (the same operations), rows split
    over the CPU kernels' thread pool for large calls (a row is one thread's: no bits change)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1 or x2.stride(0) < N:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.float32)

    def run(lo: int, hi: int) -> None:
        if lib.skyrl_row_sum(x2.data_ptr(), x2.stride(0), N, out.data_ptr(), lo, hi) != 0:
            raise MemoryError("skyrl_row_sum: no memory for its block buffer")

    parallel(run, x2.shape[0], x2.numel())
    return out.view(x.shape[:-1])


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in fp32 (fp64 stays fp64; integers and bools sum exactly in int64):
    the pairwise tree of the module doc. Invariant to the number of rows and to trailing zeros;
    the same bits on every CPU ISA; a sum of zeros is +0. Large float32 inputs run the same
    operations in C (``csrc/row_sum.c``) when the kernels are built."""
    if x.is_complex():
        raise NotImplementedError("batch-invariant sum of a complex tensor")
    x = x.to(torch.int64 if not x.is_floating_point() else _compute_dtype(x))
    N = x.shape[-1]
    if N == 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype)
    if x.dtype == torch.float32 and x.numel() >= _NATIVE_SUM_MIN:
        from . import native

        lib = native.lib()
        if lib is not None:
            return _row_sum_native(lib, x)
    P = min(_pow2(N), SUM_BLOCK)
    nb = -(-N // P)
    blocks = _halve_to_one(_pad_last(x, nb * P).reshape(*x.shape[:-1], nb, P))
    total = _halve_to_one(_pad_last(blocks, _pow2(nb)))
    return total + 0 if total.is_floating_point() else total   # (+0: a -0 total is +0, as padded)


def reduce(x: torch.Tensor, dims, keepdim: bool, mean: bool, dtype=None) -> torch.Tensor:
    """sum/mean over ``dims`` (None or empty = all): kept dims first, reduced dims flattened
    last, then :func:`row_sum`. The result's dtype follows torch: ``dtype``, else int64 for an
    integer or bool input, else the input's."""
    if x.dim() == 0:
        x = x.reshape(1)
        dims, keepdim = None, False
    nd = x.dim()
    red = sorted({d % nd for d in dims}) if dims else list(range(nd))
    kept = [d for d in range(nd) if d not in red]
    xp = x.permute(*kept, *red)
    P = 1
    for d in kept:
        P *= x.shape[d]
    R = x.numel() // P if P else 0
    x2 = xp.reshape(P, R)
    out = row_sum(x2)
    if mean:
        out = out / R
    res_dtype = dtype or (x.dtype if x.is_floating_point() else torch.int64)
    out = out.to(res_dtype).reshape([x.shape[d] for d in kept])
    if keepdim:
        for d in red:
            out = out.unsqueeze(d)
    return out


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x - m - log(sum exp(x - m)) over the last dim."""
    xf = x.to(_compute_dtype(x))
    m = xf.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    s = row_sum((xf - m).exp().reshape(-1, xf.shape[-1])).reshape(m.shape)
    return (xf - m - s.log()).to(x.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """exp(x - m) / sum exp(x - m) over the last dim."""
    xf = x.to(_compute_dtype(x))
    m = xf.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = (xf - m).exp()
    s = row_sum(e.reshape(-1, xf.shape[-1])).reshape(m.shape)
    return (e / s).to(x.dtype)


def softmax_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dx = y * (g - sum(g * y))."""
    gf, yf = g.to(_compute_dtype(g)), y.to(_compute_dtype(y))
    dot = row_sum((gf * yf).reshape(-1, gf.shape[-1])).reshape(*gf.shape[:-1], 1)
    return (yf * (gf - dot)).to(y.dtype)


def log_softmax_backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dx = g - exp(y) * sum(g)."""
    gf, yf = g.to(_compute_dtype(g)), y.to(_compute_dtype(y))
    total = row_sum(gf.reshape(-1, gf.shape[-1])).reshape(*gf.shape[:-1], 1)
    return (gf - yf.exp() * total).to(y.dtype)


def token_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """-> (logprob, entropy, lse) float32; entropy = log s - sum e^(z-m) (z-m) / s."""
    V = logits.shape[-1]
    z = logits.reshape(-1, V).float() / temperature
    m = z.amax(-1, keepdim=True)
    d = z - m
    e = d.exp()
    s = row_sum(e)
    u = row_sum(e * d)
    log_s = s.log()
    lse = m.squeeze(-1) + log_s
    lp = z.gather(-1, targets.reshape(-1, 1).long()).squeeze(-1) - lse
    ent = log_s - u / s
    shape = logits.shape[:-1]
    return lp.reshape(shape), ent.reshape(shape), lse


def token_logprob_entropy_backward(logits, targets, lse, ent, g_lp, g_ent, temperature: float):
    V = logits.shape[-1]
    z = logits.reshape(-1, V).float() / temperature
    logp = z - lse.unsqueeze(-1)
    p = logp.exp()
    onehot = torch.zeros_like(z).scatter_(-1, targets.reshape(-1, 1).long(), 1.0)
    glp, gent = g_lp.reshape(-1, 1).float(), g_ent.reshape(-1, 1).float()
    dz = glp * (onehot - p) - gent * p * (logp + ent.reshape(-1, 1))
    return (dz / temperature).to(logits.dtype).reshape(logits.shape)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6):
    """-> (y, rstd float32 per row): the fused fixed-order kernel (:mod:`.cpu_norm`; its module
    doc writes the arithmetic out). ``w`` is ``(N,)`` or one weight row per row ``(M, N)``."""
    from .cpu_norm import rms_norm as fused

    return fused(x, w, eps)


def rms_norm_backward(g, x, w, rstd, rows_per_block: int = 256):
    """dx per row; dW: fp32 partial sums over fixed blocks of rows, folded in block order."""
    N = x.shape[-1]
    gf, xf, wf = g.reshape(-1, N).float(), x.reshape(-1, N).float(), w.float()
    r = rstd.unsqueeze(-1)
    gw = gf * wf
    c = row_sum(gw * xf).unsqueeze(-1) / N
    dx = (r * (gw - xf * r * r * c)).to(x.dtype).reshape(x.shape)
    contrib = (gf * xf) * r
    dw = torch.zeros(N, dtype=torch.float32)
    for start in range(0, contrib.shape[0], rows_per_block):
        dw = dw + contrib[start:start + rows_per_block].sum(0)
    return dx, dw.to(w.dtype)


def attention(q, k, v, causal: bool = True, scale: float | None = None, block_n: int = 64,
              kv_lens: torch.Tensor | None = None):
    """Causal (GQA) attention, one fused fixed-order kernel per row that the trainer and the
    engine share: :func:`skyrl_numerics.kernels.cpu_attention.attention` (its module doc writes
    the arithmetic out). Token-by-token decode over a KV cache equals full prefill bit for bit,
    and a right-padded batch (``kv_lens``) gives every sequence the bits it gets alone."""
    from .cpu_attention import attention as fused

    return fused(q, k, v, causal, scale, block_n, kv_lens)


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
