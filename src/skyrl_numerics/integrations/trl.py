"""TRL 1.16's ``GRPOTrainer`` with skyrl-numerics, TRL unchanged (docs/integrations.md, "TRL 1.16").

1. **Positions from the attention mask** (:func:`add_position_ids`). TRL left-pads prompts and calls
   ``model(input_ids=, attention_mask=, labels=, fused_lm_head=True)`` with no ``position_ids``, so
   the model numbers tokens ``0 .. L-1`` over the padded row: a prompt's RoPE positions depend on
   the longest prompt of its batch, and neither the batch-invariant mode nor vLLM (which sees no
   padding) can match them. The hook adds ``position_ids = cumsum(attention_mask) - 1`` (1 on
   padding, HF ``generate``'s convention; padding is never attended) to every such call: a forward
   pre-hook on the model object TRL calls, so DDP/compile wrappers around it and TRL's own patched
   ``forward`` (its fused LM head) are untouched. Calls that already carry ``position_ids``, a
   cache (``past_key_values``) or a mask not shaped like the tokens are left as they are.
   With :func:`~skyrl_numerics.kernels.batch_invariant_mode` around the trainer's work, each
   sequence's logprobs and input gradients are then the bits of that sequence alone.

2. **TRL's vLLM importance sampling as our corrections** (:func:`trl_importance_sampling`): the
   four ``vllm_importance_sampling_mode`` values as ``skyrl_numerics.correction`` parts, combined
   with ``order="trl"`` (TRL's float32 arithmetic) and ``denominator="valid"`` (rejected tokens
   keep their place in the loss's denominator, as TRL's ``masked_fill(…, 0)`` does):

   =====================  ======================================================================
   ``token_truncate``     ``token_tis(cap=clip_max, floor=clip_min)``     w_t = clamp(r_t, min, max)
   ``sequence_truncate``  ``sequence_tis(cap=clip_max, floor=clip_min)``  w_i = clamp(Π r, min, max)
   ``token_mask``         ``masked_is(lo=clip_min, hi=clip_max, cap=inf)``  w_t = r_t if min ≤ r_t ≤ max else 0
   ``sequence_mask``      ``sequence_tis(cap=inf) + product_mask(lo, hi)``  w_i = Π r if min ≤ Π r ≤ max else 0
   =====================  ======================================================================

   (a missing ``clip_min`` is no lower bound: ``lo=0``; a missing ``clip_max`` none above: ``inf``).

3. **Our corrections and gap metrics in TRL's loss** (:func:`apply_to_batch`): what a
   ``GRPOTrainer`` subclass calls on the batch its ``_generate_and_score_completions`` returns. TRL's
   ``_compute_loss`` multiplies the per-token loss by ``batch["importance_sampling_ratio"]``, masks
   it with ``completion_mask * batch["tool_mask"]`` and divides by that mask's sum (per sequence for
   "grpo", per batch for "bnpo") or by ``batch["num_items_in_batch"]`` ("dapo", its default; the
   token count of the whole generation batch over every process). This puts a
   :class:`~skyrl_numerics.correction.Correction`'s weights in the first and its ``mask`` in the
   second and third (so tokens the correction rejects leave every denominator, our convention; a
   correction combined with ``denominator="valid"`` keeps them, TRL's), and returns
   ``measure``'s gap summary and the correction's metrics as flat ``{name: float}`` to log::

       class CorrectedGRPOTrainer(GRPOTrainer):
           def _generate_and_score_completions(self, inputs):
               batch = super()._generate_and_score_completions(inputs)
               done = apply_to_batch(self, batch, lambda a, b, m: C.masked_is(a, b, m, lo=0.5, hi=2.0))
               for k, v in done.metrics.items():
                   self._metrics["train" if self.model.training else "eval"][k].append(v)
               return batch
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from skyrl_numerics import correction as C
from skyrl_numerics.errors import InputError
from skyrl_numerics.gap import measure
from skyrl_numerics.kernels import batch_invariant_mode

__all__ = ["add_position_ids", "positions_from_mask", "invariant", "TRL_IS_MODES", "trl_importance_sampling",
           "BatchCorrection", "apply_to_batch"]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``cumsum(mask) - 1`` on attended tokens, 1 on padding (``[B, L]`` int64): a token's position
    is the number of attended tokens before it, as vLLM numbers the unpadded sequence."""
    m = attention_mask.long()
    return (m.cumsum(-1) - 1).masked_fill(m == 0, 1)


def _hook(module, args, kwargs):
    """Forward pre-hook: add ``position_ids`` from a 2-D attention mask shaped like the tokens."""
    mask = kwargs.get("attention_mask")
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None and kwargs.get("inputs_embeds") is not None:
        tokens = kwargs["inputs_embeds"][..., 0]
    if (kwargs.get("position_ids") is not None or kwargs.get("past_key_values") is not None
            or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tokens is None
            or tuple(tokens.shape[:2]) != tuple(mask.shape)):
        return None
    return args, {**kwargs, "position_ids": positions_from_mask(mask)}


