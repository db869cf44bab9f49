"""The tiny Mixtral family: loadable in HF, every layer an MoE with a replayable router, and its
router replay reproduces the router's own choice bit for bit."""
from __future__ import annotations

import json

import torch

from skyrl_numerics.models import FAMILIES, build_tiny_model, load_hf_model


def test_mixtral_checkpoint_shape_and_routers():
    d = build_tiny_model("mixtral")
    assert "mixtral" in FAMILIES
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["dtype"] == "bfloat16"
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64  # vLLM CPU attention
    from skyrl_numerics.doctor.model_check import inspect_checkpoint

    info = inspect_checkpoint(d, count_params=False)
    assert info.is_moe and info.num_experts == 8
    # experts stored per expert as w1/w2/w3 under block_sparse_moe: not what the fake-quant
    # serving checkpoints match, so the doctor skips those rows with the reason
    assert any(".block_sparse_moe.experts.7.w2.weight" in n for n in info.weight_names)
    assert not info.has_experts_named()
    m = load_hf_model(d)
    from skyrl_numerics.replay.hf_replay import find_routers

    routers = find_routers(m)
    assert [type(r).__name__ for _, r in routers] == ["MixtralTopKRouter"] * cfg["num_hidden_layers"]


def test_mixtral_replay_of_own_routes_is_bitwise():
    from skyrl_numerics.replay import route_replay
    from skyrl_numerics.replay.hf_replay import record_routes

    m = load_hf_model(build_tiny_model("mixtral"))
    ids = torch.randint(2, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with record_routes(m) as rec:
            ref = m(input_ids=ids).logits
        routes = rec.routes([12, 12])
        with route_replay(m, routes):
            got = m(input_ids=ids).logits
        # and the replay is not a no-op: other experts, other logits
        from skyrl_numerics.replay import PackedRoutes

        other = PackedRoutes((routes.values + 1) % routes.num_experts, routes.cu_seqlens,
                             routes.num_experts)
        with route_replay(m, other):
            moved = m(input_ids=ids).logits
    assert torch.equal(ref, got)
    assert not torch.equal(ref, moved)
