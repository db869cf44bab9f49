"""route_replay / record_routes on tiny HF MoE models built from configs (Qwen3-MoE, OLMoE, Mixtral, DeepSeek-V3,
GLM-4-MoE, and the hybrids' / DSA's routers: Qwen3-Next, DeepSeek-V3.2, Nemotron-H MoE)."""
import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.models import init_tiny_model, tiny_config
from skyrl_numerics.replay import PackedRoutes, packed_token_index, record_routes, route_replay
from skyrl_numerics.replay.hf_replay import find_routers

transformers = pytest.importorskip("transformers")


def _init(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if "norm" not in name else 0.0) + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
        # sharpen the routers so that perturbing one token changes its experts
        for _, r in find_routers(model):
            r.weight.mul_(50.0)
    return model.eval()


def qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    return _init(transformers.Qwen3MoeForCausalLM(cfg), 0)


def olmoe():
    cfg = transformers.OlmoeConfig(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                   norm_topk_prob=False, max_position_embeddings=256)
    return _init(transformers.OlmoeForCausalLM(cfg), 1)


def mixtral():
    cfg = transformers.MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=256)
    return _init(transformers.MixtralForCausalLM(cfg), 2)


def deepseek_v3():
    cfg = transformers.DeepseekV3Config(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                                        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                                        v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                        n_group=2, topk_group=1, topk_method="noaux_tc", norm_topk_prob=True,
                                        routed_scaling_factor=2.5, first_k_dense_replace=1,
                                        max_position_embeddings=256, rope_scaling=None)
    return _init(transformers.DeepseekV3ForCausalLM(cfg), 3)


def glm4_moe():
    # GLM-4.5's router (sigmoid, e_score_correction_bias, groups), a dense first layer, a shared
    # expert, partial RoPE, q/k norm and attention biases
    cfg = transformers.Glm4MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                     num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                     n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                     topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                                     first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                                     max_position_embeddings=256)
    return _init(transformers.Glm4MoeForCausalLM(cfg), 4)


def qwen3_next():
    # Gated DeltaNet (linear attention) + gated full attention, softmax top-k router, shared expert
    return _init(init_tiny_model(tiny_config("qwen3_next", linear_key_head_dim=32, linear_value_head_dim=32), 0), 5)


def deepseek_v32():
    # DeepSeek-V3's router (sigmoid, bias, groups) in a model with the DSA indexer (index_topk 16
    # covers the 12-token batches, so attention reaches every earlier key); a dense first layer
    return _init(init_tiny_model(tiny_config("deepseek_v32", num_hidden_layers=3, kv_lora_rank=64,
                                             index_n_heads=2), 0), 6)


def nemotron_h_moe():
    # Nemotron-H MoE layers (sigmoid group-limited router, non-gated experts, a shared expert)
    # between a Mamba-2 mixer and attention
    cfg = transformers.NemotronHConfig(
        vocab_size=512, hidden_size=128, layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256, mamba_num_heads=4,
        mamba_head_dim=32, ssm_state_size=16, n_groups=1, conv_kernel=4, expand=1, chunk_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=256, tie_word_embeddings=False)
    return _init(transformers.NemotronHForCausalLM(cfg), 7)


FAMILIES = {"qwen3_moe": qwen3_moe, "olmoe": olmoe, "mixtral": mixtral, "deepseek_v3": deepseek_v3,
            "glm4_moe": glm4_moe, "qwen3_next": qwen3_next, "deepseek_v32": deepseek_v32,
            "nemotron_h_moe": nemotron_h_moe}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    torch.manual_seed(0)
    return FAMILIES[request.param]()


def _batch(B=3, S=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 512, (B, S), generator=g)
    lens = torch.tensor([S, S - 3, S - 5])[:B]
    mask = (torch.arange(S)[None] < lens[:, None]).long()
    return ids, mask, lens


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_replay_of_recorded_routes_is_bitwise_identical(model):
    ids, mask, lens = _batch()
    with record_routes(model) as rec:
        ref = _logits(model, ids, mask)
    n_moe = len(find_routers(model))
    for drop_last in (False, True):  # full coverage, and the engine convention (n - 1 rows)
        routes = rec.routes(lens, drop_last=drop_last)
        assert routes.num_layers == n_moe and routes.seq_lens.tolist() == (lens - int(drop_last)).tolist()
        with route_replay(model, routes, seq_lens=lens):
            out = _logits(model, ids, mask)
        assert torch.equal(out, ref)
    # through the serialized buffer as well
    back = PackedRoutes.from_buffer(routes.to_bytes())
    with route_replay(model, back):
        assert torch.equal(_logits(model, ids, mask), ref)


