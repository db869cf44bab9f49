"""The batch-invariant forward that the trainer and vLLM both run: shared blocks (``blocks``),
the KV-cache row formats (``kv_format``), the family contract (``base``) and one short module
per family (the dense decoders share ``dense``; attention shared by GQA families in
``gqa``). The registry maps a checkpoint's HF architecture to its family.

Adding a family (about a page): subclass :class:`~.base.InvariantCausalLM` in ``<family>.py``
with its parameters under the HF names, ``forward_tokens`` built from :mod:`.blocks`,
``attn_core`` (what attention does with a cache row) and a :class:`~.kv_format.KVFormat`
describing that row; reject config fields it cannot reproduce with :func:`.blocks.require`;
register it in ``FAMILIES`` below and its vLLM architecture in
``skyrl_numerics.engine.vllm_invariant_model``.
"""
from __future__ import annotations

import importlib

from skyrl_numerics.errors import InputError

from .multimodal import TEXT_ARCHITECTURE

# HF architecture -> (family, "module:Class")
FAMILIES = {
    "Qwen3MoeForCausalLM": ("qwen3_moe", "skyrl_numerics.invariant.qwen3_moe:InvariantQwen3Moe"),
    "DeepseekV3ForCausalLM": ("deepseek_v3",
                              "skyrl_numerics.invariant.deepseek_v3:InvariantDeepseekV3"),
    "DeepseekV32ForCausalLM": ("deepseek_v32",
                               "skyrl_numerics.invariant.deepseek_v32:InvariantDeepseekV32"),
    "GptOssForCausalLM": ("gpt_oss", "skyrl_numerics.invariant.gpt_oss:InvariantGptOss"),
    **{arch: ("dense", "skyrl_numerics.invariant.dense:InvariantDense")
       for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
                    "MistralForCausalLM")},
    "MixtralForCausalLM": ("mixtral", "skyrl_numerics.invariant.mixtral:InvariantMixtral"),
    "Glm4MoeForCausalLM": ("glm4_moe", "skyrl_numerics.invariant.glm4_moe:InvariantGlm4Moe"),
    "Qwen3NextForCausalLM": ("qwen3_next",
                             "skyrl_numerics.invariant.qwen3_next:InvariantQwen3Next"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "skyrl_numerics.invariant.qwen3_5:InvariantQwen3_5"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "skyrl_numerics.invariant.qwen3_5:InvariantQwen3_5Moe"),
    "NemotronHForCausalLM": ("nemotron_h",
                             "skyrl_numerics.invariant.nemotron_h:InvariantNemotronH"),
}
# a multimodal checkpoint run text only: its language model's family (.multimodal)
FAMILIES.update({mm: FAMILIES[text] for mm, text in TEXT_ARCHITECTURE.items()})


def family_class(architecture: str):
    """The invariant class for an HF architecture name; an error naming it when unsupported."""
    if architecture not in FAMILIES:
        raise InputError(unsupported_message(architecture), field="architectures")
    mod, cls = FAMILIES[architecture][1].split(":")
    return getattr(importlib.import_module(mod), cls)


def unsupported_message(architecture) -> str:
    """The one-line refusal for an architecture without a family: what is missing where it is
    known (:mod:`.blocked`), else the supported list."""
    from .blocked import blocked_reason

    why = blocked_reason(architecture) if isinstance(architecture, str) else None
    return (f"no batch-invariant family for architecture {architecture!r}: "
            + (why or f"supported: {sorted(FAMILIES)}"))


def architecture_of(cfg) -> str:
    archs = list(getattr(cfg, "architectures", None) or [])
    # an engine built with the invariant override keeps the original name in skyrl_base_arch
    base = getattr(cfg, "skyrl_base_arch", None)
    if base:
        return base
    if len(archs) != 1:
        raise InputError(f"expected one architecture in the config, got {archs}", field="architectures")
    return archs[0]


def from_checkpoint(model_dir, *, kv_cache=None, dtype=None, numerics=None):
    """The invariant model of any supported checkpoint (family picked from its config);
    ``numerics``: a :class:`.numerics.NumericsPlan` (quantized serving formats, LoRA)."""
    import torch
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    cls = family_class(architecture_of(cfg))
    return cls.from_checkpoint(model_dir, kv_cache=kv_cache, dtype=dtype or torch.bfloat16,
                               numerics=numerics)

