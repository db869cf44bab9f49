"""GPT-OSS router replay (transformers 5 ``GptOssTopKRouter``: biased logits, softmax over the top-k
logits only): replaying the router's own choice is bitwise, other experts change the output, and the
recomputed weights follow the formula."""
from __future__ import annotations

import numpy as np
import torch

from skyrl_numerics.replay import PackedRoutes, route_replay
from skyrl_numerics.replay.hf_replay import find_routers, record_routes


def _model():
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, intermediate_size=48,
                       num_local_experts=6, num_experts_per_tok=2, sliding_window=16,
                       max_position_embeddings=128, initializer_range=0.1)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # a non-zero router bias, so the bias path is exercised
        for _, r in find_routers(m):
            r.bias.normal_(0, 0.5)
    return m


def test_gpt_oss_replay_bitwise_and_not_a_no_op():
    m = _model()
    assert [type(r).__name__ for _, r in find_routers(m)] == ["GptOssTopKRouter"] * 2
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with record_routes(m) as rec:
            ref = m(input_ids=ids).logits
        routes = rec.routes([10, 10])
        with route_replay(m, routes):
            got = m(input_ids=ids).logits
        other = PackedRoutes((routes.values + 1) % 6, routes.cu_seqlens, 6)
        with route_replay(m, other):
            moved = m(input_ids=ids).logits
    assert torch.equal(ref, got)
    assert not torch.equal(ref, moved)


def test_gpt_oss_weights_formula():
    from skyrl_numerics.replay.hf_families import gpt_oss_weights

    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5]], dtype=torch.float64)
    idx = torch.tensor([[3, 0]])
    w = gpt_oss_weights(None, logits, idx)
    e = np.exp([0.5, 1.0])
    assert torch.allclose(w, torch.tensor([e / e.sum()], dtype=torch.float64))
