"""The real-dims checkpoints of issue 26: two layers of two open MoE models at their per-layer
dimensions, random weights, written with plain transformers (``models.build_tiny_model`` with
overrides: built once, cached under the project cache folder by a hash of the config).

- ``qwen3_moe``: Qwen3-MoE-30B-A3B's layer — hidden 2048, 32 q / 4 kv heads of 128, 64 experts
  top-8 of width 768, vocab 151,936 (~1.27 B parameters, 2.5 GB in bf16);
- ``deepseek_v3``: a DeepSeek-V3-family (MLA) layer as Moonlight / DeepSeek-V2-Lite have it —
  hidden 2048, 16 heads, no q LoRA, latent 512 + rope 64, nope 128, v 128, 64 experts top-6 of
  width 1408 + 2 shared, first layer dense (11264), vocab 163,840 (~1.34 B parameters);
- ``qwen3_next``: Qwen3-Next-80B-A3B's hybrid layers — hidden 2048; a Gated DeltaNet layer
  (16 key / 32 value heads of 128, conv kernel 4) then a gated full-attention layer (16 q / 2 kv
  heads of 256, partial RoPE 0.25: the config default); 512 experts top-10 of width 512 + a
  shared expert of 512 in both; vocab 151,936 (~3.9 B parameters, 7.3 GiB in bf16: the benchmarks override
  ``num_experts`` and ``vocab_size`` on a 24 GB host, and say so).

    .venv/bin/python benchmarks/real_dims.py [qwen3_moe|deepseek_v3|qwen3_next ...]   # prints the paths
    (no argument: the first two; ``qwen3_next`` at 512 experts needs ~14 GB free to build)
"""
from __future__ import annotations

import sys

CONFIGS = {
    "qwen3_moe": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
                      intermediate_size=6144, vocab_size=151936, initializer_range=0.02),
    "deepseek_v3": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                        moe_intermediate_size=1408, intermediate_size=11264, n_group=1, topk_group=1,
                        vocab_size=163840, first_k_dense_replace=1, initializer_range=0.02),
    "qwen3_next": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       layer_types=["linear_attention", "full_attention"], num_hidden_layers=2,
                       num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512, intermediate_size=5120,
                       norm_topk_prob=True, vocab_size=151936,
                       initializer_range=0.02),
}


def build(family: str, **overrides):
    """The checkpoint folder of ``family`` at real dims (built on first use); ``overrides``
    replace entries of its config (a reduced expert count or vocab on a small host)."""
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model(family, **{**CONFIGS[family], **overrides})


if __name__ == "__main__":
    for fam in sys.argv[1:] or ["qwen3_moe", "deepseek_v3"]:
        print(fam, build(fam))
