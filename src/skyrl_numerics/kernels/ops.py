"""Public op functions: input checks, backend choice, autograd. Triton is imported lazily.

Each op takes ``backend=`` (see ``_util``): ``"auto"`` runs the Triton kernels on CUDA tensors
and the batch-invariant CPU path (``cpu.py``) on CPU tensors.
Autograd: ``matmul`` (grads through the same invariant matmul; inside :func:`stock_backward`,
through torch's fp32 GEMM), ``log_softmax``,
``token_logprob_entropy`` and ``rms_norm`` (dW in a fixed row-block order).
"""
from __future__ import annotations

import contextlib

import torch

from skyrl_numerics.errors import InputError

from . import cpu, reference
from ._util import check_dtype_match, check_float, check_same, resolve_backend


def _tl(name: str):
    import importlib
    return importlib.import_module(f"skyrl_numerics.kernels.{name}")


# ---------------------------------------------------------------- matmul
_STOCK_BACKWARD = [False]      # set by stock_backward(); read when a matmul is recorded


@contextlib.contextmanager
def stock_backward():
    """Matmuls recorded for autograd inside take their two gradient GEMMs from torch's float32
    GEMM (MKL on CPU) instead of the fixed-order kernel, however late the backward runs.

    The forward is untouched, so its bits stay the engine's (Δ = 0 holds); only the gradients
    change: fp32 accumulation rounded once to the operand dtype still, but in MKL's order, so not
    batch-invariant and not guaranteed identical from run to run. For a trainer whose forward
    must equal its engine's and whose backward needs only to be accurate (the invariant
    trainer's ``invariant_backward="stock"``). Process-wide while open."""
    prev, _STOCK_BACKWARD[0] = _STOCK_BACKWARD[0], True
    try:
        yield
    finally:
        _STOCK_BACKWARD[0] = prev


def _stock_mm(a, b, dtype):
    return torch.mm(a.float(), b.float()).to(dtype)


def _matmul_impl(a, b, bias, be):
    if be == "triton":
        return _tl("tl_matmul").matmul(a, b, bias)
    if be == "cpu":
        return cpu.matmul_2d(a, b, bias)
    return reference.matmul(a, b, bias)


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, be):
        ctx.save_for_backward(a, b)
        ctx.be, ctx.has_bias, ctx.stock = be, bias is not None, _STOCK_BACKWARD[0] and be != "triton"
        return _matmul_impl(a, b, bias, be)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if ctx.stock:                                   # (stock_backward(): MKL's fp32 GEMM)
            ga = _stock_mm(g, b.t(), a.dtype) if ctx.needs_input_grad[0] else None
            gb = _stock_mm(a.t(), g, b.dtype) if ctx.needs_input_grad[1] else None
        else:
            ga = _matmul_impl(g, b.t(), None, ctx.be) if ctx.needs_input_grad[0] else None
            gb = _matmul_impl(a.t(), g, None, ctx.be) if ctx.needs_input_grad[1] else None
        gbias = _reduce(g, [0], False, False, None, ctx.be) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return ga, gb, gbias, None


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           backend: str = "auto") -> torch.Tensor:
    """``a @ b (+ bias)`` for a (..., K), b (K, N): row i of the result never depends on the
    other rows (fixed K order, fp32 accumulation, no split-K)."""
    check_float("a", a)
    check_float("b", b, 2)
    check_dtype_match("a", a, "b", b)
    if a.dim() < 1:
        raise InputError("expected at least 1 dim", field="a")
    check_same("b", b.shape[0], a.shape[-1], "b.shape[0] must equal a.shape[-1] (K)")
    if bias is not None:
        check_float("bias", bias, 1)
        check_same("bias", bias.shape[0], b.shape[1], "bias length must equal b.shape[1] (N)")
    be = resolve_backend(backend, a)
    lead = a.shape[:-1]
    a2 = a.reshape(lead.numel(), a.shape[-1])      # (not -1: K may be 0)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        out = _Matmul.apply(a2, b, bias, be)
    else:
        out = _matmul_impl(a2, b, bias, be)
    return out.reshape(*lead, b.shape[1])


