"""The invariant model over a rollout, on the trainer side: packed trainer batches, the one
chunked response-logprob loop (the trainer's logprobs, entropies and supports read it), and the
engine checks that recompute every response position (top-K, full-row digests)."""
from __future__ import annotations

import numpy as np
import torch

from skyrl_numerics.errors import InputError

from .base import InvariantCausalLM


def packed_batches(rollout, batch_size: int):
    """``(rows, seqs)`` per trainer batch: row indices and their prompt+response id tensors."""
    for start in range(0, len(rollout), batch_size):
        rows = list(range(start, min(start + batch_size, len(rollout))))
        yield rows, [torch.from_numpy(np.concatenate([rollout.prompt(i), rollout.response(i)])
                                      .astype(np.int64)) for i in rows]


LOGIT_CHUNK_BYTES = 64 << 20   # float32 logits (and as much log-softmax) held at once per chunk


def logit_row_chunk(vocab: int) -> int:
    """Response rows per chunk of :func:`response_logps`: ``LOGIT_CHUNK_BYTES`` of float32
    logits, at least one row (152k vocab: 110 rows, 64 MiB of logits, as much of logp)."""
    return max(1, LOGIT_CHUNK_BYTES // (4 * max(1, vocab)))


def response_logps(model: InvariantCausalLM, rollout, batch_size: int, temperature: float,
                   mask: torch.Tensor | None = None, before_batch=None):
    """The one packed logprob loop (the engine-side and trainer-side logprobs both read it):
    per chunk of a sequence's response rows ``(i, logp [c, V], token_logprobs [c], offset,
    length, lo)`` — ``logp`` the :func:`response_logp` rows ``lo .. lo + c - 1`` of sequence
    ``i``'s response, ``token_logprobs`` the sampled tokens' entries, ``offset`` the sequence's
    first position in the packed batch. A chunk is :func:`logit_row_chunk` rows (the last one
    of a sequence shorter), so memory stays bounded at any vocabulary and response length; a
    row's logits and log-softmax depend only on the row, so chunking changes no bit (tested).
    ``before_batch()`` runs before each packed forward (e.g. to clear a route capture).
    Autograd follows the caller's mode."""
    step = logit_row_chunk(int(model.w("lm_head.weight").shape[0]))
    for rows, seqs in packed_batches(rollout, batch_size):
        if before_batch is not None:
            before_batch()
        h = model.packed_hidden(seqs)
        off = 0
        for i, s in zip(rows, seqs):
            p, r = int(rollout.prompt_lens[i]), int(rollout.response_lens[i])
            a = int(rollout.response_cu[i])
            tg = torch.from_numpy(rollout.response(i).astype(np.int64))
            for lo in range(0, max(r, 1), step):       # (one empty chunk for r = 0)
                hi = min(r, lo + step)
                logp = response_logp(model, h[off + p - 1 + lo: off + p - 1 + hi], temperature,
                                     None if mask is None else mask[a + lo:a + hi])
                yield i, logp, logp.gather(-1, tg[lo:hi, None]).squeeze(-1), off, len(s), lo
            off += len(s)


def support_mask(model: InvariantCausalLM, rollout) -> torch.Tensor:
    """Dense ``[Σ response_len, vocab]`` bool mask of the rollout's sampled supports."""
    if rollout.support is None:
        raise InputError("use_support=True but the rollout has no support (sample with "
                         "capture_support=True)", field="support")
    from skyrl_numerics.replay.support_lp import dense_mask

    return dense_mask(rollout.support, int(model.w("lm_head.weight").shape[0]), "cpu")


def response_logp(model: InvariantCausalLM, hidden: torch.Tensor, temperature: float,
                  mask_rows: torch.Tensor | None) -> torch.Tensor:
    """fp32 log-softmax of the model-dtype logits at ``temperature``, ``-inf`` outside the
    support rows — vLLM's processed logprobs (its sampler masks before the log-softmax)."""
    z = model.logits(hidden).float()
    if temperature != 1.0:
        z = z / temperature
    if mask_rows is not None:
        z = z.masked_fill(~mask_rows, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)


def invariant_topk(model: InvariantCausalLM, rollout, *, batch_size: int = 4,
                   use_support: bool = False) -> dict:
    """The engine's top-K logprobs (``rollout.topk``) against this forward's log-softmax rows at
    the same ids, position by position (:class:`skyrl_numerics.gap.topk.TopkCheck`): the whole
    distribution, not only the sampled token. ``use_support``: rows masked to the rollout's
    support first, as the engine's processed logprobs are."""
    from skyrl_numerics.gap.topk import TopkCheck

    if rollout.topk is None:
        raise InputError("the rollout has no top-K logprobs (generate with topk_logprobs=K)",
                         field="topk")
    temperature = float(rollout.sampling.get("temperature", 1.0) or 1.0)
    mask = support_mask(model, rollout) if use_support else None
    check = TopkCheck(rollout.topk, mask=rollout.loss_mask)   # multi-turn: model tokens only
    with torch.no_grad():
        for i, logp, _, _, _, lo in response_logps(model, rollout, batch_size, temperature, mask):
            check.add(int(rollout.response_cu[i]) + lo, logp)
    return check.summary()


def invariant_logits_digest(model: InvariantCausalLM, rollout, *, batch_size: int = 4,
                            engine=None) -> dict:
    """The engine's full-vocabulary logits digests (``rollout.logits_digest``) against this
    forward's raw float32 logits rows (``model.logits(h).float()``, before the temperature),
    position by position (:class:`skyrl_numerics.gap.digest.DigestCheck`): ``frac_bitwise`` of
    the response positions whose whole row is bit for bit the engine's, and ``first_mismatch``
    ``{"position", "token_id", ...}``. The token id needs the engine's row, which a digest does
    not carry: with ``engine`` (the ``VLLMGenerator`` that sampled the rollout) that one row is
    recomputed by the engine (:meth:`~skyrl_numerics.engine.generator.VLLMGenerator.
    logits_row`, accepted only if its digest is the recorded one) and the smallest differing id
    is named; otherwise ``token_id`` is None and ``token_id_unknown`` says why."""
    from skyrl_numerics.gap.digest import DigestCheck

    if rollout.logits_digest is None:
        raise InputError("the rollout has no logits digests (generate with logits_digest=True)",
                         field="logits_digest")
    if len(rollout.logits_digest) != rollout.num_response_tokens:
        raise InputError(f"{len(rollout.logits_digest)} digests for "
                         f"{rollout.num_response_tokens} response tokens", field="logits_digest")
    check = DigestCheck(rollout.logits_digest, mask=rollout.loss_mask)   # multi-turn: model tokens
    step = logit_row_chunk(int(model.w("lm_head.weight").shape[0]))
    with torch.no_grad():
        for rows, seqs in packed_batches(rollout, batch_size):
            h = model.packed_hidden(seqs)
            off = 0
            for i, s in zip(rows, seqs):
                p, r = int(rollout.prompt_lens[i]), int(rollout.response_lens[i])
                for lo in range(0, r, step):
                    hi = min(r, lo + step)
                    z = model.logits(h[off + p - 1 + lo: off + p - 1 + hi]).float()
                    check.add(int(rollout.response_cu[i]) + lo, z)
                off += len(s)
    out = check.summary()
    if check.first_mismatch is not None and engine is not None:
        try:
            check.name_token(engine.logits_row(rollout, check.first_mismatch["position"]))
        except Exception as e:   # the figure stands; only the id stays unknown
            check.first_mismatch["token_id_unknown"] = f"{type(e).__name__}: {e}"
        out["first_mismatch"] = check.first_mismatch
    return out
