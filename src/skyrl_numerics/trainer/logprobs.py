"""Trainer-side logprobs of a rollout's response tokens.

For sequence ``i`` with prompt ``p`` (length P) and response ``r`` (length R), the model runs over
``p ++ r`` and the logprob of ``r[t]`` is read at position ``P + t - 1``::

    z      = h[P+t-1] @ W_lm^T                  (model dtype, as vLLM's lm_head computes it)
    lp_t   = log_softmax(float32(z) / T)[r[t]]   (T = the rollout's sampling temperature)
    H_t    = -Σ_v softmax(float32(z)/T)_v · log softmax(float32(z)/T)_v

The lm-head + softmax runs over chunks of ``token_chunk`` tokens, so at most one
``[token_chunk, vocab]`` fp32 block exists at a time (never ``[tokens, vocab]``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from skyrl_numerics.invariant.base import InvariantCausalLM
from skyrl_numerics.invariant.rollout_forward import entropy_of, response_logps, support_mask
from skyrl_numerics.replay import PackedRoutes
from skyrl_numerics.replay.index_replay import index_modes
from skyrl_numerics.rollout import Rollout


@dataclass
class TrainerLogprobs:
    logprobs: np.ndarray  # float32 [Σ response_len]
    entropy: np.ndarray   # float32 [Σ response_len]
    routes: object = None  # PackedRoutes the trainer's routers chose, where asked for
    index: object = None   # PackedIndex the trainer's DSA attention used, where asked for
    index_mismatch: dict | None = None   # compare_index: rows the own indexer chose differently


def token_logprobs_from_hidden(hidden, lm_head_weight, targets, *, temperature: float = 1.0,
                               token_chunk: int = 1024, with_entropy: bool = True):
    """Logprob (and entropy) of ``targets[j]`` under ``softmax(hidden[j] @ W^T / T)``.

    ``hidden`` [N, H], ``lm_head_weight`` [V, H], ``targets`` [N] (int). Differentiable.
    Returns float32 tensors ``(logprobs [N], entropy [N] or None)``.
    """
    import torch

    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but targets has {targets.shape[0]}")
    lps, ents = [], []
    for s in range(0, hidden.shape[0], token_chunk):
        h = hidden[s:s + token_chunk]
        z = (h @ lm_head_weight.T).float()
        if temperature != 1.0:
            z = z / temperature
        logp = torch.log_softmax(z, dim=-1)
        lps.append(logp.gather(-1, targets[s:s + token_chunk, None].long()).squeeze(-1))
        if with_entropy:
            ents.append(-(logp.exp() * logp).sum(-1))
        del z, logp
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def decoder_and_head(model):
    """The model body (returns hidden states) and the lm-head weight of an HF causal LM."""
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if body is None:
        body = model.get_decoder()
    return body, model.get_output_embeddings().weight


def _support_rows(support, a: int, b: int):
    """The support sets of response tokens ``[a, b)`` as their own PackedSupport (views)."""
    from skyrl_numerics.replay import PackedSupport

    off = support.offsets[a:b + 1]
    return PackedSupport(support.token_ids[off[0]:off[-1]], off - off[0], support.vocab_size,
                         validate=False)


def _route_rows(routes, rows: list[int]):
    """The routes of consecutive sequences ``rows`` as their own PackedRoutes (views)."""
    from skyrl_numerics.replay import PackedRoutes

    cu = routes.cu_seqlens[rows[0]:rows[-1] + 2]
    return PackedRoutes(routes.values[cu[0]:cu[-1]], cu - cu[0], routes.num_experts,
                        validate=False)


def trainer_logprobs(model, rollout: Rollout, *, batch_size: int = 8, token_chunk: int = 1024,
                     temperature: float | None = None, forward_hook: Callable | None = None,
                     pad_id: int = 0, use_support: bool = False,
                     use_routes: bool = False, use_gates: bool = False) -> TrainerLogprobs:
    """Recompute the rollout's response logprobs with ``model`` (HF causal LM), no grad.

    Sequences are batched ``batch_size`` at a time, right-padded with an attention mask.
    ``temperature`` defaults to the rollout's sampling temperature. ``forward_hook(batch_rows)``,
    if given, is a context-manager factory entered around each batch's forward (used by replay
    pieces that need to know which rows are in the batch).

    ``use_support``: renormalize each token's logprob (and entropy) over the support the engine
    sampled from (``rollout.support``, top-p/top-k replay) with
    :func:`skyrl_numerics.replay.support_logprobs` instead of the full vocabulary.

    ``use_routes``: R3 — every MoE router uses the experts the engine chose (``rollout.routes``),
    with gate weights recomputed from the trainer's router logits
    (:func:`skyrl_numerics.replay.route_replay`).

    ``use_gates`` (with ``use_routes``): the engine's combine weights too (``rollout.gates``,
    ``route_replay(..., weights="engine")``: the engine's values forward, the recomputed weights'
    gradient backward).
    """
    import contextlib

    import torch

    if temperature is None:
        temperature = float(rollout.sampling.get("temperature", 1.0) or 1.0)
    if use_support and rollout.support is None:
        from skyrl_numerics.errors import InputError

        raise InputError("use_support=True but the rollout has no support sets (generate with "
                         "capture_support=True)", field="support")
    if use_routes and rollout.routes is None:
        from skyrl_numerics.errors import InputError

        raise InputError("use_routes=True but the rollout has no routes (generate with "
                         "capture_routes=True)", field="routes")
    if use_gates and (not use_routes or rollout.gates is None):
        from skyrl_numerics.errors import InputError

        raise InputError("use_gates=True needs use_routes=True and a rollout with gate weights "
                         "(generate with capture_routes=True and gate_weights=True)", field="gates")
    body, weight = decoder_and_head(model)
    device = weight.device
    out_lp = np.empty(rollout.num_response_tokens, dtype=np.float32)
    out_ent = np.empty(rollout.num_response_tokens, dtype=np.float32)
    with torch.no_grad():
        for start in range(0, len(rollout), batch_size):
            rows = list(range(start, min(start + batch_size, len(rollout))))
            seqs = [np.concatenate([rollout.prompt(i), rollout.response(i)]) for i in rows]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for b, s in enumerate(seqs):
                ids[b, :len(s)] = torch.from_numpy(s.astype(np.int64))
                mask[b, :len(s)] = 1
            stack = contextlib.ExitStack()
            if forward_hook is not None:
                stack.enter_context(forward_hook(rows))
            if use_routes:
                from skyrl_numerics.replay import route_replay

                gates = rollout.gates.seqs(rows[0], rows[-1]) if use_gates else None
                stack.enter_context(route_replay(body, _route_rows(rollout.routes, rows),
                                                 seq_lens=[len(x) for x in seqs], gates=gates,
                                                 weights="engine" if use_gates else "recompute"))
            with stack:
                hidden = body(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            # Gather the positions that predict response tokens, in rollout order.
            pos_b, pos_t, targets = [], [], []
            for b, i in enumerate(rows):
                p, r = int(rollout.prompt_lens[i]), int(rollout.response_lens[i])
                pos_b.append(np.full(r, b))
                pos_t.append(np.arange(p - 1, p + r - 1))
                targets.append(rollout.response(i))
            pb = torch.from_numpy(np.concatenate(pos_b)).to(device)
            pt = torch.from_numpy(np.concatenate(pos_t)).to(device)
            tg = torch.from_numpy(np.concatenate(targets).astype(np.int64)).to(device)
            a, b_ = rollout.response_cu[rows[0]], rollout.response_cu[rows[-1] + 1]
            if use_support:
                from skyrl_numerics.replay import support_logprobs

                h = hidden[pb, pt]
                if temperature != 1.0:
                    h = h.float() / temperature
                lp, ent = support_logprobs(h, weight, tg, _support_rows(rollout.support, a, b_))
            else:
                lp, ent = token_logprobs_from_hidden(hidden[pb, pt], weight, tg,
                                                     temperature=temperature,
                                                     token_chunk=token_chunk)
            out_lp[a:b_] = lp.cpu().numpy()
            out_ent[a:b_] = ent.cpu().numpy()
    return TrainerLogprobs(logprobs=out_lp, entropy=out_ent)


def invariant_trainer_logprobs(model: InvariantCausalLM, rollout, *, batch_size: int = 4,
                               temperature: float | None = None, return_routes: bool = False,
                               use_support: bool = False, use_index: bool = False,
                               compare_index: bool = False, return_index: bool = False):
    """Response-token logprobs with the invariant forward (packed batches, no padding), fp32
    log-softmax of the model-dtype logits at the rollout's temperature — vLLM's processed
    logprobs, computed the same way.

    ``use_support=True`` renormalizes over the support the engine sampled from (the rollout's
    ``support``): logits outside it are set to ``-inf`` before the same log-softmax, as vLLM's
    sampler masks them before computing processed logprobs.

    ``return_routes=True`` also returns the experts the invariant routers chose, as a
    :class:`~skyrl_numerics.replay.PackedRoutes` in the engine's convention (positions
    ``0 .. len(prompt) + len(response) - 2`` of each row), in ``.routes``.

    DeepSeek-V3.2 (DSA; :mod:`skyrl_numerics.replay.index_replay`): ``use_index=True`` attends to
    the keys the engine's indexer chose (``rollout.index``) instead of the trainer's own;
    ``compare_index=True`` also runs the trainer's indexer and counts the rows it chooses
    differently (``.index_mismatch``: ``{"rows", "differ", "per_layer"}``);
    ``return_index=True`` returns the choices the forward used (``.index``, a PackedIndex)."""
    if temperature is None:
        temperature = float(rollout.sampling.get("temperature", 1.0) or 1.0)
    lp_out = np.empty(rollout.num_response_tokens, dtype=np.float32)
    ent_out = np.empty(rollout.num_response_tokens, dtype=np.float32)
    route_rows: list[np.ndarray] = [None] * len(rollout)   # type: ignore[list-item]
    info = model.route_info() if return_routes else None
    mask = support_mask(model, rollout) if use_support else None
    captured: dict[int, torch.Tensor] = {}
    if return_routes:
        model.route_hook = lambda layer, ids: captured.__setitem__(layer, ids.clone())
    with index_modes(model, rollout, replay=use_index, compare=compare_index,
                     record=return_index) as (replayed, recorded), torch.no_grad():
        try:
            for i, logp, tok, off, n_pos, lo in response_logps(
                    model, rollout, batch_size, temperature, mask, before_batch=captured.clear):
                a = int(rollout.response_cu[i]) + lo
                lp_out[a:a + tok.shape[0]] = tok.numpy()
                ent_out[a:a + tok.shape[0]] = entropy_of(logp).numpy()
                if return_routes and lo == 0:
                    route_rows[i] = torch.stack(
                        [captured[m][off:off + n_pos - 1] for m in range(info["layers"])],
                        dim=1).numpy()
        finally:
            model.route_hook = None
    routes = None
    if return_routes:
        routes = PackedRoutes.from_sequences(route_rows, info["num_experts"])
    out = TrainerLogprobs(logprobs=lp_out, entropy=ent_out, routes=routes)
    if recorded is not None:
        out.index = recorded.packed(rollout.prompt_lens + rollout.response_lens)
    if compare_index:
        out.index_mismatch = {"rows": replayed.compared, "differ": replayed.mismatched,
                              "per_layer": dict(replayed.mismatch)}
    return out
