"""Tiny randomly initialised transformers Qwen3-MoE for the quant tests (built from a config)."""
import torch


def tiny_qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                         tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg).eval()
