"""Logprobs renormalized over the sampled support, computed in vocab chunks (no full-vocab logits).

For response token ``i`` with hidden state ``h_i``, logits ``z_iv = (h_i . W_v) / T`` (sampling temperature
``T``, default 1: the logits divided before the softmax, as vLLM's processed logprobs are) and support
``S_i``::

    logZ_i    = logsumexp_{v in S_i} z_iv
    logprob_i = z_{i,t_i} - logZ_i                    (t_i must lie in S_i)
    entropy_i = logZ_i - sum_{v in S_i} p_iv z_iv     (p_iv = exp(z_iv - logZ_i); = -sum p log p)

When ``S_i`` is the whole vocabulary this is ``log_softmax(z_i)[t_i]`` and the full entropy.

Dense chunks are folded into running (max, sum exp, sum exp*z) accumulators, then dropped: peak extra
memory ``O(N * chunk)`` instead of ``O(N * V)``; the backward pass recomputes each chunk's logits (custom
autograd). Both methods use::

    d logprob_i / d z_iv = 1[v = t_i] - p_iv                  (v in S_i, else 0)
    d entropy_i / d z_iv = -p_iv (z_iv - logZ_i + entropy_i)  (v in S_i, else 0)

and ``d z_iv / d h_i = W_v / T``, ``d z_iv / d W_v = h_i / T`` (the division skipped at ``T = 1``, so those
bits are the undivided ones).

One vocabulary shard, the reductions abstracted: :func:`shard_stats` folds a shard (rows ``[lo, hi)`` of the
lm-head, target ids relative to ``lo``) into ``(m, s, u, zt)``::

    m = max_{v in shard ∩ S} z_v,  s = Σ e^{z_v - m},  u = Σ e^{z_v - m} z_v,  zt = z_t (0 if t is off-shard)

and :func:`shard_grads` is the backward of that shard given the *combined* ``logZ`` and entropy. Here the
whole vocabulary is one shard; ``trainer/megatron/vocab_parallel.py`` runs the same two functions on each
tensor-parallel rank's shard and supplies all-reduced ``logZ`` / entropy (max and sum-exp over the ranks).

Two ways to visit the support, chosen by ``method`` (``"auto"`` picks by density):

- ``"dense"``: vocabulary chunks of ``chunk`` ids: each chunk's ``[N, chunk]`` logits are computed with one
  matmul and masked to the support; cost ``N*V*H``, for large supports (top-p at high p, full vocab).
- ``"sparse"``: only the ``nnz`` support logits ``z_j = h_{row j} . W_{id j}``, gathered ``chunk`` entries at a
  time, then per-row (segment) max / sum; cost ``nnz*H`` but memory-bound gathers, for top-k and small
  top-p supports. ``"auto"`` takes it when ``64 * nnz < N * V`` (on CPU one gathered row-dot cost ~50x a
  matmul column in ``benchmarks/bench_replay.py``).

Math in float32 (logits are upcast; float64 inputs stay float64); inputs may be bf16.
:func:`support_logprobs_reference` (dense logits + boolean mask) is the spec the tests compare against.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from skyrl_numerics.errors import InputError

from .routes import exact_ints
from .support import PackedSupport


def support_logprobs_reference(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                               support: PackedSupport | None,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense spec: full ``[N, V]`` float32 (float64 for float64 inputs) logits ``/ temperature``,
    ``-inf`` outside the support, log_softmax."""
    acc = acc_dtype(hidden)
    logits = hidden.to(acc) @ lm_head_weight.to(acc).T
    if temperature != 1.0:
        logits = logits / temperature
    if support is not None:
        mask = dense_mask(support, logits.shape[1], logits.device)
        logits = logits.masked_fill(~mask, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(1, targets.long()[:, None])[:, 0]
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    return lp, ent


def dense_mask(support: PackedSupport, vocab: int, device) -> torch.Tensor:
    mask = torch.zeros(support.num_tokens, vocab, dtype=torch.bool, device=device)
    rows = torch.from_numpy(support.row_ids()).to(device)
    cols = torch.from_numpy(support.token_ids.astype(np.int64)).to(device)
    mask[rows, cols] = True
    return mask


class ShardIndex:
    """Support entries sorted by token id, so a vocab chunk's entries are one contiguous slice; with ``hi``
    only the ids in ``[lo, hi)`` (one vocab shard), relative to ``lo``."""

    def __init__(self, support: PackedSupport, device, lo: int = 0, hi: int | None = None):
        ids, rows = support.token_ids.astype(np.int64), support.row_ids()
        if hi is not None:
            keep = (ids >= lo) & (ids < hi)
            ids, rows = ids[keep] - lo, rows[keep]
        order = np.argsort(ids, kind="stable")
        self.tok = torch.from_numpy(ids[order]).to(device)
        self.row = torch.from_numpy(rows[order]).to(device)

    def mask(self, n: int, lo: int, hi: int) -> torch.Tensor:
        a, b = torch.searchsorted(self.tok, torch.tensor([lo, hi], device=self.tok.device)).tolist()
        m = torch.zeros(n, hi - lo, dtype=torch.bool, device=self.tok.device)
        m[self.row[a:b], self.tok[a:b] - lo] = True
        return m


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def chunk_logits(hf, weight, lo, hi, index, temperature=1.0):
    """``(raw, masked)`` chunk logits ``/ temperature``: ``masked`` is ``-inf`` outside the support (``raw``
    itself if no support). Products with ``exp(masked - c)`` (0 outside) then use ``raw`` to stay finite
    without extra passes."""
    z = hf @ weight[lo:hi].to(hf.dtype).T  # hf already upcast: same products as the reference
    if temperature != 1.0:
        z = z / temperature
    if index is None:
        return z, z
    return z, z.masked_fill(~index.mask(hf.shape[0], lo, hi), float("-inf"))


def shard_stats(hf, weight, t_local, index, chunk, temperature=1.0):
    """``(m, s, u, zt)``, each ``[N]``, of one vocab shard (module doc), folded ``chunk`` ids at a time.

    ``hf`` ``[N, H]`` the upcast hidden states, ``weight`` ``[Vs, H]`` the shard's lm-head rows, ``t_local``
    the target ids minus the shard's first id (outside ``[0, Vs)``: not on this shard), ``index`` the shard's
    :class:`ShardIndex` or None (no support: every id), ``temperature`` the sampling temperature."""
    n, V = hf.shape[0], weight.shape[0]
    kw = dict(device=hf.device, dtype=hf.dtype)
    m = torch.full((n,), float("-inf"), **kw)
    s, u, zt = torch.zeros(n, **kw), torch.zeros(n, **kw), torch.zeros(n, **kw)
    for lo in range(0, V, chunk):
        hi = min(V, lo + chunk)
        zr, z = chunk_logits(hf, weight, lo, hi, index, temperature)
        m_new = torch.maximum(m, z.amax(dim=1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        e = torch.exp(z - safe[:, None])  # exp(-inf) = 0 outside the support
        scale = torch.exp(m - safe)
        s = s * scale + e.sum(1)
        u = u * scale + (e * zr).sum(1)  # e = 0 outside, zr finite
        m = m_new
        inside = (t_local >= lo) & (t_local < hi)
        if inside.any():
            r = inside.nonzero()[:, 0]
            zt[r] = z[r, t_local[r] - lo]
    return m, s, u, zt


def stats_to_logprobs(m, s, u, zt):
    """``(logZ, logprob, entropy)`` from the combined ``(m, s, u, zt)`` of every shard."""
    logz = m + torch.log(s)
    return logz, zt - logz, logz - u / s


def support_dlogits(z, zr, logz, ent, g_lp, g_ent):
    """``-p (g_lp + g_ent (zr - logZ + entropy))`` with ``p = e^{z - logZ}``: the logit gradient without the
    target's ``+ g_lp``. ``z`` is ``-inf`` outside the support (``p = 0``), ``zr`` the finite raw logits."""
    return -torch.exp(z - logz) * (g_lp + g_ent * (zr - logz + ent))


def grad_or_zeros(g, n: int, dtype, device) -> torch.Tensor:
    """An output's incoming gradient in ``dtype`` (zeros when autograd passes None)."""
    return torch.zeros(n, dtype=dtype, device=device) if g is None else g.to(dtype)


def shard_grads(hf, weight, t_local, index, chunk, logz, ent, g_lp, g_ent, need_h=True, need_w=True,
                temperature=1.0):
    """Backward of one vocab shard: ``(dh, dw)`` in ``hf``'s dtype (None where not needed)::

        dz_v = 1[v = t] g_lp - p_v (g_lp + g_ent (z_v - logZ + entropy)),   p_v = e^{z_v - logZ} on the support, else 0

    (for the logprob alone: ``onehot(target) - softmax restricted to the support``), ``dh = Σ_{v in shard} dz_v
    W_v`` (this shard's part of the hidden gradient), ``dw_v = dz_v h``. ``logZ`` / ``entropy`` ``[N]`` are the
    combined values over all shards (all-reduced on tensor-parallel ranks); other arguments as
    :func:`shard_stats`, logits recomputed ``chunk`` ids at a time."""
    V = weight.shape[0]
    dh = torch.zeros(hf.shape, dtype=hf.dtype, device=hf.device) if need_h else None
    dw = torch.zeros(weight.shape, dtype=hf.dtype, device=weight.device) if need_w else None
    for lo in range(0, V, chunk):
        hi = min(V, lo + chunk)
        zr, z = chunk_logits(hf, weight, lo, hi, index, temperature)
        dz = support_dlogits(z, zr, logz[:, None], ent[:, None], g_lp[:, None], g_ent[:, None])  # 0 outside
        inside = (t_local >= lo) & (t_local < hi)
        if inside.any():
            r = inside.nonzero()[:, 0]
            dz[r, t_local[r] - lo] += g_lp[r]
        if temperature != 1.0:
            dz = dz / temperature  # z = (h . W) / T
        if need_h:
            dh += dz @ weight[lo:hi].to(hf.dtype)
        if need_w:
            dw[lo:hi] = dz.T @ hf
    return dh, dw


def cast_grads(dh, dw, hidden, weight):
    """``(dh, dw)`` back in the inputs' dtypes."""
    return None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype)


class _SupportLogprobs(torch.autograd.Function):
    """The whole vocabulary as one shard."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, index, chunk, temperature=1.0):
        hf = hidden.to(acc_dtype(hidden))
        logz, lp, ent = stats_to_logprobs(*shard_stats(hf, weight, targets, index, chunk, temperature))
        ctx.save_for_backward(hidden, weight, targets, logz, ent)
        ctx.index, ctx.chunk, ctx.temperature = index, chunk, temperature
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, logz, ent = ctx.saved_tensors
        acc, n = acc_dtype(hidden), hidden.shape[0]
        g_lp, g_ent = (grad_or_zeros(g, n, acc, hidden.device) for g in (g_lp, g_ent))
        dh, dw = shard_grads(hidden.to(acc), weight, targets, ctx.index, ctx.chunk, logz, ent, g_lp, g_ent,
                             *ctx.needs_input_grad[:2], temperature=ctx.temperature)
        return (*cast_grads(dh, dw, hidden, weight), None, None, None, None)


class _SparseSupportLogprobs(torch.autograd.Function):
    """Support logits only: ``z_j = h[row_j] . W[id_j]`` for the nnz CSR entries (rows sorted)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, ids, chunk, temperature=1.0):
        acc = acc_dtype(hidden)
        n, nnz = hidden.shape[0], ids.numel()
        hf = hidden.to(acc)
        z = torch.empty(nnz, dtype=acc, device=hidden.device)
        for lo in range(0, nnz, chunk):
            hi = min(nnz, lo + chunk)
            z[lo:hi] = (hf[rows[lo:hi]] * weight[ids[lo:hi]].to(acc)).sum(-1)
        if temperature != 1.0:
            z = z / temperature
        m = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device).scatter_reduce(0, rows, z, "amax")
        e = torch.exp(z - m[rows])
        s = torch.zeros(n, dtype=acc, device=hidden.device).index_add_(0, rows, e)
        u = torch.zeros(n, dtype=acc, device=hidden.device).index_add_(0, rows, e * z)
        is_t = ids == targets[rows]
        zt = torch.zeros(n, dtype=acc, device=hidden.device).index_add_(0, rows[is_t], z[is_t])
        logz, lp, ent = stats_to_logprobs(m, s, u, zt)
        ctx.save_for_backward(hidden, weight, rows, ids, z, is_t, logz, ent)
        ctx.chunk, ctx.temperature = chunk, temperature
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, rows, ids, z, is_t, logz, ent = ctx.saved_tensors
        acc, n = z.dtype, hidden.shape[0]
        g_lp, g_ent = (grad_or_zeros(g, n, acc, z.device) for g in (g_lp, g_ent))
        dz = support_dlogits(z, z, logz[rows], ent[rows], g_lp[rows], g_ent[rows]) + g_lp[rows] * is_t
        if ctx.temperature != 1.0:
            dz = dz / ctx.temperature  # z = (h . W) / T
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.zeros(hidden.shape, dtype=acc, device=z.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=z.device) if need_w else None
        hf = hidden.to(acc)
        for lo in range(0, ids.numel(), ctx.chunk):
            hi = min(ids.numel(), lo + ctx.chunk)
            r, i, d = rows[lo:hi], ids[lo:hi], dz[lo:hi, None]
            if need_h:
                dh.index_add_(0, r, d * weight[i].to(acc))
            if need_w:
                dw.index_add_(0, i, d * hf[r])
        return (*cast_grads(dh, dw, hidden, weight), None, None, None, None, None)


