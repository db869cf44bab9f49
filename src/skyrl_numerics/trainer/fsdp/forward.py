"""Differentiable policy forward: a rollout's response-token logprobs with gradient.

A micro-batch of sequences ``rows`` is right-padded to ``[b, S]`` (``p ++ r`` per row, attention
mask 1 on real tokens); the logprob of response token ``r[t]`` is read at position ``P + t - 1``
(see :mod:`skyrl_numerics.trainer.logprobs` for the formula)::

    plain     lp_t = log_softmax(float32(h W^T) / T)[r_t]             token_logprobs_from_hidden
    support   lp_t = z_{r_t} - logsumexp_{v ∈ S_t} z_v,  z = float32(h)/T · W^T   support_logprobs

Outputs are flat, in rollout order (the rows' response tokens back to back).

:class:`PolicyModel` wraps an HF causal LM so that the whole computation (body, hidden-state
gather, chunked lm-head + log-softmax) is one ``forward``: FSDP2 shards it as the root module, so
the embedding, final norm and lm-head weights are all-gathered for exactly this call. The full
``[tokens, vocab]`` logits never exist.

Route replay (R3) forces the rollout's recorded experts: routes row ``routes.cu_seqlens[i] + s``
feeds position ``s`` of sequence ``i`` for ``s < routes.seq_lens[i]``; other positions (padding,
the final sampled token) keep the trainer's own routing.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout

from ..logprobs import decoder_and_head, token_logprobs_from_hidden

__all__ = ["PolicyModel", "MicroBatch", "make_micro_batch", "policy_logprobs", "support_subset"]


def support_subset(support, token_index: np.ndarray):
    """The support rows of response tokens ``token_index`` (any order) as a new PackedSupport."""
    from skyrl_numerics.replay import PackedSupport

    off = support.offsets
    idx = np.asarray(token_index, dtype=np.int64)
    lens = off[idx + 1] - off[idx]
    new_off = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(lens, out=new_off[1:])
    gather = np.repeat(off[idx] - new_off[:-1], lens) + np.arange(int(new_off[-1]), dtype=np.int64)
    return PackedSupport(support.token_ids[gather], new_off, support.vocab_size, validate=False)


@dataclass
class MicroBatch:
    """One padded forward's inputs. ``token_index``: flat indices of its tokens in the rollout."""

    rows: np.ndarray
    input_ids: torch.Tensor       # [b, S] int64
    attention_mask: torch.Tensor  # [b, S] int64
    pos_b: torch.Tensor           # [n] row of each response token in the batch
    pos_t: torch.Tensor           # [n] position whose hidden state predicts it
    targets: torch.Tensor         # [n] the response token ids
    token_index: np.ndarray       # [n] int64 indices into rollout.response_tokens
    cu_seqlens: np.ndarray        # [b+1] local prefix sums of response lengths
    support: object = None        # PackedSupport of the n tokens, or None
    route_index: torch.Tensor | None = None  # [b*S] routes rows (-1: own routing), or None


def _resolve_routes(rollout: Rollout, routes):
    if routes is None or routes is False:
        return None
    if routes is True:
        if rollout.routes is None:
            raise InputError("route replay requested but the rollout has no routes (generate with route capture)",
                             field="routes")
        return rollout.routes
    return routes


