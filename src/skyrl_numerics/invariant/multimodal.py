"""A multimodal checkpoint run as its language model, text only.

The Qwen3.5 checkpoints on the hub are ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration`` (transformers 5.19's ``Qwen3_5Config`` /
``Qwen3_5MoeConfig``): the language model's fields sit in ``text_config`` (beside
``vision_config``), its weights are named ``model.language_model.<text name>`` next to the vision
tower's ``model.visual.*``, and ``lm_head.*`` keeps its name. For text tokens the vision tower
never runs, so the text family of :data:`TEXT_ARCHITECTURE` is the whole model:
:func:`text_config` is the config it reads and :func:`text_weight_name` maps a checkpoint tensor
to the text model's name (``None``: a vision-tower tensor, not loaded).
"""
from __future__ import annotations

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


def text_config(cfg):
    """The language model's config of a multimodal ``cfg`` (its ``text_config``, naming the text
    architecture); any other config as it is."""
    if not is_multimodal(cfg):
        return cfg
    sub = getattr(cfg, "text_config", None)
    sub.architectures = [TEXT_ARCHITECTURE[_archs(cfg)[0]]]
    return sub


def text_weight_name(name: str) -> str | None:
    """The text model's name of a multimodal checkpoint tensor: ``model.language_model.X`` ->
    ``model.X``; ``model.visual.*`` -> ``None``; others (``lm_head.*``) unchanged."""
    if name.startswith(VISION_PREFIX):
        return None
    if name.startswith(LANGUAGE_PREFIX):
        return "model." + name[len(LANGUAGE_PREFIX):]
    return name