def checked_targets(targets, n: int, V: int, device) -> torch.Tensor:
    """``targets`` as ``[n]`` int64 on ``device``; InputError on non-integers, a wrong count or an id outside
    ``[0, V)``."""
    targets = torch.from_numpy(exact_ints(targets, "targets")).to(device).reshape(-1)
    if targets.numel() != n:
        raise InputError(f"{targets.numel()} targets for {n} hidden rows", field="targets")
    if n and (int(targets.min()) < 0 or int(targets.max()) >= V):
        bad = int(((targets < 0) | (targets >= V)).nonzero()[0, 0])
        raise InputError(f"target {int(targets[bad])} outside vocab [0, {V})", field="targets", index=bad)
    return targets


def check_support(support: PackedSupport, targets: torch.Tensor, V: int) -> None:
    """InputError unless ``support`` has one valid row over ``[0, V)`` per target, each holding its target."""
    if support.num_tokens != targets.numel():
        raise InputError(f"{support.num_tokens} support rows for {targets.numel()} tokens", field="support")
    support.validate(V)
    ok = support.contains(targets.cpu().numpy())
    if not ok.all():
        i = int(np.argmin(ok))
        raise InputError(f"target {int(targets[i])} is not in its support (size {int(support.sizes[i])})",
                         field="support", index=i)


