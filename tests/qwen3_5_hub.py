"""Tiny hub-layout Qwen3.5 checkpoints (``Qwen3_5(Moe)ForConditionalGeneration``: text_config +
vision_config, ``model.language_model.*`` / ``model.visual.*`` / ``lm_head.*``) saved by
transformers' own multimodal classes, each with its text-only twin of the same weights."""
from __future__ import annotations

import torch

from skyrl_numerics.invariant.multimodal import text_weight_name
from skyrl_numerics.invariant.qwen3_5 import InvariantQwen3_5, InvariantQwen3_5Moe
from skyrl_numerics.models import tiny_config

MULTIMODAL = {"qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", InvariantQwen3_5),
              "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                              InvariantQwen3_5Moe)}
# a tiny vision tower (one block) whose output width is the text model's hidden size
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
              patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=16)


def build_pair(root, family: str, dtype: torch.dtype, **text_over):
    """``(hub_dir, text_dir)``: a hub-layout checkpoint saved by transformers' multimodal class,
    and the text-only ``Qwen3_5(Moe)ForCausalLM`` checkpoint of its language model + lm-head
    (``text_over``: text config overrides)."""
    import transformers

    cfg_cls, arch, _ = MULTIMODAL[family]
    text = {k: v for k, v in tiny_config(family, **text_over).items() if k != "architectures"}
    # transformers' multimodal class ties by the top-level field (invariant/multimodal.py)
    cfg = getattr(transformers, cfg_cls)(text_config=text, vision_config=VISION,
                                         tie_word_embeddings=bool(text.get("tie_word_embeddings")))
    torch.manual_seed(0)
    mm = getattr(transformers, arch)(cfg).to(dtype)
    hub, txt = root / f"{family}-hub", root / f"{family}-text"
    mm.save_pretrained(str(hub))
    causal = transformers.AutoModelForCausalLM.from_config(cfg.text_config).to(dtype)
    state = {text_weight_name(k): v for k, v in mm.state_dict().items()
             if text_weight_name(k) is not None}
    causal.load_state_dict(state, strict=True)
    assert torch.equal(causal.lm_head.weight, mm.lm_head.weight)
    causal.save_pretrained(str(txt))
    return hub, txt


# M-RoPE as the hub's Qwen3.5 text_config carries it (interleaved sections over the 8 rotated
# frequencies of head_dim 64 x 0.25): for text positions it is plain RoPE
MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                             "mrope_interleaved": True}}
