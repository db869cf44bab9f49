"""The FP8 (latent) KV-cache switch inside a tiny random DeepSeek-V3 (MLA) and Qwen3-MoE."""
import pytest
import torch
from transformers import DynamicCache

from qmodels import tiny_qwen3_moe
from skyrl_numerics.errors import InputError
from skyrl_numerics.quant.kv_fp8_codec import ds_mla_cache_read, ds_mla_cache_write, ds_mla_roundtrip, fp8_kv_roundtrip
from skyrl_numerics.quant.kv_fp8_hf_cache import FP8KVCache, kv_cache_logprob_effect, token_logprobs


def tiny_deepseek_v3(seed=0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           q_lora_rank=None, kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64,
                           v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                           first_k_dense_replace=1, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(cfg).eval().to(torch.bfloat16)


IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_mla_cache_holds_fp8_latents_and_moves_logprobs():
    model = tiny_deepseek_v3()
    plain = DynamicCache()
    token_logprobs(model, IDS, plain)
    fp8 = FP8KVCache(mode="fp8", k_scale=0.05, mla=True)
    token_logprobs(model, IDS, fp8)
    # layer 0 sees the same inputs in both runs, so its cache is exactly the fp8 round trip (one k_scale)
    kv_c, k_pe = plain.layers[0].keys, plain.layers[0].values
    assert kv_c.shape[-1] == 128 and k_pe.shape[-1] == 64
    assert torch.equal(fp8.layers[0].keys, fp8_kv_roundtrip(kv_c, 0.05))
    assert torch.equal(fp8.layers[0].values, fp8_kv_roundtrip(k_pe, 0.05))
    eff = kv_cache_logprob_effect(model, IDS, mode="fp8", k_scale=0.05, mla=True)
    assert 0 < eff["mean_abs"] < 0.5 and eff["frac_bitwise_equal"] < 1
    ds = FP8KVCache(mode="fp8_ds_mla", mla=True)
    token_logprobs(model, IDS, ds)
    a, b = ds_mla_roundtrip(kv_c, k_pe)
    assert torch.equal(ds.layers[0].keys, a) and torch.equal(ds.layers[0].values, b)
    eff_ds = kv_cache_logprob_effect(model, IDS, mode="fp8_ds_mla", mla=True)
    assert 0 < eff_ds["mean_abs"] < eff["mean_abs"] * 10


def test_ds_mla_roundtrip_equals_656_byte_layout():
    g = torch.Generator().manual_seed(3)
    kv_c = torch.randn(4, 512, generator=g).bfloat16()
    k_pe = torch.randn(4, 64, generator=g).bfloat16()
    a, b = ds_mla_cache_read(ds_mla_cache_write(kv_c, k_pe))
    ra, rb = ds_mla_roundtrip(kv_c, k_pe)
    assert torch.equal(a.bfloat16(), ra) and torch.equal(b, rb)


@pytest.mark.slow
def test_fp8_kv_cache_on_standard_attention():
    model = tiny_qwen3_moe().to(torch.bfloat16)
    eff = kv_cache_logprob_effect(model, IDS, mode="fp8", k_scale=[0.1, 0.1], v_scale=[0.1, 0.1])
    assert eff["mean_abs"] > 0
    with pytest.raises(InputError, match="k_scale"):
        token_logprobs(model, IDS, FP8KVCache(k_scale=[0.1]))
    with pytest.raises(InputError, match="mla"):
        FP8KVCache(mode="fp8_ds_mla")