def bmm(a: torch.Tensor, b: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Batched ``a[i] @ b[i]``, a (B, M, K), b (B, K, N). Forward only."""
    check_float("a", a, 3)
    check_float("b", b, 3)
    check_dtype_match("a", a, "b", b)
    check_same("b", (b.shape[0], b.shape[1]), (a.shape[0], a.shape[2]), "b must be (B, K, N) for a (B, M, K)")
    be = resolve_backend(backend, a)
    if be == "triton":
        return _tl("tl_matmul").bmm(a, b)
    return cpu.bmm(a, b) if be == "cpu" else reference.bmm(a, b)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *,
                   backend: str = "auto") -> torch.Tensor:
    """MoE experts: x (T, K) sorted by expert, w (E, K, N), offsets (E+1,) with
    offsets[0] = 0, non-decreasing, offsets[E] = T. Row t uses the expert whose segment holds t."""
    check_float("x", x, 2)
    check_float("w", w, 3)
    check_dtype_match("x", x, "w", w)
    check_same("w", w.shape[1], x.shape[1], "w.shape[1] must equal x.shape[1] (K)")
    if offsets.dim() != 1 or offsets.shape[0] != w.shape[0] + 1:
        raise InputError(f"expected shape ({w.shape[0] + 1},), got {tuple(offsets.shape)}", field="offsets")
    offs = offsets.detach().cpu().tolist()
    if offs[0] != 0 or offs[-1] != x.shape[0]:
        raise InputError(f"must start at 0 and end at T={x.shape[0]}, got {offs[0]}..{offs[-1]}", field="offsets")
    for i in range(len(offs) - 1):
        if offs[i + 1] < offs[i]:
            raise InputError(f"must be non-decreasing: {offs[i]} then {offs[i + 1]}", field="offsets", index=i + 1)
    be = resolve_backend(backend, x)
    if be == "triton":
        return _tl("tl_matmul").grouped_matmul(x, w, offsets)
    fn = cpu.grouped_matmul if be == "cpu" else reference.grouped_matmul
    return fn(x, w, offsets.cpu())


# ---------------------------------------------------------------- softmax family
class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, be):
        y = _tl("tl_softmax").log_softmax_fwd(x) if be == "triton" else cpu.log_softmax(x)
        ctx.save_for_backward(y)
        ctx.be = be
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        if ctx.be == "triton":
            return _tl("tl_softmax").log_softmax_bwd(g, y), None
        return cpu.log_softmax_backward(g, y), None


def log_softmax(x: torch.Tensor, dim: int = -1, *, backend: str = "auto") -> torch.Tensor:
    """log_softmax over the last dim, one row at a time (chunks of the row in a fixed order)."""
    check_float("x", x)
    if dim not in (-1, x.dim() - 1):
        raise InputError(f"only the last dim is supported, got dim={dim} for {x.dim()} dims", field="dim")
    be = resolve_backend(backend, x)
    if be == "reference":
        return reference.log_softmax(x)
    return _LogSoftmax.apply(x, be)


class _TokenLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, be):
        if be == "triton":
            lp, ent, lse = _tl("tl_softmax").token_logprob_entropy_fwd(logits, targets, temperature)
        else:
            lp, ent, lse = cpu.token_logprob_entropy(logits, targets, temperature)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.be = temperature, be
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        g_lp = torch.zeros_like(ent) if g_lp is None else g_lp
        g_ent = torch.zeros_like(ent) if g_ent is None else g_ent
        if ctx.be == "triton":
            dx = _tl("tl_softmax").token_logprob_entropy_bwd(logits, targets, lse, ent, g_lp, g_ent,
                                                            ctx.temperature)
        else:
            dx = cpu.token_logprob_entropy_backward(logits, targets, lse, ent, g_lp, g_ent, ctx.temperature)
        return dx, None, None, None


def token_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                          *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits / temperature`` (shape (..., V)): the log-prob of ``targets`` (...,)
    and the entropy of the distribution, both float32, without materialising log-probs."""
    check_float("logits", logits)
    if targets.shape != logits.shape[:-1]:
        raise InputError(f"expected shape {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}", field="targets")
    if targets.dtype not in (torch.int32, torch.int64):
        raise InputError(f"expected int32/int64, got {targets.dtype}", field="targets")
    if not temperature > 0:
        raise InputError(f"must be > 0, got {temperature}", field="temperature")
    if targets.numel():
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= logits.shape[-1]:
            bad = lo if lo < 0 else hi
            raise InputError(f"token id {bad} outside vocab [0, {logits.shape[-1]})", field="targets")
    be = resolve_backend(backend, logits)
    if be == "reference":
        return reference.token_logprob_entropy(logits, targets, temperature)
    return _TokenLogprobEntropy.apply(logits, targets, float(temperature), be)


# ---------------------------------------------------------------- rms_norm
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, be):
        y, rstd = _tl("tl_rmsnorm").forward(x, w, eps) if be == "triton" else cpu.rms_norm(x, w, eps)
        ctx.save_for_backward(x, w, rstd)
        ctx.be = be
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        fn = _tl("tl_rmsnorm").backward if ctx.be == "triton" else cpu.rms_norm_backward
        dx, dw = fn(g.contiguous(), x, w, rstd)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             backend: str = "auto") -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` in fp32, rounded once to x.dtype."""
    check_float("x", x)
    check_float("weight", weight, 1)
    check_same("weight", weight.shape[0], x.shape[-1], "weight length must equal x.shape[-1]")
    be = resolve_backend(backend, x)
    if be == "reference":
        return reference.rms_norm(x, weight, eps)
    return _RMSNorm.apply(x, weight, float(eps), be)


# ---------------------------------------------------------------- sum / mean
def _reduce(x, dims, keepdim, mean, dtype, be):
    if be == "triton":
        return _tl("tl_reduce").reduce(x, dims, keepdim, mean, dtype)
    if be == "cpu":
        return cpu.reduce(x, dims, keepdim, mean, dtype)
    red = dims if dims else list(range(x.dim()))
    fn = reference.mean_dim if mean else reference.sum_dim
    return fn(x, red, keepdim).to(dtype or x.dtype)


def _dims(x, dim):
    if dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    for i, d in enumerate(dims):
        if not -x.dim() <= d < max(x.dim(), 1):
            raise InputError(f"dim {d} out of range for {x.dim()} dims", field="dim", index=i)
    return dims


def sum(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None,  # noqa: A001
        backend: str = "auto") -> torch.Tensor:
    """Sum over ``dim`` (int, list, or None = all); each output reduced in a fixed order."""
    check_float("x", x)
    return _reduce(x, _dims(x, dim), keepdim, False, dtype, resolve_backend(backend, x))


def mean(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None,
         backend: str = "auto") -> torch.Tensor:
    """Mean over ``dim`` (int, list, or None = all); each output reduced in a fixed order."""
    check_float("x", x)
    return _reduce(x, _dims(x, dim), keepdim, True, dtype, resolve_backend(backend, x))


# ---------------------------------------------------------------- attention
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              scale: float | None = None, backend: str = "auto",
              kv_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (grouped-query) attention, q (B, H, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv)
    (Dv = D for Triton), queries at the end of the keys. Prefill (Sq = Skv) and token-by-token
    decode over a KV cache (Sq = 1, Skv = t + 1) give the same bits for every query. Forward
    only."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t, 4)
    check_dtype_match("q", q, "k", k)
    check_dtype_match("q", q, "v", v)
    B, H, Sq, D = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise InputError(f"expected v shape {tuple(k.shape[:3])} + (Dv,) (k's first three dims), "
                         f"got {tuple(v.shape)}", field="v")
    check_same("k", (k.shape[0], k.shape[3]), (B, D), "k must be (B, Hkv, Skv, D) matching q's B and D")
    if H % k.shape[1]:
        raise InputError(f"q heads {H} must be a multiple of kv heads {k.shape[1]}", field="k")
    if Sq > k.shape[2]:
        raise InputError(f"more queries ({Sq}) than keys ({k.shape[2]})", field="q")
    be = resolve_backend(backend, q)
    if kv_lens is not None:
        # right-padded batch of sequences with their own key counts (CPU path only)
        if be != "cpu":
            raise InputError(f"kv_lens is supported by the cpu backend only, not {be!r}",
                             field="kv_lens")
        kl = torch.as_tensor(kv_lens).reshape(-1)
        if kl.numel() != B or int(kl.min()) < Sq or int(kl.max()) > k.shape[2]:
            raise InputError(f"kv_lens must hold {B} values in [{Sq}, {k.shape[2]}]",
                             field="kv_lens")
        return cpu.attention(q, k, v, causal, scale, kv_lens=kl)
    if be == "triton":
        if k.shape != v.shape:
            raise InputError(f"the Triton kernel needs v shape {tuple(k.shape)} (same as k), "
                             f"got {tuple(v.shape)}", field="v")
        if D & (D - 1) or D < 16:
            raise InputError(f"head dim must be a power of two >= 16 for Triton, got {D}", field="q")
        return _tl("tl_attention").attention(q, k, v, causal, scale)
    if be == "cpu":
        return cpu.attention(q, k, v, causal, scale)
    return reference.attention(q, k, v, causal, scale)
