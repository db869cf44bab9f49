"""The trained tiny models' synthetic task: continue the prompt's last ``period`` tokens cyclically.

Tokenizer-free over the integer vocabulary: a prompt is any ids in ``[2, vocab)`` (0/1 are bos/eos)
of length >= ``period``; the right continuation repeats its last ``period`` tokens::

    prompt  7 93 12 40 | 5 311 2 88          (period 4)
    target              5 311 2 88 5 311 2 88 ...   target[i] = prompt[L - period + i % period]

so every seeded random prompt the doctor and the train loop already draw
(:func:`~skyrl_numerics.rollout.prompts.make_prompts`) is a task prompt, whatever its length. A
model solves it by attending ``period`` tokens back and copying (an induction-like head); a random
model hits ``1 / vocab`` of the tokens.

:func:`reward` is the loop's verifier (``train --reward skyrl_numerics.copy_task:reward``): the
share of a response's tokens equal to the target, one float per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from skyrl_numerics.errors import InputError

#: the period the trained tiny models learn (and the reward checks)
PERIOD = 4


@dataclass(frozen=True)
class CopyBatch:
    """``tokens`` [B, T] int64 (a random prefix, then its cyclic continuation), ``loss_mask``
    [B, T] bool: True where the token is the task's continuation (the prefix is not scored)."""
    tokens: np.ndarray
    loss_mask: np.ndarray


def continuation(prompt, n: int, period: int = PERIOD) -> np.ndarray:
    """The ``n`` target tokens after ``prompt`` (its last ``period`` ids, repeated)."""
    prompt = np.asarray(prompt)
    if len(prompt) < period:
        raise InputError(f"a prompt of {len(prompt)} tokens is shorter than the period {period}",
                         field="prompt")
    tail = prompt[len(prompt) - period:]
    return tail[np.arange(n) % period]


def make_batch(rng: np.random.Generator, batch: int, seq_len: int, vocab: int,
               min_prefix: int = PERIOD, max_prefix: int = 16, period: int = PERIOD) -> CopyBatch:
    """``batch`` training sequences of ``seq_len`` tokens: a random prefix of a length drawn in
    ``[min_prefix, max_prefix]`` (ids in ``[2, vocab)``), then its continuation."""
    lens = rng.integers(min_prefix, max_prefix + 1, size=batch)
    tokens = rng.integers(2, vocab, size=(batch, seq_len))
    mask = np.zeros((batch, seq_len), dtype=bool)
    for b, L in enumerate(lens):
        tokens[b, L:] = continuation(tokens[b, :L], seq_len - L, period)
        mask[b, L:] = True
    return CopyBatch(tokens.astype(np.int64), mask)


def hits(prompt, response, period: int = PERIOD) -> np.ndarray:
    """Per response token: does it equal the task's target?"""
    response = np.asarray(response)
    return response == continuation(prompt, len(response), period)


def reward(rollout) -> np.ndarray:
    """The loop's reward (``--reward skyrl_numerics.copy_task:reward``): per row, the share of
    response tokens equal to the target continuation of its prompt (0 for an empty response)."""
    out = np.zeros(len(rollout), dtype=np.float64)
    for i in range(len(rollout)):
        resp = rollout.response(i)
        if len(resp):
            out[i] = float(hits(rollout.prompt(i), resp).mean())
    return out