def add_position_ids(model: torch.nn.Module):
    """Give every call of ``model`` without ``position_ids`` the positions of its attention mask
    (module doc, point 1). Returns the hook's handle (``handle.remove()`` undoes it)."""
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"expected a torch.nn.Module (the trainer's model), got {type(model).__name__}",
                         field="model")
    return model.register_forward_pre_hook(_hook, with_kwargs=True)


@contextmanager
def invariant(trainer, *, strict: bool | None = None):
    """``with invariant(trainer): trainer.train()``: :func:`add_position_ids` on ``trainer.model``
    (and ``trainer.ref_model`` when there is one) inside ``batch_invariant_mode(strict=strict)``;
    both undone on exit. ``strict=None``: the mode's default (``SKYRL_NUMERICS_MODE_STRICT``)."""
    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
    handles = [add_position_ids(m) for m in models]
    try:
        with batch_invariant_mode(strict=strict):
            yield trainer
    finally:
        for h in handles:
            h.remove()


#: TRL's ``vllm_importance_sampling_mode`` values (module doc, point 2)
TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_importance_sampling(trainer_logprobs, rollout_logprobs, mask, *, mode: str = "sequence_mask",
                            clip_min: float | None = None, clip_max: float | None = 3.0) -> C.Correction:
    """TRL 1.16's vLLM IS ratio for ``mode`` (``GRPOConfig`` names and defaults) as a Correction:
    ``weights`` are TRL's ``importance_sampling_ratio`` bit for bit on the valid tokens, ``mask``
    is the input mask (TRL's denominator), ``metrics`` ours. Padded ``[B, T]`` as TRL holds them."""
    if mode not in TRL_IS_MODES:
        raise InputError(f"mode {mode!r}, expected one of {TRL_IS_MODES}", field="vllm_importance_sampling_mode")
    a, b = trainer_logprobs, rollout_logprobs
    top = math.inf if clip_max is None else clip_max
    low = 0.0 if clip_min is None else clip_min
    if mode == "token_truncate":
        parts = [C.token_tis(a, b, mask, cap=top, floor=clip_min)]
    elif mode == "sequence_truncate":
        parts = [C.sequence_tis(a, b, mask, cap=top, floor=clip_min)]
    elif mode == "token_mask":
        parts = [C.masked_is(a, b, mask, lo=low, hi=top, cap=math.inf)]
    else:
        parts = [C.sequence_tis(a, b, mask, cap=math.inf), C.product_mask(a, b, mask, lo=low, hi=top)]
    return C.combine(*parts, order="trl", denominator="valid")


@dataclass
class BatchCorrection:
    """What :func:`apply_to_batch` did: the correction and the numbers to log (``gap/…`` from
    :func:`~skyrl_numerics.gap.measure`'s summary, ``correction/…`` from the correction)."""

    correction: C.Correction
    metrics: dict


def _loss_mask(batch: dict) -> torch.Tensor:
    mask = batch["completion_mask"]
    return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]


def apply_to_batch(trainer, batch: dict, make) -> BatchCorrection:
    """Replace TRL's vLLM IS ratio in ``batch`` (what ``trainer._generate_and_score_completions``
    returned, changed in place) by ``make(trainer_logprobs, rollout_logprobs, mask) -> Correction``
    (module doc, point 3). Needs the two logprob tensors TRL keeps when ``use_vllm`` and
    ``vllm_importance_sampling_correction`` are on: ``old_per_token_logps`` (the trainer's) and
    ``sampling_per_token_logps`` (vLLM's). ``trainer.accelerator.gather`` sums the new token count
    over the processes, as TRL counted the old one."""
    for key in ("old_per_token_logps", "sampling_per_token_logps", "completion_mask"):
        if batch.get(key) is None:
            raise InputError("missing: TRL keeps it only with use_vllm=True and "
                             "vllm_importance_sampling_correction=True", field=key)
    mask = _loss_mask(batch)
    train, roll = batch["old_per_token_logps"], batch["sampling_per_token_logps"]
    c = make(train, roll, mask)
    if not isinstance(c, C.Correction):
        raise InputError(f"make returned {type(c).__name__}, expected a Correction", field="make")
    keep = torch.as_tensor(c.mask, device=mask.device)
    if keep.shape != mask.shape:
        raise InputError(f"correction mask of shape {tuple(keep.shape)}, expected {tuple(mask.shape)}",
                         field="make")
    batch["importance_sampling_ratio"] = torch.as_tensor(c.weights, device=train.device).to(train.dtype)
    old_tool = batch.get("tool_mask")
    batch["tool_mask"] = keep.to(mask.dtype) if old_tool is None else old_tool * keep.to(old_tool.dtype)
    kept = _loss_mask(batch).sum()
    batch["num_items_in_batch"] = trainer.accelerator.gather(kept).sum()
    gap = measure(train, roll, mask.bool()).summary()
    metrics = {f"gap/{k}": float(v) for k, v in gap.items() if isinstance(v, (int, float))}
    metrics.update({f"correction/{k}": float(v) for k, v in c.metrics.items()})
    return BatchCorrection(c, metrics)
