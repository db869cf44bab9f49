"""Where a loop step's old logprobs come from, and the bitwise check that lets the bitwise
configuration skip their recompute.

PPO needs ``log π_old(y_t)``, the policy's logprob of each sampled token at the weights the
rollout was sampled with. Every configuration but ``bitwise`` gets it from a second trainer
forward (the engine's numbers differ from the trainer's). In ``bitwise`` the invariant engine and
the invariant trainer run one forward, so the engine's logprob *is* the trainer's, bit for bit
(mean |Δ| = 0): the loop uses the engine's logprobs as the old logprobs and saves that forward
(cf. NeMo RL's ``force_on_policy_ratio``).

The claim is checked, not assumed:

- every ``recompute_old_every`` steps (:func:`recompute_due`; always at step 0) the trainer
  recomputes them and :func:`check_bitwise` compares the two as IEEE bit patterns
  (``float32.view(uint32)``: ``-0.0 != 0.0``, a NaN equals only the same NaN);
- on every step the update's own forward (the same invariant forward, before the optimizer
  step) is compared the same way, at no extra cost.

A difference raises :class:`~skyrl_numerics.errors.InputError` naming the step, the sequence
(``row``) and the token (``index``, within the sequence's response) of the first differing model
token, with both values and their bits. Multi-turn observation tokens (``loss_mask`` False: the
environment's, NaN in the engine's logprobs) are outside the comparison; in the old logprobs
given to the update they read 0.0 (they are outside its loss, metrics and corrections).
"""
from __future__ import annotations

import numpy as np

from skyrl_numerics.errors import InputError
from skyrl_numerics.rollout import Rollout

#: the default period of the bitwise configuration's checked recompute (step 0 always)
RECOMPUTE_OLD_EVERY = 10


def recompute_due(step: int, every: int) -> bool:
    """Whether step ``step`` recomputes the old logprobs: steps 0, ``every``, ``2·every``, ..."""
    return step % every == 0


def engine_old_logprobs(rollout: Rollout) -> np.ndarray:
    """The engine's logprobs as the update's old logprobs (float32), 0.0 at observation tokens."""
    lp = np.asarray(rollout.rollout_logprobs, dtype=np.float32)
    if rollout.loss_mask is None:
        return lp
    return np.where(np.asarray(rollout.loss_mask, bool), lp, np.float32(0.0))


def first_bit_difference(a, b, mask=None) -> int | None:
    """The flat index of the first element whose float32 bits differ (only where ``mask``),
    else None."""
    ua = np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint32)
    ub = np.ascontiguousarray(b, dtype=np.float32).reshape(-1).view(np.uint32)
    diff = ua != ub
    if mask is not None:
        diff &= np.asarray(mask, bool).reshape(-1)
    hit = np.flatnonzero(diff)
    return int(hit[0]) if hit.size else None


def check_bitwise(trainer_lp, rollout: Rollout, step: int, what: str = "recomputed") -> None:
    """Raise naming step, sequence and token if ``trainer_lp`` differs in any bit from the
    engine's logprobs on a model token (module doc)."""
    engine = np.asarray(rollout.rollout_logprobs, dtype=np.float32)
    trainer = np.asarray(trainer_lp, dtype=np.float32).reshape(-1)
    if trainer.shape != engine.shape:
        raise InputError(f"step {step}: {trainer.size} {what} trainer logprobs for "
                         f"{engine.size} response tokens", field="old_logprobs")
    at = first_bit_difference(trainer, engine, rollout.loss_mask)
    if at is None:
        return
    seq = int(np.searchsorted(rollout.response_cu, at, side="right") - 1)
    tok = at - int(rollout.response_cu[seq])
    n = int((trainer.view(np.uint32) != engine.view(np.uint32))[
        slice(None) if rollout.loss_mask is None else np.asarray(rollout.loss_mask, bool)].sum())
    raise InputError(
        f"step {step}: bitwise config, the {what} trainer logprob of sequence {seq} token {tok} "
        f"is {trainer[at]!r} (0x{int(trainer.view(np.uint32)[at]):08x}), the engine's "
        f"{engine[at]!r} (0x{int(engine.view(np.uint32)[at]):08x}); {n} model token(s) differ — "
        "engine and trainer are not bitwise equal, so the engine's logprobs are not the old "
        "logprobs", row=seq, field="rollout_logprobs", index=tok)
