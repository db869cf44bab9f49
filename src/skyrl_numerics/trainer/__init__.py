"""skyrl_numerics.trainer: the vLLM generator, trainer-side logprobs, the FSDP2 trainer, delta
weight sync into a running engine, the batch-invariant shared model, and the thin RL loop.

Names load lazily so ``import skyrl_numerics.trainer`` does not import vLLM.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "VLLMGenerator": "skyrl_numerics.trainer.engine.generator",
    "get_generator": "skyrl_numerics.trainer.engine.generator",
    "trainer_logprobs": "skyrl_numerics.trainer.logprobs",
    "TrainerLogprobs": "skyrl_numerics.trainer.logprobs",
    "FSDPTrainer": "skyrl_numerics.trainer.fsdp.trainer",
    "TrainerConfig": "skyrl_numerics.trainer.fsdp.trainer",
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
    "DeltaPublisher": "skyrl_numerics.trainer.sync.weight_sync",
    "DeltaReceiver": "skyrl_numerics.trainer.sync.weight_sync",
    "Manifest": "skyrl_numerics.trainer.sync.weight_sync",
    "update_vllm_weights": "skyrl_numerics.trainer.sync.vllm",
    "checkpoint_state_dict": "skyrl_numerics.trainer.sync.vllm",
    "engine_weight_digest": "skyrl_numerics.trainer.sync.vllm",
    "InvariantQwen3Moe": "skyrl_numerics.trainer.invariant.qwen3_moe",
    "InvariantDeepseekV3": "skyrl_numerics.trainer.invariant.deepseek_v3",
    "InvariantTrainer": "skyrl_numerics.trainer.invariant.train",
    "invariant_trainer_logprobs": "skyrl_numerics.trainer.invariant.base",
    "run_loop": "skyrl_numerics.trainer.loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'skyrl_numerics.trainer' has no attribute {name!r}")
