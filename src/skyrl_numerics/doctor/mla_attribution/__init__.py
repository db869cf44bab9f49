"""Attribution of the DeepSeek-V3 trainer–engine gap (docs/mla.md), in three parts:

``hf_forward.py``
    the HF DeepSeek-V3 trainer forward computing one piece the way vLLM does (:func:`vllm_style`
    and the pieces :data:`PIECES`; every patch of transformers, instance-level, removed on exit);
``schedule.py``
    the engine's batch layout as the trainer emulates it (:func:`lockstep_schedule`,
    :func:`recorded_steps`, :func:`cpu_rope_positions`);
``worker.py``
    the vLLM worker parts: the mixins that record the batch layout or fix the engine's rotary
    calls, composed in ``engine/vllm_ext.py`` as ``MLAScheduleExtension``
    (:data:`EXTENSION`) and ``MLARopeFixExtension`` (:data:`ROPE_FIX_EXTENSION`).

The names below are importable from here, as before the split.
"""
from __future__ import annotations

from .hf_forward import (PIECES, absorbed_attention, expanded_attention, vllm_cpu_rope,
                         vllm_style, vllm_style_hook, vllm_style_mla, vllm_style_mlp,
                         vllm_style_moe, vllm_style_router)
from .schedule import cpu_rope_positions, lockstep_schedule, recorded_steps

__all__ = ["vllm_style_mla", "vllm_cpu_rope", "vllm_style_router", "vllm_style_moe",
           "vllm_style_mlp", "vllm_style", "vllm_style_hook", "cpu_rope_positions",
           "lockstep_schedule", "recorded_steps", "absorbed_attention", "expanded_attention",
           "PIECES", "EXTENSION", "ROPE_FIX_EXTENSION"]

EXTENSION = "skyrl_numerics.engine.vllm_ext.MLAScheduleExtension"
ROPE_FIX_EXTENSION = "skyrl_numerics.engine.vllm_ext.MLARopeFixExtension"

