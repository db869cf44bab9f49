"""Router replay and route recording for HF transformers MoE models (forward hooks on the router modules).

``with route_replay(model, routes): model(input_ids)`` makes every MoE router use the recorded expert
indices; the gate weights are recomputed from the trainer's own router logits at those indices with the
family's own renormalization (:mod:`.hf_families`), so the router keeps its gradient. Nothing is patched:
one forward hook per router module, removed on exit.

Which routes row feeds which forward token (the *layout*):

- padded (default): input ``[B, S]``, sequences right-padded, ``B = routes.num_seqs``. Token ``s`` of row ``b``
  uses routes row ``cu[b] + s`` when ``s < routes.seq_lens[b]``; other tokens (the final sampled token,
  padding) keep the trainer's own routing. ``S`` is read from each call, so one context serves forwards of
  any padded length.
- packed (``packed=True``, needs ``seq_lens``): input ``[1, sum(seq_lens)]``, sequences back to back.
- ``token_index``: an explicit ``[num_tokens]`` tensor of routes rows (``-1`` = own routing) for anything else
  (left padding, micro-batch slices).

``seq_lens`` (tokens per sequence in the forward, e.g. ``attention_mask.sum(-1)``) turns on the token-count
check: routes must cover ``n - 1`` (engine capture: the final sampled token never ran) or ``n`` positions.
Layers: the routes' layer axis counts MoE layers only, in model order (DeepSeek's dense first layers
have no router).

``record_routes(model)`` is the inverse: it records what the routers chose, to build :class:`PackedRoutes`
from a trainer forward (tests, or a trainer-side capture), and the weights they gave them
(:meth:`RouteRecorder.gates`, a :class:`PackedGates`).

Gate weights (``weights=``):

- ``"recompute"`` (default): the trainer's own weights at the replayed ids, gathered from its router
  scores with the family's formula (:mod:`.hf_families`). The gather runs over the *full* score row, so
  a replayed expert the trainer's router would not have picked (not in its top-k) still gets its
  gradient, like any chosen one.
- ``"engine"``: the engine's combine weights (``gates``, a :class:`PackedGates` with the routes' rows)
  are the forward's values, so the MoE output is ``Σ w_engine · expert(x)`` as in vLLM. The gradient is
  a straight-through one: ``w = w_engine + (w_trainer - w_trainer.detach())`` -- the added term is
  exactly zero in the forward (``x - x = 0`` for finite ``x``; ``w_engine + 0 = w_engine``), and in the
  backward the router gets the gradient of the recomputed weights (``"recompute"``'s gradient,
  evaluated at the engine's activations). Positions without routes rows (the final sampled token,
  padding) keep the trainer's own routing and weights.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch

from skyrl_numerics.errors import InputError

from .gates import PackedGates
from .hf_families import ROUTER_FAMILIES
from .routes import PackedRoutes, exact_ints

WEIGHT_MODES = ("recompute", "engine")


def find_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, router)`` of every supported MoE router in module order (= layer order)."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in ROUTER_FAMILIES]


def _routers_or_raise(model) -> list[tuple[str, torch.nn.Module]]:
    routers = find_routers(model)
    if not routers:
        names = sorted({type(m).__name__ for _, m in model.named_modules() if "router" in type(m).__name__.lower()
                        or "gate" in type(m).__name__.lower()})
        raise InputError(f"no supported MoE router in {type(model).__name__} (found {names or 'none'}; supported: "
                         f"{sorted(ROUTER_FAMILIES)})", field="model")
    return routers


def _as_lens(seq_lens) -> np.ndarray:
    return exact_ints(seq_lens, "seq_lens").reshape(-1)


def padded_token_index(routes: PackedRoutes, seq_len: int) -> torch.Tensor:
    """``[B * seq_len]`` routes rows for a right-padded ``[B, seq_len]`` forward (``-1`` = own routing)."""
    lens = routes.seq_lens
    if lens.size and lens.max() > seq_len:
        b = int(np.argmax(lens))
        raise InputError(f"routes cover {int(lens[b])} positions of sequence {b}, the forward has only {seq_len}",
                         field="routes", index=b)
    s = np.arange(seq_len, dtype=np.int64)
    idx = routes.cu_seqlens[:-1, None].astype(np.int64) + s[None, :]
    idx[s[None, :] >= lens[:, None]] = -1
    return torch.from_numpy(idx.reshape(-1))


def packed_token_index(routes: PackedRoutes, seq_lens: Sequence[int]) -> torch.Tensor:
    """``[sum(seq_lens)]`` routes rows for sequences packed back to back (``-1`` = own routing)."""
    f = _as_lens(seq_lens)
    _check_counts(routes, f)
    out = np.full(int(f.sum()), -1, dtype=np.int64)
    start = 0
    for b, n in enumerate(f.tolist()):
        m = int(routes.seq_lens[b])
        out[start:start + m] = np.arange(routes.cu_seqlens[b], routes.cu_seqlens[b] + m)
        start += n
    return torch.from_numpy(out)


class _InputShape:
    """Pre-hook on the top model: remembers ``[B, S]`` of the current forward's input_ids / inputs_embeds."""

    def __init__(self):
        self.shape: tuple[int, int] | None = None

    def __call__(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        self.shape = tuple(x.shape[:2]) if isinstance(x, torch.Tensor) and x.ndim >= 2 else None


def _check_counts(routes: PackedRoutes, seq_lens: np.ndarray) -> None:
    if seq_lens.size != routes.num_seqs:
        raise InputError(f"forward has {seq_lens.size} sequences, routes have {routes.num_seqs}", field="seq_lens")
    r = routes.seq_lens
    bad = ~((r == seq_lens) | (r == seq_lens - 1))
    if bad.any():
        b = int(np.argmax(bad))
        raise InputError(f"sequence {b}: routes cover {int(r[b])} positions, forward has {int(seq_lens[b])} tokens "
                         f"(expected {int(seq_lens[b]) - 1} or {int(seq_lens[b])})", field="routes", index=b)


def _check_model(routes: PackedRoutes, routers) -> None:
    if routes.num_layers != len(routers):
        raise InputError(f"routes have {routes.num_layers} layers, the model has {len(routers)} MoE layers",
                         field="layers")
    for layer, (name, r) in enumerate(routers):
        E = getattr(r, ROUTER_FAMILIES[type(r).__name__][1])
        if routes.k != r.top_k:
            raise InputError(f"routes have k={routes.k}, router '{name}' uses top_k={r.top_k}", field="k", index=layer)
        if routes.num_experts != E:
            raise InputError(f"routes are for {routes.num_experts} experts, router '{name}' has {E}",
                             field="num_experts", index=layer)


def check_gates(routes: PackedRoutes, gates: PackedGates | None, weights: str) -> None:
    if weights not in WEIGHT_MODES:
        raise InputError(f"weights={weights!r}, expected one of {WEIGHT_MODES}", field="weights")
    if weights == "engine":
        if gates is None:
            raise InputError("weights='engine' needs the engine's gate weights (gates=PackedGates; generate "
                             "with gate_weights=True)", field="gates")
        gates.check_routes(routes)


def straight_through(value: torch.Tensor, grad_source: torch.Tensor) -> torch.Tensor:
    """``value`` in the forward, ``grad_source``'s gradient in the backward: ``value + (g - g.detach())``
    (the added term is exactly 0 for finite ``g``, so the forward is ``value`` bit for bit)."""
    return value + (grad_source - grad_source.detach())


@contextlib.contextmanager
def route_replay(model: torch.nn.Module, routes: PackedRoutes, *, seq_lens=None, packed: bool = False,
                 token_index: torch.Tensor | None = None, gates: PackedGates | None = None,
                 weights: str = "recompute"):
    """Force the recorded experts in every MoE router of ``model`` inside the ``with`` block; with
    ``weights="engine"`` also the engine's combine weights ``gates`` (see the module docstring)."""
    routers = _routers_or_raise(model)
    _check_model(routes, routers)
    check_gates(routes, gates, weights)
    lens = None if seq_lens is None else _as_lens(seq_lens)
    if lens is not None:
        _check_counts(routes, lens)
    if token_index is None and packed:
        if lens is None:
            raise InputError("packed=True needs seq_lens (tokens per sequence in the forward)", field="seq_lens")
        token_index = packed_token_index(routes, lens)
    values = routes.values  # rows gathered per layer on demand, in numpy (torch lacks uint16 indexing)
    cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    in_shape = _InputShape()

    def rows_for(n: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (n, device, in_shape.shape)  # the padded layout depends on each call's [B, S]
        if key not in cache:
            if token_index is not None:
                ti = torch.from_numpy(exact_ints(token_index, "token_index").reshape(-1))
                if ti.numel() and int(ti.min()) < -1:
                    raise InputError(f"token_index {int(ti.min())}: rows are >= 0, or -1 for the "
                                     "model's own routing", field="token_index",
                                     index=int(torch.argmin(ti)))
                if ti.numel() != n:
                    raise InputError(f"token_index has {ti.numel()} entries, the forward has {n} tokens",
                                     field="token_index")
            else:
                B = routes.num_seqs
                shape = in_shape.shape
                if shape is None or shape[0] * shape[1] != n:
                    raise InputError(f"cannot tell the [B, S] layout of a {n}-token forward (call the model with "
                                     f"input_ids or inputs_embeds, or pass token_index)", field="routes")
                if shape[0] != B:
                    raise InputError(f"forward batch has {shape[0]} sequences, routes have {B} (padded layout)",
                                     field="routes")
                ti = padded_token_index(routes, shape[1])
            if ti.numel() and int(ti.max()) >= routes.num_tokens:
                raise InputError(f"token_index refers to row {int(ti.max())}, routes have {routes.num_tokens}",
                                 field="token_index")
            mask = ti >= 0
            pos = mask.nonzero()[:, 0]
            cache[key] = (mask.to(device), pos.to(device), ti[mask])
        return cache[key]

    def make_hook(layer: int):
        fn = ROUTER_FAMILIES[type(routers[layer][1]).__name__][0]

        def hook(module, args, output):
            logits, scores, idx = output
            mask, pos, rows = rows_for(idx.shape[0], idx.device)
            rec = torch.from_numpy(values[rows.numpy(), layer].astype(np.int64)).to(idx.device, idx.dtype)
            new_idx = idx.clone()
            new_idx[pos] = rec
            w = fn(module, logits, new_idx).to(scores.dtype)
            if weights == "engine":
                eng = torch.from_numpy(gates.rows((rows.numpy(), layer))).to(w.device, w.dtype)
                w_pos = straight_through(eng, w[pos])
                w = w.index_put((pos,), w_pos)
            new_scores = torch.where(mask[:, None], w, scores)
            return logits, new_scores, new_idx

        return hook

    handles = [model.register_forward_pre_hook(in_shape, with_kwargs=True)]
    handles += [m.register_forward_hook(make_hook(i)) for i, (_, m) in enumerate(routers)]
    try:
        yield routes
    finally:
        for h in handles:
            h.remove()


class RouteRecorder:
    """Expert indices each router chose, per forward call: ``calls[c][layer]`` is ``[num_tokens, k]`` int64."""

    def __init__(self, routers):
        self.routers = routers
        self.num_experts = getattr(routers[0][1], ROUTER_FAMILIES[type(routers[0][1]).__name__][1])
        self.calls: list[list[torch.Tensor]] = []
        self.weight_calls: list[list[torch.Tensor]] = []   # float32 [num_tokens, k] per layer, same order
        self.shapes: list[tuple[int, int] | None] = []  # [B, S] of each recorded forward's input
        self._pending: list[torch.Tensor] = []
        self._input = _InputShape()

    def _hook(self, layer: int):
        def hook(module, args, output):
            if layer == 0:
                self._pending, self._pending_w = [], []
            self._pending.append(output[2].detach().to("cpu", torch.int64))
            self._pending_w.append(output[1].detach().to("cpu", torch.float32))
            if layer == len(self.routers) - 1:
                self.calls.append(self._pending)
                self.weight_calls.append(self._pending_w)
                self.shapes.append(self._input.shape)
        return hook

    def routes(self, seq_lens, *, packed: bool = False, drop_last: bool = False, call: int = -1) -> PackedRoutes:
        """PackedRoutes of one recorded forward.

        ``seq_lens``: tokens per sequence in that forward (padded ``[B, S]`` layout unless ``packed``);
        ``drop_last=True`` keeps ``n - 1`` rows per sequence, like an engine capture (see :mod:`.routes`).
        """
        return PackedRoutes.from_sequences(self._per_seq(self.calls, seq_lens, packed, drop_last, call),
                                           self.num_experts)

    def gates(self, seq_lens, *, packed: bool = False, drop_last: bool = False, call: int = -1,
              dtype: str = "float16") -> PackedGates:
        """The weights the routers gave their chosen experts in one recorded forward (rows as :meth:`routes`)."""
        return PackedGates.from_sequences(self._per_seq(self.weight_calls, seq_lens, packed, drop_last, call),
                                          dtype)

    def _per_seq(self, calls, seq_lens, packed: bool, drop_last: bool, call: int) -> list[np.ndarray]:
        if not calls:
            raise InputError("no forward pass was recorded", field="calls")
        layers = calls[call]
        lens = _as_lens(seq_lens)
        n = layers[0].shape[0]
        if packed:
            if int(lens.sum()) != n:
                raise InputError(f"seq_lens sum to {int(lens.sum())}, the forward had {n} tokens", field="seq_lens")
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        else:
            shape = self.shapes[call]
            if shape is not None and shape[0] * shape[1] == n and shape[0] != lens.size:
                raise InputError(f"{lens.size} seq_lens for a recorded batch of {shape[0]} sequences",
                                 field="seq_lens")
            if lens.size == 0 or n % lens.size or lens.max() > n // lens.size:
                raise InputError(f"seq_lens {lens.tolist()} do not fit a padded forward of {n} tokens",
                                 field="seq_lens")
            starts = np.arange(lens.size) * (n // lens.size)
        keep = np.maximum(lens - 1, 0) if drop_last else lens
        stacked = torch.stack(layers, dim=1).numpy()  # [n, L, k]
        return [stacked[s:s + m] for s, m in zip(starts, keep)]


@contextlib.contextmanager
def record_routes(model: torch.nn.Module):
    """Record the experts every MoE router of ``model`` chooses inside the ``with`` block."""
    routers = _routers_or_raise(model)
    rec = RouteRecorder(routers)
    handles = [model.register_forward_pre_hook(rec._input, with_kwargs=True)]
    handles += [m.register_forward_hook(rec._hook(i)) for i, (_, m) in enumerate(routers)]
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()
