"""The hub's Qwen3.5 checkpoints (``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration``: ``text_config`` + ``vision_config``, weights
``model.language_model.*``, ``model.visual.*``, ``lm_head.*``) on the trainer's invariant path,
text only: built and saved by transformers 5.19's own classes, read by ``from_checkpoint`` as the
text family, with the same logits bit for bit as the text-only checkpoint of the same weights."""
from __future__ import annotations

import json

import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import FAMILIES, from_checkpoint
from skyrl_numerics.invariant.multimodal import TEXT_ARCHITECTURE, text_weight_name
from skyrl_numerics.invariant.qwen3_5 import InvariantQwen3_5, InvariantQwen3_5Moe
from skyrl_numerics.models import tiny_config
from hf_agreement import token_ids

MULTIMODAL = {"qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", InvariantQwen3_5),
              "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                              InvariantQwen3_5Moe)}
# a tiny vision tower (one block) whose output width is the text model's hidden size
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
              patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=16)


def _stored_names(d) -> set:
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return set(f.keys())


def build_pair(root, family: str, dtype: torch.dtype, **text_over):
    """``(hub_dir, text_dir)``: a hub-layout checkpoint saved by transformers' multimodal class,
    and the text-only ``Qwen3_5(Moe)ForCausalLM`` checkpoint of its language model + lm-head
    (``text_over``: text config overrides)."""
    import transformers

    cfg_cls, arch, _ = MULTIMODAL[family]
    text = {k: v for k, v in tiny_config(family, **text_over).items() if k != "architectures"}
    cfg = getattr(transformers, cfg_cls)(text_config=text, vision_config=VISION)
    torch.manual_seed(0)
    mm = getattr(transformers, arch)(cfg).to(dtype)
    hub, txt = root / f"{family}-hub", root / f"{family}-text"
    mm.save_pretrained(str(hub))
    causal = transformers.AutoModelForCausalLM.from_config(cfg.text_config).to(dtype)
    state = {text_weight_name(k): v for k, v in mm.state_dict().items()
             if text_weight_name(k) is not None}
    causal.load_state_dict(state, strict=True)
    causal.save_pretrained(str(txt))
    return hub, txt


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("q35vl")
    return {(f, dt): build_pair(root / str(dt).split(".")[1], f, dt)
            for f in MULTIMODAL for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("family", list(MULTIMODAL))
def test_hub_layout_is_transformers_own(pairs, family):
    hub, txt = pairs[(family, torch.bfloat16)]
    cfg = json.loads((hub / "config.json").read_text())
    assert cfg["architectures"] == [MULTIMODAL[family][1]]
    assert {"text_config", "vision_config"} <= set(cfg)
    names = _stored_names(hub)
    assert "lm_head.weight" in names and "model.language_model.embed_tokens.weight" in names
    assert any(n.startswith("model.visual.") for n in names)
    assert not any(n.startswith("model.layers.") for n in names)
    assert json.loads((txt / "config.json").read_text())["architectures"] == [
        TEXT_ARCHITECTURE[MULTIMODAL[family][1]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(MULTIMODAL))
def test_logits_are_the_text_checkpoints_bit_for_bit(pairs, family, dtype):
    """The hub checkpoint gives the text family (vision tower not loaded) and the same logits,
    every bit, as the text-only checkpoint of the same weights, in the checkpoint's dtype."""
    hub, txt = pairs[(family, dtype)]
    a, b = from_checkpoint(hub, dtype=dtype), from_checkpoint(txt, dtype=dtype)
    assert type(a) is MULTIMODAL[family][2] and type(b) is type(a)
    assert sorted(a.hf_names()) == sorted(b.hf_names())
    ids = token_ids(48, 3)
    with torch.no_grad():
        la, lb = a.logits(a.sequence_hidden(ids)), b.logits(b.sequence_hidden(ids))
    assert la.dtype == lb.dtype and torch.equal(la, lb)
    assert la.float().abs().max() > 0


def test_the_family_is_the_text_architectures():
    for mm, text in TEXT_ARCHITECTURE.items():
        assert FAMILIES[mm] == FAMILIES[text]


def test_a_language_model_weight_the_family_lacks_is_refused(pairs, tmp_path):
    """Only ``model.visual.*`` is skipped: another stray tensor is still an error naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    hub, _ = pairs[("qwen3_5", torch.bfloat16)]
    d = tmp_path / "extra"
    shutil.copytree(hub, d)
    t = load_file(str(d / "model.safetensors"))
    t["model.language_model.layers.0.stray.weight"] = torch.zeros(2)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError) as e:
        from_checkpoint(d)
    assert e.value.field == "model.layers.0.stray.weight"


# M-RoPE as the hub's Qwen3.5 text_config carries it (interleaved sections over the 8 rotated
# frequencies of head_dim 64 x 0.25): for text positions it is plain RoPE
MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                             "mrope_interleaved": True}}


def test_engine_config_is_the_text_model_without_mrope(tmp_path):
    """vLLM's own ModelConfig of the hub checkpoint under the engine's ``hf_overrides``: the
    invariant model's architecture, not multimodal (no vision processor, no torchvision), and its
    text config's M-RoPE sections gone (vLLM merges a nested override key by key: they are set
    to None), so vLLM hands the model plain token positions; the rest of rope_parameters kept."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides
    from skyrl_numerics.engine.vllm_plugin import register

    register()
    hub, _ = build_pair(tmp_path, "qwen3_5_moe", torch.bfloat16, **MROPE)
    raw = json.loads((hub / "config.json").read_text())
    assert raw["text_config"]["rope_parameters"]["mrope_section"] == [3, 3, 2]
    over = engine_overrides(raw)
    mc = ModelConfig(model=str(hub), hf_overrides=over, skip_tokenizer_init=True,
                     dtype="bfloat16")
    assert mc.architectures == ["SkyrlInvariantQwen3_5MoeForConditionalGeneration"]
    assert not mc.is_multimodal_model and not mc.uses_mrope
    rp = mc.hf_text_config.rope_parameters
    assert rp.get("mrope_section") is None and not rp.get("mrope_interleaved")
    assert rp["partial_rotary_factor"] == 0.25 and rp["rope_theta"] == 10000.0
