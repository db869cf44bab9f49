"""Sampler-support replay inside TRL 1.16's GRPO loss, TRL unchanged (docs/integrations.md, "TRL 1.16").

With top-p / top-k the engine draws token ``t`` from ``p(t) / p(S)`` over the set ``S`` its sampler
kept; TRL scores ``log p(t)`` over the whole vocabulary, off by ``log p(S)`` on every token. Replay
renormalises the trainer's logprob over ``S`` with :func:`skyrl_numerics.replay.support_logprobs`
(its one chunked forward and custom backward)::

    logprob_t = z_t / T - logsumexp_{v in S_t} z_v / T      (z = h @ W_lm^T, T = trainer.temperature)

TRL's vLLM path returns no supports, so they come from the user (our ``VLLMGenerator`` /
``skyrl-numerics serve`` capture, or SkyRL's rank-ordered supports through
``replay.skyrl_wire``) and travel in TRL's batch dict as one padded tensor, so TRL's own
``shuffle_sequence_dict`` / ``split_tensor_dict`` permute and split them with their rows:

    ``batch["sampling_support"]``: integer ``[B, C, K]`` (``C`` = the completion width), row
    ``(b, t)`` the ids of completion token ``t`` of sequence ``b``'s support, any order, padded
    with ``-1``; rows at padding (``completion_mask == 0``) are ignored. ``K`` = the largest
    support: ``4 B * B * C * K`` (int32), so a top-p support of thousands of ids costs as much
    per token (:meth:`PackedSupport.dense_mask_nbytes` compares).

Two pieces, in the style of ``integrations.trl.apply_to_batch``::

    class ReplayGRPOTrainer(SupportReplay, GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            add_support(self, batch, supports)   # PackedSupport in completion order, or the tensor
            return batch

- :class:`SupportReplay` (a mixin before ``GRPOTrainer``): while ``_compute_loss`` runs on a batch
  holding ``sampling_support``, ``_get_per_token_logps_and_entropies`` returns the replayed
  logprobs and entropies (:func:`replayed_logps_and_entropies`, same shapes and zeros at padding
  as TRL's), so TRL's ratio, clipping, KL and entropy terms all use them.
- :func:`add_support`: validates and stores the tensor, and recomputes what TRL already computed
  over the full vocabulary from the same batch — ``old_per_token_logps`` (no grad) and, with
  TRL's vLLM importance sampling on, ``importance_sampling_ratio`` (TRL's formula for its mode,
  :func:`~skyrl_numerics.integrations.trl.trl_importance_sampling`, bit for bit), and with TRL's
  KL term (``beta != 0``) ``ref_per_token_logps`` with ``trainer.ref_model`` — and returns the gap
  to the engine's logprobs before and after, to log.

The replayed forward always passes ``position_ids = cumsum(attention_mask) - 1`` (vLLM's
numbering; :func:`~skyrl_numerics.integrations.trl.add_position_ids`), runs the backbone under
TRL's ``accelerator.autocast()`` as TRL does, and the support logprobs outside it in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.gap import measure
from skyrl_numerics.integrations.trl import positions_from_mask, trl_importance_sampling
from skyrl_numerics.replay import PackedSupport, support_logprobs
from skyrl_numerics.trainer.logprobs import decoder_and_head

__all__ = ["SUPPORT_KEY", "support_tensor", "packed_support", "replayed_logps_and_entropies",
           "SupportReplay", "SupportAdded", "add_support"]

#: the batch key that carries the supports (module doc)
SUPPORT_KEY = "sampling_support"


def support_tensor(support: PackedSupport, completion_mask: torch.Tensor) -> torch.Tensor:
    """``[B, C, K]`` int32 (``-1``-padded) from a :class:`PackedSupport` whose rows are the valid
    completion tokens (``completion_mask == 1``) in row-major order, as a rollout holds them."""
    valid = completion_mask.bool()
    n = int(valid.sum())
    if support.num_tokens != n:
        raise InputError(f"{support.num_tokens} support rows for {n} completion tokens", field=SUPPORT_KEY)
    sizes = torch.from_numpy(support.sizes.astype(np.int64))
    k = int(sizes.max()) if n else 1
    rows = torch.full((n, k), -1, dtype=torch.int32)
    col = torch.arange(k)[None, :] < sizes[:, None]
    rows[col] = torch.from_numpy(support.token_ids.astype(np.int32))
    out = torch.full((*valid.shape, k), -1, dtype=torch.int32, device=completion_mask.device)
    out[valid] = rows.to(out.device)
    return out


def _where(valid: torch.Tensor, flat: torch.Tensor, first_row: int) -> dict:
    """``row=`` (the batch row) and ``index=`` (the completion position) of valid entry ``flat``."""
    b, t = valid.nonzero()[int(flat)].tolist()
    return {"row": first_row + b, "index": t}


def packed_support(support: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                   vocab_size: int, *, first_row: int = 0) -> PackedSupport:
    """The valid rows of a ``[B, C, K]`` support tensor as a :class:`PackedSupport` (ids sorted).

    InputError (``field="sampling_support"``; ``row`` = the batch row + ``first_row``, ``index`` =
    the completion position) on a tensor not shaped ``[B, C, K]`` like ``completion_ids``, not of an
    integer dtype, an id outside ``[-1, vocab_size)``, a repeated id, an empty row, or a row not
    holding its own completion token."""
    if not isinstance(support, torch.Tensor) or support.dim() != 3 \
            or tuple(support.shape[:2]) != tuple(completion_ids.shape) or support.shape[2] < 1:
        shape = tuple(support.shape) if isinstance(support, torch.Tensor) else type(support).__name__
        raise InputError(f"expected [B, C, K] = [{completion_ids.shape[0]}, {completion_ids.shape[1]}, K>=1] "
                         f"(the completions' shape), got {shape}", field=SUPPORT_KEY)
    if support.dtype.is_floating_point or support.dtype.is_complex or support.dtype == torch.bool:
        raise InputError(f"expected integer token ids, got {support.dtype}", field=SUPPORT_KEY)
    valid = completion_mask.bool()
    s = support[valid].long().cpu()
    targets = completion_ids[valid].long().cpu()
    bad = ((s < -1) | (s >= vocab_size)).any(1)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        v = int(s[i][(s[i] < -1) | (s[i] >= vocab_size)][0])
        raise InputError(f"token id {v} outside the vocabulary [0, {vocab_size}) (-1 pads)",
                         field=SUPPORT_KEY, **_where(valid, i, first_row))
    srt = torch.where(s < 0, vocab_size, s).sort(1).values       # padding last
    kept = srt < vocab_size
    checks = (((srt[:, 1:] == srt[:, :-1]) & kept[:, 1:]).any(1), "a token id repeated"), \
             (~kept.any(1), "an empty support"), \
             (~(s == targets[:, None]).any(1), "the completion token is not in its own support")
    for fails, what in checks:
        if fails.any():
            i = int(fails.nonzero()[0, 0])
            raise InputError(f"{what} (token {int(targets[i])})", field=SUPPORT_KEY, **_where(valid, i, first_row))
    offsets = np.concatenate([[0], kept.sum(1).cumsum(0).numpy()])
    return PackedSupport(srt[kept].numpy().astype(np.int32), offsets, vocab_size, validate=False)


def _aux_loss(model, router_logits, attention_mask):
    """TRL's MoE load-balancing term: transformers' ``load_balancing_loss_func`` on the backbone's
    router logits, as TRL's fused head calls it."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = model.config.get_text_config()
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts is None:
        raise InputError(f"{cfg.model_type}: no num_experts in the config for TRL's aux loss",
                         field="compute_aux_loss")
    return load_balancing_loss_func(router_logits, experts, cfg.num_experts_per_tok, attention_mask)


