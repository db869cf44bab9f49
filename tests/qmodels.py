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


def fake_quant_experts_(model, recipe: str, **opts) -> None:
    """In place: every fused expert matrix of ``model`` replaced by its fake-quantized value, one
    expert (and gate / up half) at a time — the reference ``apply_qat`` must reproduce."""
    from skyrl_numerics.quant import fake_quant

    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith("mlp.experts"):
                for pname in ("gate_up_proj", "down_proj"):
                    p = getattr(mod, pname)
                    for e in range(p.shape[0]):
                        halves = p[e].chunk(2, 0) if pname == "gate_up_proj" else (p[e],)
                        p[e] = torch.cat([fake_quant(h, recipe, **opts) for h in halves], 0)
