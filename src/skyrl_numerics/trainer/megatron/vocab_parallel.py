"""Vocab-parallel token logprobs, entropy and support replay: the lm-head stays split over the TP ranks.

Rank ``r`` holds lm-head rows ``[r V/tp, (r+1) V/tp)``. It folds its own vocabulary chunks (``chunk`` ids
at a time, so at most one ``[N, chunk]`` block exists), restricted to the token's support set when one is
given, into ``(m_r, s_r, u_r, zt_r)`` (max, sum-exp, sum-exp times logit, target logit) with
:func:`skyrl_numerics.replay.support_lp.shard_stats`, and the ranks combine them — never the ``[N, V]``
logits::

    M = max_r m_r (all-reduce MAX),  S = Σ_r s_r e^{m_r - M},  U = Σ_r u_r e^{m_r - M},  ZT = Σ_r zt_r (all-reduce SUM)
    logZ = M + log S,   logprob = ZT - logZ,   entropy = logZ - U / S

(``z = float32(h) @ W_r^T``; the caller divides ``h`` by the temperature first, as
:func:`skyrl_numerics.replay.support_logprobs` expects). Backward (custom autograd, chunks recomputed) is
:func:`skyrl_numerics.replay.support_lp.shard_grads` on the rank's shard with these all-reduced ``logZ`` and
entropy — the same per-shard formula ``support_logprobs`` runs on the whole vocabulary, written out there. It
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

import torch
import torch.distributed as dist

from skyrl_numerics.errors import InputError
from skyrl_numerics.replay.support_lp import (ShardIndex, acc_dtype, cast_grads, check_support, checked_targets,
                                              grad_or_zeros, shard_grads, shard_stats, stats_to_logprobs)

__all__ = ["vocab_parallel_logprobs"]


def _combine(stats, group):
    """``stats``: list (one per local partition) of (m, s, u, zt); all-reduce over ``group`` if given."""
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


def _in_order(parts):
    """Sum in rank order (what the TP reduction does); None stays None."""
    if parts[0] is None:
        return None
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, starts, indices, chunk, group):
        hf = hidden.to(acc_dtype(hidden))
        Vr = weight.shape[0] // len(starts)
        stats = [shard_stats(hf, weight[j * Vr:(j + 1) * Vr], targets - lo, indices[j], chunk)
                 for j, lo in enumerate(starts)]
        logz, lp, ent = stats_to_logprobs(*_combine(stats, group))
        ctx.save_for_backward(hidden, weight, targets, logz, ent)
        ctx.starts, ctx.indices, ctx.chunk = starts, indices, chunk
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, logz, ent = ctx.saved_tensors
        acc, n = acc_dtype(hidden), hidden.shape[0]
        g_lp, g_ent = (grad_or_zeros(g, n, acc, hidden.device) for g in (g_lp, g_ent))
        hf = hidden.to(acc)
        Vr = weight.shape[0] // len(ctx.starts)
        parts = [shard_grads(hf, weight[j * Vr:(j + 1) * Vr], targets - start, ctx.indices[j], ctx.chunk, logz, ent,
                             g_lp, g_ent, *ctx.needs_input_grad[:2]) for j, start in enumerate(ctx.starts)]
        dw = [p[1] for p in parts]
        dw = dw[0] if len(dw) == 1 or dw[0] is None else torch.cat(dw)
        return (*cast_grads(_in_order([p[0] for p in parts]), dw, hidden, weight), None, None, None, None, None)


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
    world = dist.get_world_size(group) if group is not None else 1
    V = int(vocab_size) if vocab_size is not None else weight.shape[0] * world
    targets = checked_targets(targets, hidden.shape[0], V, hidden.device)
    Vr = weight.shape[0] // partitions
    starts = tuple(int(vocab_start) + j * Vr for j in range(partitions))
    indices = [None] * partitions
    if support is not None:
        check_support(support, targets, V)
        indices = [ShardIndex(support, hidden.device, lo, lo + Vr) for lo in starts]
    return _VocabParallel.apply(hidden, weight, targets, starts, indices, int(chunk), group)