def make_micro_batch(rollout: Rollout, rows, *, pad_id: int = 0, use_support: bool = False,
                     routes=None) -> MicroBatch:
    """Pad sequences ``rows`` of ``rollout``; attach their support sets / routes rows if asked."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size == 0:
        raise InputError("empty micro-batch (no rows)", field="rows")
    if rows.min() < 0 or rows.max() >= len(rollout):
        raise InputError(f"row {int(rows.max() if rows.max() >= len(rollout) else rows.min())} out of range "
                         f"[0, {len(rollout)})", field="rows")
    plen, rlen = rollout.prompt_lens[rows], rollout.response_lens[rows]
    width = int((plen + rlen).max())
    b = rows.size
    ids = np.full((b, width), pad_id, dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.int64)
    pos_b, pos_t, tok = [], [], []
    for j, i in enumerate(rows.tolist()):
        seq = np.concatenate([rollout.prompt(i), rollout.response(i)])
        ids[j, :len(seq)] = seq
        mask[j, :len(seq)] = 1
        p, r = int(plen[j]), int(rlen[j])
        pos_b.append(np.full(r, j, dtype=np.int64))
        pos_t.append(np.arange(p - 1, p + r - 1, dtype=np.int64))
        tok.append(np.arange(rollout.response_cu[i], rollout.response_cu[i + 1], dtype=np.int64))
    token_index = np.concatenate(tok)
    cu = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(rlen, out=cu[1:])
    support = None
    if use_support:
        if rollout.support is None:
            raise InputError("use_support=True but the rollout has no support sets (generate with "
                             "capture_support=True)", field="support")
        support = support_subset(rollout.support, token_index)
    route_index = None
    packed = _resolve_routes(rollout, routes)
    if packed is not None:
        if packed.num_seqs != len(rollout):
            raise InputError(f"routes hold {packed.num_seqs} sequences for {len(rollout)} in the rollout",
                             field="routes")
        lens = np.asarray(packed.seq_lens)[rows]
        if (lens > width).any():
            j = int(np.argmax(lens > width))
            raise InputError(f"routes cover {int(lens[j])} positions, the sequence has {int((plen + rlen)[j])}",
                             row=int(rows[j]), field="routes")
        s = np.arange(width, dtype=np.int64)
        ri = np.asarray(packed.cu_seqlens, dtype=np.int64)[rows][:, None] + s[None, :]
        ri[s[None, :] >= lens[:, None]] = -1
        route_index = torch.from_numpy(ri.reshape(-1))
    t = torch.from_numpy
    return MicroBatch(rows, t(ids), t(mask), t(np.concatenate(pos_b)), t(np.concatenate(pos_t)),
                      t(rollout.response_tokens[token_index].astype(np.int64)), token_index, cu, support,
                      route_index)


class PolicyModel(torch.nn.Module):
    """``PolicyModel(hf_causal_lm)(mb, ...) -> (logprobs [n], entropy [n] or None)``, differentiable.

    ``self.lm`` is the wrapped model (its parameter names get the prefix ``lm.``).
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, pos_b, pos_t, targets, *, support=None, routes=None,
                route_index=None, temperature: float = 1.0, token_chunk: int = 1024, with_entropy: bool = True):
        body, weight = decoder_and_head(self.lm)
        dev = weight.device
        input_ids, attention_mask = input_ids.to(dev), attention_mask.to(dev)
        pos_b, pos_t, targets = pos_b.to(dev), pos_t.to(dev), targets.to(dev)
        ctx = contextlib.nullcontext()
        if routes is not None:
            from skyrl_numerics.replay import route_replay

            ctx = route_replay(self.lm, routes, token_index=route_index)
        with ctx:
            hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        h = hidden[pos_b, pos_t]
        if h.shape[0] == 0:  # no response tokens: an empty result still tied to every weight, so
            z = (h @ weight.T).float().sum(-1)  # backward (and FSDP's gradient reduction) runs as usual
            return z, (z if with_entropy else None)
        if support is not None:
            from skyrl_numerics.replay import support_logprobs

            h = h.float()
            if temperature != 1.0:
                h = h / temperature
            lp, ent = support_logprobs(h, weight, targets, support)
            return lp, (ent if with_entropy else None)
        return token_logprobs_from_hidden(h, weight, targets, temperature=temperature, token_chunk=token_chunk,
                                          with_entropy=with_entropy)

    def run(self, mb: MicroBatch, *, routes=None, temperature: float = 1.0, token_chunk: int = 1024,
            with_entropy: bool = True):
        """Forward one :class:`MicroBatch` (``routes``: the PackedRoutes its ``route_index`` points into)."""
        return self(mb.input_ids, mb.attention_mask, mb.pos_b, mb.pos_t, mb.targets, support=mb.support,
                    routes=routes if mb.route_index is not None else None, route_index=mb.route_index,
                    temperature=temperature, token_chunk=token_chunk, with_entropy=with_entropy)


def policy_logprobs(model, rollout: Rollout, *, rows=None, use_support: bool = False, routes=None,
                    temperature: float | None = None, token_chunk: int = 1024, pad_id: int = 0,
                    with_entropy: bool = True):
    """Per-token logprobs (and entropy) of ``rollout``'s response tokens, with gradient.

    ``model``: an HF causal LM or a :class:`PolicyModel`. ``rows``: the sequences to run (default
    all, one padded forward); outputs are flat over those rows' response tokens in the order given.
    ``use_support``: renormalize over ``rollout.support`` (top-p/top-k replay). ``routes``: ``True``
    replays ``rollout.routes``, or pass a PackedRoutes (one sequence per rollout row); None: own
    routing. ``temperature`` defaults to the rollout's sampling temperature.
    Returns float32 ``(logprobs [n], entropy [n] or None)``.
    """
    if temperature is None:
        temperature = float(rollout.sampling.get("temperature", 1.0) or 1.0)
    pm = model if isinstance(model, PolicyModel) else PolicyModel(model)
    rows = np.arange(len(rollout)) if rows is None else rows
    mb = make_micro_batch(rollout, rows, pad_id=pad_id, use_support=use_support, routes=routes)
    return pm.run(mb, routes=_resolve_routes(rollout, routes), temperature=temperature, token_chunk=token_chunk,
                  with_entropy=with_entropy)
