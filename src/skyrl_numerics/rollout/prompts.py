"""Seeded random token-id prompts: what the doctor, the train loop, the tests and the benchmarks
sample from when the user brings no prompts file."""
from __future__ import annotations

import numpy as np


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``length`` token ids in [2, vocab) (0/1 are bos/eos)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=length).tolist() for _ in range(n)]
