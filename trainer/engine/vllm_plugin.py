"""vLLM general plugin (entry point ``vllm.general_plugins``): registers the batch-invariant
Qwen3-MoE architecture in every vLLM process. Registration is by import path, so nothing heavy is
imported until an engine actually selects the architecture."""


def register() -> None:
    from vllm import ModelRegistry

    from .vllm_invariant_model import ARCH

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(
            ARCH, "skyrl_numerics.trainer.engine.vllm_invariant_model:SkyrlInvariantQwen3MoeForCausalLM")
