"""A multimodal checkpoint run as its language model, text only.

The Qwen3.5 checkpoints on the hub are ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration`` (transformers 5.19's ``Qwen3_5Config`` /
``Qwen3_5MoeConfig``): the language model's fields sit in ``text_config`` (beside
``vision_config``), its weights are named ``model.language_model.<text name>`` next to the vision
tower's ``model.visual.*``, and ``lm_head.*`` keeps its name. For text tokens the vision tower
never runs, so the text family of :data:`TEXT_ARCHITECTURE` is the whole model:
:func:`text_config` is the config it reads and :func:`text_weight_name` maps a checkpoint tensor
to the text model's name (``None``: a vision-tower tensor, not loaded).

``tie_word_embeddings`` is the top level's: transformers' multimodal class ties (and saves no
``lm_head.weight``) by the top-level field whatever ``text_config`` says (checked: top-level
``False`` with ``text_config`` ``True`` keeps and saves a separate lm-head, and the reverse ties).
"""
from __future__ import annotations

import copy

#: multimodal architecture -> the text architecture whose family runs its language model
TEXT_ARCHITECTURE = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
LANGUAGE_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."


def _archs(cfg) -> list:
    got = cfg.get("architectures") if isinstance(cfg, dict) else getattr(cfg, "architectures", None)
    return list(got or [])


def is_multimodal(cfg) -> bool:
    """Whether ``cfg`` (an HF config or ``config.json`` dict) is one of :data:`TEXT_ARCHITECTURE`."""
    archs = _archs(cfg)
    return len(archs) == 1 and archs[0] in TEXT_ARCHITECTURE


def text_config(cfg, arch: str | None = None):
    """The language model's config of a multimodal ``cfg`` (a copy of its ``text_config``, naming
    the text architecture); any other config as it is. ``arch``: the checkpoint's architecture
    where ``cfg`` names another (an engine's config names the invariant model)."""
    arch = arch or (_archs(cfg) or [None])[0]
    if arch not in TEXT_ARCHITECTURE:
        return cfg
    sub = copy.copy(getattr(cfg, "text_config"))
    sub.architectures = [TEXT_ARCHITECTURE[arch]]
    sub.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
    return sub


def text_fields(hf_config: dict) -> dict:
    """:func:`text_config` of a multimodal ``config.json`` dict (any other as it is)."""
    if not is_multimodal(hf_config):
        return hf_config
    return {**hf_config["text_config"], "architectures": [TEXT_ARCHITECTURE[_archs(hf_config)[0]]],
            "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False))}


def nested_overrides(over: dict, text: dict) -> dict:
    """Text-config ``hf_overrides`` (``over``, for a ``config.json`` dict ``text``) as a
    multimodal config's ``{"text_config": ...}``: vLLM merges a nested override into the stored
    dicts key by key, so a key the override drops from a dict field is set to ``None`` instead."""
    nested = {}
    for k, v in over.items():
        old = text.get(k)
        if isinstance(v, dict) and isinstance(old, dict):
            v = {**{kk: None for kk in old if kk not in v}, **v}
        nested[k] = v
    return {"text_config": nested} if nested else {}


def text_weight_name(name: str) -> str | None:
    """The text model's name of a multimodal checkpoint tensor: ``model.language_model.X`` ->
    ``model.X``; ``model.visual.*`` -> ``None``; others (``lm_head.*``) unchanged."""
    if name.startswith(VISION_PREFIX):
        return None
    if name.startswith(LANGUAGE_PREFIX):
        return "model." + name[len(LANGUAGE_PREFIX):]
    return name


def text_weights(hf_config: dict, tensors: dict) -> dict:
    """A checkpoint's ``{name: tensor}`` under the text model's names (vision tower left out)
    when ``hf_config`` (its ``config.json`` dict) is multimodal; as it is otherwise."""
    if not is_multimodal(hf_config):
        return tensors
    return {t: v for n, v in tensors.items() if (t := text_weight_name(n)) is not None}
