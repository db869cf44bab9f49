"""The recipes' published trainer (FSDP + apply_qat + LoRA) as the loop drives it, without an
engine: after one real update the adapters it serves are exactly the engine's set (routed experts
included, per expert), pass the engine's adapter check, and the routed experts' adapters moved."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

from skyrl_numerics.rollout import Rollout
from skyrl_numerics.invariant.numerics import check_adapters, plan_adapter_shapes
from skyrl_numerics.trainer.seed_recipes import SEED_RECIPES, loop_configs
from skyrl_numerics.trainer.workers import TrainerWorker


def test_published_ml4_trains_and_serves_every_engine_adapter(deepseek_v3_dir, tmp_path):
    recipe = SEED_RECIPES["ml4"].with_overrides(["lora_rank=4", "lora_alpha=8"])
    (cfg,) = loop_configs(recipe, deepseek_v3_dir, ["published"])
    # no engine routes here
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, route_replay=False, use_support=False,
                                                               lr=5e-2))
    w = TrainerWorker(str(deepseek_v3_dir), cfg, str(tmp_path / "sync"), snapshot_every=4)
    plan = cfg.numerics
    shapes = plan_adapter_shapes(plan, json.loads((deepseek_v3_dir / "config.json").read_text()))
    before = w.served_state()
    assert set(before) == set(shapes) and any(".experts.3.down_proj.lora_B" in n for n in before)
    check_adapters(before, shapes)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 500, size=6).tolist() for _ in range(4)]
    responses = [rng.integers(2, 500, size=10).tolist() for _ in range(4)]
    ro = Rollout.from_lists(prompts, responses, [[-3.0] * 10] * 4)
    old = w.logprobs(ro)
    w.step(ro, np.array([1.0, 0.0, 1.0, 0.0]), old)
    after = w.served_state()
    check_adapters(after, shapes)
    moved = {n for n in after if not torch.equal(after[n], before[n])}
    expert_b = {n for n in moved if ".mlp.experts." in n and ".lora_B." in n}
    assert expert_b, "the routed experts' adapters did not train"
    assert any(".self_attn." in n for n in moved) and any(".shared_experts." in n for n in moved)
    assert all(t.dtype == torch.bfloat16 for t in after.values())