def replayed_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep: int,
                                 support: torch.Tensor, *, batch_size: int | None = None,
                                 compute_entropy: bool = False, compute_aux_loss: bool = False,
                                 method: str = "auto"):
    """TRL's ``_get_per_token_logps_and_entropies`` contract with support replay: ``(logps [B, C],
    entropies [B, C] or None, aux_loss or None)``, 0 at padded completion positions, float32.

    ``input_ids`` / ``attention_mask`` ``[B, P + C]`` (TRL's prompt ++ completion), ``C =
    logits_to_keep``, ``support`` the ``[B, C, K]`` tensor (module doc); micro-batches of
    ``batch_size`` rows as TRL's. ``method``: :func:`~skyrl_numerics.replay.support_logprobs`'s."""
    n_rows, width = input_ids.shape
    c = int(logits_to_keep)
    if not 0 < c < width:
        raise InputError(f"logits_to_keep {c} for sequences of {width} tokens", field="logits_to_keep")
    body, weight = decoder_and_head(model)
    vocab = weight.shape[0]
    batch_size = batch_size or n_rows
    lps, ents, auxes = [], [], []
    for s in range(0, n_rows, batch_size):
        ids, mask = input_ids[s:s + batch_size], attention_mask[s:s + batch_size]
        comp, cmask = ids[:, -c:], mask[:, -c:]
        packed = packed_support(support[s:s + batch_size], comp, cmask, vocab, first_row=s)
        extra = {"output_router_logits": True} if compute_aux_loss else {}
        with trainer.accelerator.autocast():
            out = body(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                       use_cache=False, **extra)
        valid = cmask.bool()
        h = out.last_hidden_state[:, -c - 1:-1][valid].to(weight.device)
        lp, ent = support_logprobs(h, weight, comp[valid].to(weight.device), packed, method=method,
                                   temperature=float(getattr(trainer, "temperature", 1.0) or 1.0))
        lps.append(lp.new_zeros(valid.shape).masked_scatter(valid.to(lp.device), lp))
        if compute_entropy:
            ents.append(ent.new_zeros(valid.shape).masked_scatter(valid.to(ent.device), ent))
        if compute_aux_loss:
            auxes.append(_aux_loss(model, out.router_logits, mask))
    return (torch.cat(lps), torch.cat(ents) if compute_entropy else None,
            torch.stack(auxes).mean() if compute_aux_loss else None)