def support_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                     support: PackedSupport | None, *, chunk: int = 8192, method: str = "auto",
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprob, entropy)``, each float32 (float64 for float64 inputs) ``[N]``, renormalized over each token's support.

    hidden ``[N, H]`` (the final-norm output at the positions predicting ``targets``), lm_head_weight
    ``[V, H]``, targets ``[N]`` ids, support: a :class:`PackedSupport` with ``N`` rows, or ``None`` for the
    full vocabulary. Differentiable in ``hidden`` and ``lm_head_weight``. ``chunk``: vocab ids per dense
    chunk, or support entries per sparse chunk. ``method``: ``"auto"``, ``"dense"`` or ``"sparse"``.
    ``temperature``: the sampling temperature ``T > 0``; the logits are divided by it before the
    renormalized log-softmax (module doc), as vLLM's processed logprobs are.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        raise InputError(f"temperature must be a finite number > 0, got {temperature!r}", field="temperature")
    if method not in ("auto", "dense", "sparse"):
        raise InputError(f"method must be 'auto', 'dense' or 'sparse', got {method!r}", field="method")
    if hidden.ndim != 2:
        raise InputError(f"expected [N, H], got shape {tuple(hidden.shape)}", field="hidden")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise InputError(f"expected [V, {hidden.shape[1]}], got {tuple(lm_head_weight.shape)}", field="lm_head_weight")
    n, V = hidden.shape[0], lm_head_weight.shape[0]
    targets = checked_targets(targets, n, V, hidden.device)
    if chunk < 1:
        raise InputError(f"chunk must be >= 1, got {chunk}", field="chunk")
    index = None
    if support is not None:
        check_support(support, targets, V)
        if method == "sparse" or (method == "auto" and 64 * support.nnz < n * V):
            rows = torch.from_numpy(support.row_ids()).to(hidden.device)
            ids = torch.from_numpy(support.token_ids.astype(np.int64)).to(hidden.device)
            return _SparseSupportLogprobs.apply(hidden, lm_head_weight, targets, rows, ids, int(chunk),
                                                float(temperature))
        index = ShardIndex(support, hidden.device)
    elif method == "sparse":
        raise InputError("method='sparse' needs a support (None means the full vocabulary)", field="method")
    return _SupportLogprobs.apply(hidden, lm_head_weight, targets, index, int(chunk), float(temperature))