def test_altered_routes_change_exactly_the_affected_tokens(model):
    """Affected tokens move by far more than rounding; all others by at most fp32 rounding.

    Not bitwise for the others: the experts' grouped GEMM on CPU is not batch-invariant, so an expert that
    receives one more token may round the other tokens it serves differently (~1e-7 here)."""
    ids, mask, lens = _batch()
    with record_routes(model) as rec:
        ref = _logits(model, ids, mask)
    routes = rec.routes(lens, drop_last=True)
    E = routes.num_experts
    b, s = 1, 4
    for layer, expect in ((routes.num_layers - 1, "one"), (0, "suffix")):
        alt = PackedRoutes(routes.values.copy(), routes.cu_seqlens, E)
        row = alt.seq(b)[s, layer]
        row[:] = sorted(set(range(E)) - set(row.tolist()))[:row.size]  # k other experts
        with route_replay(model, alt):
            out = _logits(model, ids, mask)
        delta = (out - ref).abs().amax(-1) * mask  # [B, S], padding ignored
        want = torch.zeros_like(delta, dtype=torch.bool)
        if expect == "one":  # last MoE layer: only this position's output depends on it
            want[b, s] = True
        else:  # first MoE layer: later positions of the same sequence attend to it
            want[b, s:lens[b]] = True
        assert delta[want].min() > 1e-3, (layer, delta)
        assert delta[~want].max() <= 1e-5, (layer, delta)


def test_router_keeps_gradient_and_weights_follow_trainer_logits(model):
    ids, mask, lens = _batch(B=2, S=8)
    with record_routes(model) as rec:
        _logits(model, ids, mask)
    routes = rec.routes(lens[:2])
    routers = find_routers(model)
    for _, r in routers:
        r.weight.grad = None
    with route_replay(model, routes):
        out = model(input_ids=ids, attention_mask=mask).logits
    out.float().pow(2).mean().backward()
    for name, r in routers:
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)


def test_replay_forces_recorded_indices(model):
    """Routes from another input are used verbatim: a recorder inside the replay sees them."""
    ids, mask, lens = _batch()
    ids2, _, _ = _batch(seed=7)
    with record_routes(model) as rec2:
        _logits(model, ids2, mask)
    other = rec2.routes(lens)
    with route_replay(model, other), record_routes(model) as seen:
        _logits(model, ids, mask)
    # recorder hooks run after the replay hooks (registered later) and see the replaced indices
    assert seen.routes(lens) == other


def test_packed_layout_matches_padded():
    m = qwen3_moe()
    ids, mask, lens = _batch()
    with record_routes(m) as rec:
        _logits(m, ids, mask)
    routes = rec.routes(lens, drop_last=True)
    packed_ids = torch.cat([ids[b, :lens[b]] for b in range(3)])[None]
    pos = torch.cat([torch.arange(int(n)) for n in lens])[None]
    with record_routes(m):
        with torch.no_grad():
            m(input_ids=packed_ids, position_ids=pos)
    # own routing on packed input differs only where attention differs (cross-sequence); replay forces ours
    with route_replay(m, routes, seq_lens=lens, packed=True), record_routes(m) as seen:
        with torch.no_grad():
            m(input_ids=packed_ids, position_ids=pos)
    got = seen.routes(lens, packed=True, drop_last=True)
    assert got == routes
    ti = packed_token_index(routes, lens)
    assert ti.shape[0] == int(lens.sum()) and int((ti < 0).sum()) == 3  # the final token of each sequence


def test_errors():
    m = qwen3_moe()
    ids, mask, lens = _batch()
    with record_routes(m) as rec:
        _logits(m, ids, mask)
    routes = rec.routes(lens)
    one_layer = PackedRoutes(routes.values[:, :1].copy(), routes.cu_seqlens, 8)
    with pytest.raises(InputError, match="routes have 1 layers, the model has 2 MoE layers"):
        with route_replay(m, one_layer):
            pass
    with pytest.raises(InputError, match="k=1, router .* uses top_k=2"):
        with route_replay(m, PackedRoutes(routes.values[:, :, :1].copy(), routes.cu_seqlens, 8)):
            pass
    with pytest.raises(InputError, match="routes are for 16 experts"):
        with route_replay(m, PackedRoutes(routes.values, routes.cu_seqlens, 16)):
            pass
    with pytest.raises(InputError, match=r"sequence 1: routes cover 9 positions, forward has 7 tokens"):
        with route_replay(m, routes, seq_lens=torch.tensor([12, 7, 7])):
            pass
    with pytest.raises(InputError, match="forward batch has 2 sequences, routes have 3"):
        with route_replay(m, routes):
            _logits(m, ids[:2], mask[:2])
    with pytest.raises(InputError, match="routes cover 12 positions of sequence 0, the forward has only 10"):
        with route_replay(m, routes):
            _logits(m, ids[:, :10], mask[:, :10])
    with pytest.raises(InputError, match="2 seq_lens for a recorded batch of 3 sequences"):
        rec.routes([12, 9])
    with pytest.raises(InputError, match="no supported MoE router"):
        with route_replay(torch.nn.Linear(2, 2), routes):
            pass
    # hooks are removed after an error: the plain model is back
    assert all(not r._forward_hooks for _, r in find_routers(m))
