"""Vocab-parallel token logprobs, entropy and support replay: the lm-head stays split over the TP ranks.

Rank ``r`` holds lm-head rows ``[r V/tp, (r+1) V/tp)``. For each token it folds its own vocabulary chunks
(``chunk`` ids at a time, so at most one ``[N, chunk]`` block exists) into running statistics over its
shard, restricted to the token's support set when one is given::

    m_r = max_v z_v,   s_r = Σ_v e^{z_v - m_r},   u_r = Σ_v e^{z_v - m_r} z_v,   zt_r = z_target (0 off-shard)

and the ranks combine three ``[N]`` vectors — never the ``[N, V]`` logits::

    M = max_r m_r (all-reduce MAX),  S = Σ_r s_r e^{m_r - M},  U = Σ_r u_r e^{m_r - M},  ZT = Σ_r zt_r (all-reduce SUM)
    logZ = M + log S,   logprob = ZT - logZ,   entropy = logZ - U / S

(``z = float32(h) @ W_r^T``; the caller divides ``h`` by the temperature first, as
:func:`skyrl_numerics.replay.support_logprobs` expects). Backward (custom autograd, chunks recomputed)::

    dz_v = 1[v = t] g_lp - p_v (g_lp + g_ent (z_v - logZ + entropy)),  p_v = e^{z_v - logZ} (0 outside the support)

gives each rank its lm-head shard's gradient and a *partial* hidden-state gradient ``Σ_{v in shard} dz_v W_v``;
the sum over TP ranks is done by megatron-core's own mapping the hidden state came through
(``gather_from_sequence_parallel_region``'s reduce-scatter, or ``copy_to_tensor_model_parallel_region``'s
all-reduce).

Equality with one rank: ``group=None, partitions=P`` runs the same computation in one process, partition by
partition, and combines the partitions in rank order. With 2 ranks every combine is one max or one
two-term sum, both order-free, so TP 2 equals ``partitions=2`` bitwise (tested). Against the plain
full-vocabulary ``log_softmax`` (``partitions=1``) the split sum differs by rounding only (measured in the
tests; tolerance 2e-6 absolute in float32).
"""
from __future__ import annotations

import numpy as np
import torch

from skyrl_numerics.errors import InputError

__all__ = ["vocab_parallel_logprobs"]


def _acc(t):
    return torch.promote_types(t.dtype, torch.float32)


class _ShardIndex:
    """Support entries with ids in ``[lo, hi)``, sorted by id (a vocab chunk = one contiguous slice)."""

    def __init__(self, support, lo: int, hi: int, device):
        ids = support.token_ids.astype(np.int64)
        rows = support.row_ids()
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


def _chunk(hf, w, lo, hi, index, n):
    z = hf @ w[lo:hi].to(hf.dtype).T
    if index is None:
        return z, z
    return z, z.masked_fill(~index.mask(n, lo, hi), float("-inf"))


def _local_stats(hf, w, t_local, index, chunk):
    """(m, s, u, zt) of this shard; ``t_local`` = target id - shard start (outside [0, Vr): not here)."""
    n, V = hf.shape[0], w.shape[0]
    kw = dict(device=hf.device, dtype=hf.dtype)
    m = torch.full((n,), float("-inf"), **kw)
    s, u, zt = torch.zeros(n, **kw), torch.zeros(n, **kw), torch.zeros(n, **kw)
    for lo in range(0, V, chunk):
        hi = min(V, lo + chunk)
        zr, z = _chunk(hf, w, lo, hi, index, n)
        m_new = torch.maximum(m, z.amax(dim=1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        e = torch.exp(z - safe[:, None])
        scale = torch.exp(m - safe)
        s = s * scale + e.sum(1)
        u = u * scale + (e * zr).sum(1)
        m = m_new
        inside = (t_local >= lo) & (t_local < hi)
        if inside.any():
            r = inside.nonzero()[:, 0]
            zt[r] = z[r, t_local[r] - lo]
    return m, s, u, zt


def _combine(stats, group):
    """``stats``: list (one per local partition) of (m, s, u, zt); all-reduce over ``group`` if given."""
    import torch.distributed as dist

    m = stats[0][0]
    for st in stats[1:]:
        m = torch.maximum(m, st[0])
    if group is not None:
        m = m.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = u = zt = None
    for mi, si, ui, zi in stats:
        sc = torch.where(torch.isfinite(mi), torch.exp(mi - m), torch.zeros_like(mi))
        parts = (si * sc, ui * sc, zi)
        s, u, zt = parts if s is None else (s + parts[0], u + parts[1], zt + parts[2])
    if group is not None:
        packed = torch.stack([s, u, zt])
        dist.all_reduce(packed, group=group)
        s, u, zt = packed
    return m, s, u, zt


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, starts, indices, chunk, group):
        hf = hidden.to(_acc(hidden))
        Vr = weight.shape[0] // len(starts)
        stats = []
        for j, lo in enumerate(starts):
            w = weight[j * Vr:(j + 1) * Vr]
            stats.append(_local_stats(hf, w, targets - lo, indices[j], chunk))
        m, s, u, zt = _combine(stats, group)
        logz = m + torch.log(s)
        lp, ent = zt - logz, logz - u / s
        ctx.save_for_backward(hidden, weight, targets, logz, ent)
        ctx.starts, ctx.indices, ctx.chunk = starts, indices, chunk
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, logz, ent = ctx.saved_tensors
        acc = _acc(hidden)
        n = hidden.shape[0]
        g_lp = torch.zeros(n, dtype=acc, device=hidden.device) if g_lp is None else g_lp.to(acc)
        g_ent = torch.zeros(n, dtype=acc, device=hidden.device) if g_ent is None else g_ent.to(acc)
        hf = hidden.to(acc)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        Vr = weight.shape[0] // len(ctx.starts)
        dh_parts = []  # one partial per partition, summed in rank order: what the TP reduction does
        for j, start in enumerate(ctx.starts):
            w = weight[j * Vr:(j + 1) * Vr]
            tl = targets - start
            dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
            for lo in range(0, Vr, ctx.chunk):
                hi = min(Vr, lo + ctx.chunk)
                zr, z = _chunk(hf, w, lo, hi, ctx.indices[j], n)
                p = torch.exp(z - logz[:, None])
                dz = -p * (g_lp[:, None] + g_ent[:, None] * (zr - logz[:, None] + ent[:, None]))
                inside = (tl >= lo) & (tl < hi)
                if inside.any():
                    r = inside.nonzero()[:, 0]
                    dz[r, tl[r] - lo] += g_lp[r]
                if need_h:
                    dh += dz @ w[lo:hi].to(acc)
                if need_w:
                    dw[j * Vr + lo:j * Vr + hi] = dz.T @ hf
            dh_parts.append(dh)
        dh = None
        if need_h:
            dh = dh_parts[0]
            for part in dh_parts[1:]:
                dh = dh + part
        return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype),
                None, None, None, None, None)


