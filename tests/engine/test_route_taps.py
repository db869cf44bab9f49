"""Which decoder layer each of our invariant model's MoE layers is, for route capture on the engine
(``InvariantCausalLM.moe_layer_ids``): vLLM's routed-experts rows are indexed by decoder layer, and Qwen3-MoE's
``mlp_only_layers`` may put a dense layer between MoE layers. The taps vLLM 0.30's capturer binds to
(``vllm_invariant_model.RouteTap``) carry those indexes and forward the model's routes."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from transformers import DeepseekV3Config, Qwen3Config, Qwen3MoeConfig  # noqa: E402

from skyrl_numerics.invariant import family_class  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)


def _model(cfg):
    return family_class(cfg.architectures[0]).from_config(cfg, dtype=torch.float32)


def test_a_dense_layer_between_moe_layers_keeps_their_decoder_index():
    cfg = Qwen3MoeConfig(**SMALL, num_hidden_layers=4, intermediate_size=64, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                         mlp_only_layers=[1], architectures=["Qwen3MoeForCausalLM"])
    assert _model(cfg).moe_layer_ids() == [0, 2, 3]


def test_deepseek_dense_layers_lead():
    cfg = DeepseekV3Config(**{**SMALL, "head_dim": None}, num_hidden_layers=3, intermediate_size=64,
                           moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                           n_group=1, topk_group=1, first_k_dense_replace=2, q_lora_rank=None,
                           kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                           architectures=["DeepseekV3ForCausalLM"])
    assert _model(cfg).moe_layer_ids() == [2]


def test_a_dense_family_has_no_moe_layers():
    cfg = Qwen3Config(**SMALL, num_hidden_layers=2, intermediate_size=64,
                      architectures=["Qwen3ForCausalLM"])
    assert _model(cfg).moe_layer_ids() is None


def test_a_tap_forwards_its_layers_routes_to_the_bound_capturer():
    """What vLLM 0.30's ``bind_routed_experts_capturer`` does to a ``RoutedExpertsCaptureSource``:
    ``capture_fn = partial(capturer.capture, layer_id)``; the model's route hook reaches it."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

    from types import SimpleNamespace

    from skyrl_numerics.engine.vllm_invariant_model import RouteTap, _SkyrlInvariantForCausalLM

    taps = [RouteTap(0), RouteTap(2), RouteTap(3)]          # MoE layers around a dense layer 1
    assert all(isinstance(t, RoutedExpertsCaptureSource) for t in taps)
    seen = []
    for t in taps[1:]:                                     # bound as vLLM binds them
        t.capture_fn = lambda ids, _layer=t.layer_id: seen.append((_layer, ids.tolist()))
    model = SimpleNamespace(route_taps=taps)
    for moe_layer in range(3):                             # what the family's route_hook is called with
        _SkyrlInvariantForCausalLM._tap(model, moe_layer, torch.tensor([[moe_layer, 7]]))
    assert seen == [(2, [[1, 7]]), (3, [[2, 7]])]          # the unbound tap (layer 0) drops its routes
