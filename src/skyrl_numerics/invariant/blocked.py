"""Architectures the bitwise path refuses by name, each with exactly what is missing (issue 38).

Empty today. Its last two rows, the hybrids Qwen3-Next (Gated DeltaNet) and Nemotron-H (Mamba-2),
got families (:mod:`.qwen3_next`, :mod:`.nemotron_h`) whose recurrent state the vLLM engine keeps
in its own Mamba state cache (:mod:`skyrl_numerics.engine.vllm_hybrid_state`). What a family
cannot reproduce is refused per config field instead (:func:`.blocks.require`: e.g. Nemotron-H's
``moe`` blocks). An architecture known to run in stock vLLM but to lack a piece on the bitwise
path goes here, with that piece named, so ``batch_invariant=True`` refuses it in one line before
any engine starts.
"""
from __future__ import annotations

# HF architecture -> what is missing for a bitwise family
BLOCKED: dict[str, str] = {}


def blocked_reason(architecture: str) -> str | None:
    """Why the bitwise path refuses ``architecture`` (one line), or None when nothing is known."""
    return BLOCKED.get(architecture)
