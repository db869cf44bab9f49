"""The FSDP trainer (HF model) with R3 on the MoE families past Qwen3-MoE / DeepSeek-V3: routes replayed
into each HF model's own router (Mixtral's, GLM-4 MoE's, GPT-OSS's, Qwen3-Next's, DeepSeek-V3.2's).

Per family (the tiny model of ``models.py`` in float32, no engine): the trainer's logprobs under its
own recorded routes equal its logprobs without replay, other experts move them by far more than
rounding, and one ``aligned`` update (R3 + support replay + token TIS, as ``train --configs aligned``)
trains the router. Engine-captured routes into the same routers: tests/e2e (doctor, train).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_numerics.models import init_tiny_model, tiny_config
from skyrl_numerics.replay import PackedRoutes, PackedSupport, record_routes
from skyrl_numerics.replay.hf_replay import find_routers
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.config import TrainerConfig
from skyrl_numerics.trainer.fsdp.trainer import FSDPTrainer

# smaller than the engine-shaped tiny models where vLLM CPU's kernel constraints set the size
# (MLA latent 512, Gated DeltaNet head dim 128): the HF model has no such limit
FAMILIES = {"mixtral": {}, "glm4_moe": {}, "gpt_oss": {},
            "qwen3_next": {"linear_key_head_dim": 32, "linear_value_head_dim": 32},
            "deepseek_v32": {"kv_lora_rank": 64, "index_n_heads": 2}}
LENS = [5, 9, 3, 7]


def _rollout(model, vocab: int) -> tuple[Rollout, np.ndarray]:
    """4 sequences in 2 groups, with the model's own recorded routes (engine convention: the final
    sampled token never ran) and the full vocabulary as the support; rollout logprobs = the trainer's
    own + N(0, 0.05)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, vocab, 4 + i % 3).tolist() for i in range(len(LENS))]
    resp = [rng.integers(2, vocab, n).tolist() for n in LENS]
    r = Rollout.from_lists(prompts, resp, [[-1.0] * n for n in LENS], group_ids=np.repeat([0, 1], 2),
                           sampling={"temperature": 1.0})
    plain = FSDPTrainer(model, TrainerConfig())
    with record_routes(model) as rec:
        own = plain.logprobs(r)
    routes = rec.routes(r.prompt_lens + r.response_lens, drop_last=True)
    lp = np.minimum(own + rng.normal(0, 0.05, own.shape), 0.0).astype(np.float32)
    d = {f: getattr(r, f) for f in r.__dataclass_fields__}
    return Rollout(**{**d, "rollout_logprobs": lp, "routes": routes,
                      "support": PackedSupport.full(r.num_response_tokens, vocab)}), own


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_r3_into_the_hf_router_and_one_aligned_update(family):
    cfg = tiny_config(family, **FAMILIES[family])
    model = init_tiny_model(cfg, 0)
    routers = find_routers(model)
    assert routers, family                                  # R3 reaches this family's own router
    r, own = _rollout(model, cfg["vocab_size"])
    aligned = TrainerConfig(route_replay=True, use_support=True, correction="token_tis", lr=1e-3,
                            grad_clip=None, micro_batch_size=4)
    t = FSDPTrainer(model, aligned)
    replayed = t.logprobs(r)
    np.testing.assert_allclose(replayed, own, atol=1e-5)    # its own routes: the same logprobs
    E = r.routes.num_experts
    vals = (np.asarray(r.routes.values).astype(np.int64) + 3) % E   # other experts everywhere
    cu = r.routes.cu_seqlens
    other = PackedRoutes.from_sequences([vals[a:b] for a, b in zip(cu[:-1], cu[1:])], E)
    d = {f: getattr(r, f) for f in r.__dataclass_fields__}
    moved = t.logprobs(Rollout(**{**d, "routes": other}))
    assert np.abs(moved - own).max() > 1e-2, family
    w0 = routers[-1][1].weight.detach().clone()
    met = t.step(r, np.array([1.0, 0.0, 0.0, 1.0]))
    assert np.isfinite(met["loss"]) and met["grad_norm"] > 0
    assert not torch.equal(routers[-1][1].weight.detach(), w0)   # the router trains under replay
    assert met["correction/mean_ratio"] == pytest.approx(
        np.exp(own.astype(np.float64) - r.rollout_logprobs).mean(), rel=1e-4)
