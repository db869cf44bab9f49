"""PackedRoutes <-> megatron-core's RouterReplay (``moe_enable_routing_replay=True``, megatron-core >= 0.16).

megatron-core ships the replay mechanism itself: each ``TopKRouter`` owns a ``RouterReplay`` instance
(registered, in construction order = MoE layer order, in ``RouterReplay.global_router_replay_instances``);
under ``REPLAY_FORWARD`` its top-k takes the given indices and gathers the probabilities at them from the
router's own scores (softmax / sigmoid + expert bias + group limit only pick experts), so the router keeps
its gradient. What it needs from us is one ``[num_tokens, k]`` index tensor per MoE layer **in Megatron's
token order**:

- ``sbhd`` (default): hidden states ``[S, B, H]`` flattened, token ``s * B + b`` = position ``s`` of sequence ``b``.
- ``thd`` (packed sequences): sequences back to back, ``packed_seq_lens`` tokens each.

Megatron's replay has no per-token fallback to the router, so positions the routes do not cover (the
final sampled token under the engine convention of :mod:`.routes`, padding) get a filler: the last
recorded row of the same sequence (expert ids ``0..k-1`` for a sequence without rows). This changes no
logprob the trainer uses: the final position's logits predict no token and padding is masked; by
causality neither feeds back into covered positions.

With activation recomputation, Megatron pops the indices again under ``REPLAY_BACKWARD``:
:func:`megatron_route_replay` appends each layer's indices once per forward it is entered for.

Sequence parallelism (megatron-core's ``sequence_parallel=True``, needed with MoE + TP): TP rank ``r`` of
``tp`` routes only its block of the sequence dimension, tokens ``[r S/tp, (r+1) S/tp) x B`` of the sbhd
order; pass ``tp_rank`` / ``tp_size`` and each rank gets its block (and :meth:`MegatronRecording.gather`
puts the ranks' recorded blocks back in order).
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch

from skyrl_numerics.errors import InputError

from .gates import PackedGates
from .hf_replay import check_gates, straight_through
from .routes import PackedRoutes


def _filled_rows(routes: PackedRoutes, b: int, n: int) -> np.ndarray:
    """Row ids (into ``routes.values``) for ``n`` forward positions of sequence ``b``; ``-1`` = no rows at all."""
    m = int(routes.seq_lens[b])
    if m > n:
        raise InputError(f"sequence {b}: routes cover {m} positions, the forward has {n}", field="routes", index=b)
    start = int(routes.cu_seqlens[b])
    rows = np.full(n, start + m - 1 if m else -1, dtype=np.int64)
    rows[:m] = np.arange(start, start + m)
    return rows


def megatron_token_rows(routes: PackedRoutes, *, seq_len: int | None = None,
                        packed_seq_lens: Sequence[int] | None = None, tp_rank: int = 0,
                        tp_size: int = 1) -> np.ndarray:
    """``[num_tokens]`` routes rows in Megatron token order (this rank's block under sequence
    parallelism); filler positions get their sequence's last row, ``-1`` a sequence without rows."""
    if (seq_len is None) == (packed_seq_lens is None):
        raise InputError("give exactly one of seq_len (sbhd) or packed_seq_lens (thd)", field="layout")
    if not (isinstance(tp_size, int) and tp_size >= 1 and isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise InputError(f"tp_rank={tp_rank!r} is not in [0, tp_size={tp_size!r})", field="tp_rank")
    if tp_size > 1:
        if packed_seq_lens is not None:
            raise InputError("sequence-parallel replay is implemented for the sbhd layout only", field="layout")
        if int(seq_len) % tp_size:
            raise InputError(f"seq_len={seq_len} is not divisible by tp_size={tp_size} (sequence parallel)",
                             field="seq_len")
    B = routes.num_seqs
    if packed_seq_lens is not None:
        f = np.asarray(packed_seq_lens, dtype=np.int64).reshape(-1)
        if f.size != B:
            raise InputError(f"{f.size} packed sequences, routes have {B}", field="packed_seq_lens")
        rows = np.concatenate([_filled_rows(routes, b, int(f[b])) for b in range(B)]) if B else np.zeros(0, np.int64)
    else:
        rows = np.stack([_filled_rows(routes, b, int(seq_len)) for b in range(B)], axis=1).reshape(-1)  # [S*B]
    if tp_size > 1:
        block = int(seq_len) // tp_size * B
        rows = rows[tp_rank * block:(tp_rank + 1) * block]
    return rows


def megatron_replay_indices(routes: PackedRoutes, *, seq_len: int | None = None,
                            packed_seq_lens: Sequence[int] | None = None, tp_rank: int = 0,
                            tp_size: int = 1) -> list[torch.Tensor]:
    """Per MoE layer, ``[num_tokens, k]`` int64 expert indices in Megatron token order.

    Give ``seq_len`` for the ``[S, B]`` (sbhd) layout or ``packed_seq_lens`` for packed (thd) sequences.
    ``tp_rank`` / ``tp_size``: under sequence parallelism (sbhd only), this rank's block of the sequence.
    """
    rows = megatron_token_rows(routes, seq_len=seq_len, packed_seq_lens=packed_seq_lens, tp_rank=tp_rank,
                               tp_size=tp_size)
    default = np.arange(routes.k, dtype=np.int64)
    out = []
    for layer in range(routes.num_layers):
        ids = np.empty((rows.size, routes.k), dtype=np.int64)
        have = rows >= 0
        ids[have] = routes.values[rows[have], layer]
        ids[~have] = default
        out.append(torch.from_numpy(ids))
    return out


def _engine_routing(router, original, idx: torch.Tensor, weights: torch.Tensor, have: torch.Tensor):
    """``router.routing`` with the engine's combine weights at the replayed experts: the dense
    ``probs`` keep their value where the token has no routes row, else the engine's weight forward
    and the trainer's gathered prob's gradient backward (:func:`.hf_replay.straight_through`)."""
    def routing(logits, padding_mask=None):
        probs, rmap = original(logits, padding_mask=padding_mask)
        dense = torch.zeros_like(probs).scatter(1, idx.to(probs.device), weights.to(probs.device, probs.dtype))
        engine = straight_through(dense, probs)
        use = have.to(probs.device)[:, None] & rmap
        return torch.where(use, engine, probs), rmap
    return routing


def _replay_api():
    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise InputError(f"megatron-core with router_replay is not importable ({e})", field="megatron") from e
    return RouterReplay, RouterReplayAction


def _instances(RouterReplay, num_layers: int):
    inst = RouterReplay.global_router_replay_instances
    if not inst:
        raise InputError("no RouterReplay instances: build the model with moe_enable_routing_replay=True",
                         field="megatron")
    if len(inst) != num_layers:
        raise InputError(f"routes have {num_layers} layers, the model has {len(inst)} MoE routers", field="layers")
    return inst


@contextlib.contextmanager
def megatron_route_replay(routes: PackedRoutes, *, seq_len: int | None = None,
                          packed_seq_lens: Sequence[int] | None = None, device=None, tp_rank: int = 0,
                          tp_size: int = 1, gates: PackedGates | None = None, weights: str = "recompute",
                          routers: Sequence[torch.nn.Module] | None = None):
    """Replay ``routes`` in every megatron-core TopKRouter inside the ``with`` block (REPLAY_FORWARD).

    ``tp_rank`` / ``tp_size``: this rank's sequence block under sequence parallelism (see the module doc).
    ``weights="engine"``: the engine's combine weights ``gates`` replace the gathered probs at the replayed
    experts (straight-through, as :func:`.hf_replay.route_replay`); needs the model's ``TopKRouter`` modules
    in MoE layer order (``routers``), whose ``routing`` is wrapped per instance inside the block.
    """
    RouterReplay, Action = _replay_api()
    _instances(RouterReplay, routes.num_layers)
    check_gates(routes, gates, weights)
    per_layer = megatron_replay_indices(routes, seq_len=seq_len, packed_seq_lens=packed_seq_lens,
                                        tp_rank=tp_rank, tp_size=tp_size)
    if device is not None:
        per_layer = [t.to(device) for t in per_layer]
    undo = []
    if weights == "engine":
        if routers is None or len(routers) != routes.num_layers:
            raise InputError(f"weights='engine' needs the model's {routes.num_layers} TopKRouter modules "
                             f"(routers=, MoE layer order), got {None if routers is None else len(routers)}",
                             field="routers")
        rows = megatron_token_rows(routes, seq_len=seq_len, packed_seq_lens=packed_seq_lens, tp_rank=tp_rank,
                                   tp_size=tp_size)
        have = torch.from_numpy(rows >= 0)
        safe = np.where(rows >= 0, rows, 0)
        for layer, r in enumerate(routers):
            w = torch.from_numpy(gates.rows((safe, layer)))
            r.routing = _engine_routing(r, r.routing, per_layer[layer], w, have)
            undo.append(r)
    RouterReplay.set_replay_data(per_layer)
    RouterReplay.set_global_router_replay_action(Action.REPLAY_FORWARD)
    try:
        yield per_layer
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        for r in undo:
            r.__dict__.pop("routing", None)


class MegatronRecording:
    """Filled on exit of :func:`megatron_record_routes`: ``indices[layer]`` is ``[num_tokens, k]``."""

    def __init__(self):
        self.indices: list[torch.Tensor] = []

    def gather(self, group=None) -> "MegatronRecording":
        """Sequence parallelism: all-gather the TP ranks' recorded blocks (in rank order) along the token
        dimension, so ``indices[layer]`` covers the whole ``[S * B]`` sbhd order (collective over ``group``)."""
        import torch.distributed as dist

        if group is None or dist.get_world_size(group) == 1:
            return self
        out = MegatronRecording()
        for t in self.indices:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            out.indices.append(torch.cat(parts))
        return out

    def routes(self, num_experts: int, *, seq_lens: Sequence[int], seq_len: int | None = None,
               packed: bool = False, drop_last: bool = False) -> PackedRoutes:
        """PackedRoutes from the recorded Megatron-order indices (sbhd ``[S, B]`` unless ``packed``)."""
        if not self.indices:
            raise InputError("nothing recorded", field="indices")
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        stacked = torch.stack([t.detach().to("cpu", torch.int64) for t in self.indices], dim=1).numpy()  # [N, L, k]
        keep = np.maximum(lens - 1, 0) if drop_last else lens
        if packed:
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            seqs = [stacked[s:s + m] for s, m in zip(starts, keep)]
        else:
            S = stacked.shape[0] // max(lens.size, 1) if seq_len is None else int(seq_len)
            if S * lens.size != stacked.shape[0]:
                raise InputError(f"{stacked.shape[0]} recorded tokens are not [S, B={lens.size}]", field="seq_lens")
            grid = stacked.reshape(S, lens.size, *stacked.shape[1:])
            seqs = [grid[:m, b] for b, m in enumerate(keep)]
        return PackedRoutes.from_sequences(seqs, num_experts)


@contextlib.contextmanager
def megatron_record_routes():
    """Record the indices every megatron-core TopKRouter chooses (RECORD action) inside the block."""
    RouterReplay, Action = _replay_api()
    if not RouterReplay.global_router_replay_instances:
        raise InputError("no RouterReplay instances: build the model with moe_enable_routing_replay=True",
                         field="megatron")
    rec = MegatronRecording()
    RouterReplay.set_global_router_replay_action(Action.RECORD)
    try:
        yield rec
        rec.indices = [t for t in RouterReplay.get_recorded_data()]
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
