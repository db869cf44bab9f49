"""skyrl_numerics.trainer: the vLLM generator, trainer-side logprobs, and (later) the thin RL loop.

Names load lazily so ``import skyrl_numerics.trainer`` does not import vLLM.
"""
from __future__ import annotations

if __name__ != "skyrl_numerics.trainer":  # imported as top-level `trainer` (repo root on sys.path)
    raise ImportError("this folder is the package 'skyrl_numerics.trainer'; import it by that name "
                      "(transformers probes for an unrelated top-level package of this name)")

import importlib

_EXPORTS = {
    "VLLMGenerator": "skyrl_numerics.trainer.generator",
    "get_generator": "skyrl_numerics.trainer.generator",
    "trainer_logprobs": "skyrl_numerics.trainer.logprobs",
    "TrainerLogprobs": "skyrl_numerics.trainer.logprobs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'skyrl_numerics.trainer' has no attribute {name!r}")
