"""Tiny checkpoints: cached by config hash, deterministic, loadable in HF transformers."""
from __future__ import annotations

import json

import pytest
import torch

from skyrl_numerics.models import build_tiny_model, load_hf_model, tiny_config


def test_cache_by_config_hash(tmp_path):
    a = build_tiny_model("qwen3_moe", cache_dir=tmp_path, num_hidden_layers=1)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model("qwen3_moe", cache_dir=tmp_path, num_hidden_layers=1) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    b = build_tiny_model("qwen3_moe", cache_dir=tmp_path, num_hidden_layers=1, seed=1)
    assert b != a
    # no temp dirs left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.name, b.name])


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = load_hf_model(build_tiny_model("qwen3_moe", cache_dir=tmp_path / "x", num_hidden_layers=1))
    b = load_hf_model(build_tiny_model("qwen3_moe", cache_dir=tmp_path / "y", num_hidden_layers=1))
    c = load_hf_model(build_tiny_model("qwen3_moe", cache_dir=tmp_path / "z", num_hidden_layers=1,
                                       seed=3))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_qwen3_moe_shape(qwen_moe_dir):
    cfg = json.loads((qwen_moe_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["head_dim"] == 64
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # renamed in transformers 5
    assert n_experts == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    m = load_hf_model(qwen_moe_dir)
    assert next(m.parameters()).dtype == torch.bfloat16
    out = m(torch.tensor([[3, 4, 5, 6]])).logits
    assert out.shape == (1, 4, cfg["vocab_size"]) and torch.isfinite(out).all()


def test_deepseek_v3_shape(deepseek_v3_dir):
    cfg = json.loads((deepseek_v3_dir / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["kv_lora_rank"] > 0 and cfg["n_shared_experts"] == 1
    assert cfg["topk_method"] == "noaux_tc" and cfg["first_k_dense_replace"] == 1
    m = load_hf_model(deepseek_v3_dir)
    # layer 0 dense, layer 1 MoE with a non-zero correction bias
    assert not hasattr(m.model.layers[0].mlp, "experts")
    gate = m.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.abs().sum() > 0
    out = m(torch.tensor([[3, 4, 5, 6]])).logits
    assert torch.isfinite(out).all()


def test_unknown_family():
    with pytest.raises(ValueError, match="unknown model family"):
        tiny_config("gpt2")


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral"])
def test_dense_shapes_and_projection_biases(family):
    """The dense decoders load in HF; Qwen2's q/k/v biases are seeded non-zero (HF's initializer
    zeroes them: a forward that dropped them would go unnoticed), Mistral's window covers its
    context."""
    d = build_tiny_model(family)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["head_dim"] == 64
    m = load_hf_model(d)
    attn = m.model.layers[0].self_attn
    if family == "qwen2":
        assert all(getattr(attn, f"{n}_proj").bias.abs().min() > 0 for n in "qkv")
        assert attn.o_proj.bias is None
    else:
        assert attn.q_proj.bias is None
    if family == "mistral":
        assert cfg["sliding_window"] >= cfg["max_position_embeddings"]
    assert torch.isfinite(m(torch.tensor([[3, 4, 5, 6]])).logits).all()