def vocab_parallel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets, *, vocab_start: int = 0,
                            vocab_size: int | None = None, group=None, partitions: int = 1, support=None,
                            chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprob [N], entropy [N])`` float32 of global token ids ``targets`` under this rank's vocab shard.

    hidden ``[N, H]`` (already divided by the temperature), weight: this rank's lm-head rows ``[Vr, H]``
    starting at global id ``vocab_start``; ``group``: the TP process group (None: one process).
    ``partitions``: with ``group=None``, split ``weight`` into that many equal shards and combine them as
    ``partitions`` ranks would (the single-process reference for TP = ``partitions``). ``support``: a
    :class:`~skyrl_numerics.replay.PackedSupport` with N rows over the *global* vocabulary (``vocab_size``),
    or None for the full vocabulary. Differentiable in ``hidden`` and ``weight`` (the hidden gradient is this
    rank's partial sum; see the module doc).
    """
    if hidden.ndim != 2 or weight.ndim != 2 or weight.shape[1] != hidden.shape[1]:
        raise InputError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} are not [N, H] / [Vr, H]",
                         field="hidden")
    if group is not None and partitions != 1:
        raise InputError("partitions is the single-process reference: use it with group=None", field="partitions")
    if partitions < 1 or weight.shape[0] % partitions:
        raise InputError(f"partitions={partitions} does not divide {weight.shape[0]} vocabulary rows",
                         field="partitions")
    if chunk < 1:
        raise InputError(f"chunk must be >= 1, got {chunk}", field="chunk")
    import torch.distributed as dist

    world = dist.get_world_size(group) if group is not None else 1
    V = int(vocab_size) if vocab_size is not None else weight.shape[0] * world
    targets = torch.as_tensor(targets, device=hidden.device).long().reshape(-1)
    n = hidden.shape[0]
    if targets.numel() != n:
        raise InputError(f"{targets.numel()} targets for {n} hidden rows", field="targets")
    if n and (int(targets.min()) < 0 or int(targets.max()) >= V):
        bad = int(((targets < 0) | (targets >= V)).nonzero()[0, 0])
        raise InputError(f"target {int(targets[bad])} outside vocab [0, {V})", field="targets", index=bad)
    Vr = weight.shape[0] // partitions
    starts = tuple(int(vocab_start) + j * Vr for j in range(partitions))
    indices = [None] * partitions
    if support is not None:
        if support.num_tokens != n:
            raise InputError(f"{support.num_tokens} support rows for {n} tokens", field="support")
        support.validate(V)
        ok = support.contains(targets.cpu().numpy())
        if not ok.all():
            i = int(np.argmin(ok))
            raise InputError(f"target {int(targets[i])} is not in its support", field="support", index=i)
        indices = [_ShardIndex(support, lo, lo + Vr, hidden.device) for lo in starts]
    return _VocabParallel.apply(hidden, weight, targets, starts, indices, int(chunk), group)
