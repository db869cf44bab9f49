"""vLLM general plugin (entry point ``vllm.general_plugins``): registers the batch-invariant
architectures (one per family in ``skyrl_numerics.trainer.invariant.FAMILIES``) in every vLLM
process. Registration is by import path, so nothing heavy is imported until an engine actually
selects one."""


def register() -> None:
    from vllm import ModelRegistry

    from .vllm_invariant_model import ARCHS

    known = ModelRegistry.get_supported_archs()
    for arch in ARCHS.values():
        if arch not in known:
            ModelRegistry.register_model(
                arch, f"skyrl_numerics.trainer.engine.vllm_invariant_model:{arch}")
