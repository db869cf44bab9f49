"""skyrl_numerics.trainer: trainer-side logprobs, the FSDP2 (``fsdp/``) and megatron-core
(``megatron/``) trainers, the shared PPO step (``ppo_step.py``) and losses, the trainer over the
invariant forward (``invariant_trainer.py``), the thin RL loop (``loop.py``, ``workers.py``) and
the seed recipes (``seed_recipes.py``); every trainer reads one :class:`TrainerConfig` (``config.py``).

The names below are the public entry points, some of them from the packages the trainer drives
(``VLLMGenerator`` is :mod:`skyrl_numerics.engine`'s, ``DeltaPublisher`` :mod:`skyrl_numerics.sync`'s);
they load lazily, so ``import skyrl_numerics.trainer`` does not import vLLM.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "VLLMGenerator": "skyrl_numerics.engine.generator",
    "get_generator": "skyrl_numerics.engine.generator",
    "trainer_logprobs": "skyrl_numerics.trainer.logprobs",
    "TrainerLogprobs": "skyrl_numerics.trainer.logprobs",
    "FSDPTrainer": "skyrl_numerics.trainer.fsdp.trainer",
    "TrainerConfig": "skyrl_numerics.trainer.config",
    "MegatronTrainer": "skyrl_numerics.trainer.megatron.trainer",
    "policy_logprobs": "skyrl_numerics.trainer.fsdp.forward",
    "PolicyModel": "skyrl_numerics.trainer.fsdp.forward",
    "grpo_advantages": "skyrl_numerics.trainer.losses",
    "rloo_advantages": "skyrl_numerics.trainer.losses",
    "ppo_clip_loss": "skyrl_numerics.trainer.losses",
    "kl_estimators": "skyrl_numerics.trainer.losses",
    "save_checkpoint": "skyrl_numerics.trainer.fsdp.checkpoint",
    "load_checkpoint": "skyrl_numerics.trainer.fsdp.checkpoint",
    "apply_lora": "skyrl_numerics.trainer.fsdp.lora",
    "spawn": "skyrl_numerics.trainer.dist",
    "init_distributed": "skyrl_numerics.trainer.dist",
    "DeltaPublisher": "skyrl_numerics.sync.weight_sync",
    "DeltaReceiver": "skyrl_numerics.sync.weight_sync",
    "Manifest": "skyrl_numerics.sync.manifest",
    "update_vllm_weights": "skyrl_numerics.engine.weight_update",
    "checkpoint_state_dict": "skyrl_numerics.engine.weight_update",
    "engine_weight_digest": "skyrl_numerics.engine.weight_update",
    "InvariantQwen3Moe": "skyrl_numerics.invariant.qwen3_moe",
    "InvariantDeepseekV3": "skyrl_numerics.invariant.deepseek_v3",
    "InvariantTrainer": "skyrl_numerics.trainer.invariant_trainer",
    "invariant_trainer_logprobs": "skyrl_numerics.trainer.logprobs",
    "run_loop": "skyrl_numerics.trainer.loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'skyrl_numerics.trainer' has no attribute {name!r}")