class SupportReplay:
    """Mixin before TRL's ``GRPOTrainer`` (module doc): ``_compute_loss`` on a batch holding
    ``sampling_support`` scores the completions with :func:`replayed_logps_and_entropies`; every
    other call (no support in the batch) is TRL's own. ``support_method``: ``support_logprobs``'s
    ``method``."""

    support_method = "auto"
    active_support = None

    def _compute_loss(self, model, inputs):
        self.active_support = inputs.get(SUPPORT_KEY)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.active_support = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False, **kw):
        if self.active_support is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **kw)
        given = sorted(k for k, v in kw.items() if v is not None)
        if given:
            raise InputError(f"support replay covers text models only; got {', '.join(given)}", field=SUPPORT_KEY)
        return replayed_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                            self.active_support, batch_size=batch_size,
                                            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
                                            method=self.support_method)


@dataclass
class SupportAdded:
    """What :func:`add_support` did; ``metrics`` (``gap/full_vocab_…``, ``gap/replayed_…``: the
    trainer's old logprobs vs ``sampling_per_token_logps`` before and after) is empty without them."""

    support: torch.Tensor
    metrics: dict


def _replayed_no_grad(trainer, model, batch: dict, support: torch.Tensor) -> torch.Tensor:
    """``model``'s replayed logprobs of the batch's completions, no grad, in TRL's micro-batches."""
    ids = batch["completion_ids"]
    input_ids = torch.cat([batch["prompt_ids"], ids], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        lp, _, _ = replayed_logps_and_entropies(trainer, model, input_ids, mask, ids.size(1), support,
                                                batch_size=trainer.args.per_device_train_batch_size,
                                                method=getattr(trainer, "support_method", "auto"))
    return lp


def add_support(trainer, batch: dict, support) -> SupportAdded:
    """Put the supports into ``batch`` (what ``_generate_and_score_completions`` returned, changed in
    place) under ``sampling_support`` and recompute the full-vocabulary quantities TRL derived from
    it (module doc): ``old_per_token_logps``, ``importance_sampling_ratio`` and, with ``beta != 0``,
    ``ref_per_token_logps`` (with ``trainer.ref_model``; a PEFT base reference raises). ``support``: a ``[B, C, K]`` tensor or a :class:`PackedSupport` in completion
    order (:func:`support_tensor`). Every row is validated here (InputError naming the row)."""
    ids, cmask = batch["completion_ids"], batch["completion_mask"]
    if isinstance(support, PackedSupport):
        support = support_tensor(support, cmask)
    vocab = decoder_and_head(trainer.model)[1].shape[0]
    packed_support(support, ids, cmask, vocab)
    batch[SUPPORT_KEY] = support
    metrics = {}
    if batch.get("ref_per_token_logps") is not None:
        if getattr(trainer, "ref_model", None) is None:
            raise InputError("TRL scored it with the PEFT base (no trainer.ref_model); support replay "
                             "recomputes a separate reference model only", field="ref_per_token_logps")
        batch["ref_per_token_logps"] = _replayed_no_grad(trainer, trainer.ref_model, batch, support)
    if batch.get("old_per_token_logps") is not None:
        old = _replayed_no_grad(trainer, trainer.model, batch, support)
        sampled = batch.get("sampling_per_token_logps")
        loss_mask = cmask if batch.get("tool_mask") is None else cmask * batch["tool_mask"]
        if sampled is not None:
            for name, lp in (("full_vocab", batch["old_per_token_logps"]), ("replayed", old)):
                gap = measure(lp, sampled, loss_mask.bool()).summary()
                metrics.update({f"gap/{name}_{k}": float(v) for k, v in gap.items() if isinstance(v, (int, float))})
            if getattr(trainer, "vllm_importance_sampling_correction", False):
                c = trl_importance_sampling(old, sampled, loss_mask, mode=trainer.vllm_importance_sampling_mode,
                                            clip_min=trainer.vllm_importance_sampling_clip_min,
                                            clip_max=trainer.vllm_importance_sampling_clip_max)
                batch["importance_sampling_ratio"] = c.weights.to(old.dtype)
        batch["old_per_token_logps"] = old
    return SupportAdded(support, metrics)
