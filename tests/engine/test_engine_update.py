"""In-place weight updates of a running vLLM engine: trainer -> delta sync -> receiver -> engine.

The vLLM test shares the session engine (``vllm_qwen``); it pushes the original weights back at
the end and checks, by a digest of every engine parameter and by an identical rollout, that the
engine is exactly as it was.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_numerics.engine.weight_update import checkpoint_state_dict
from skyrl_numerics.errors import InputError
from skyrl_numerics.sync.load_blocks import (block_of, check_complete_blocks, checkpoint_names,
                                             expand_to_blocks)

NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
         "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
         "model.layers.0.mlp.experts.0.up_proj.weight",
         "model.layers.0.mlp.experts.1.up_proj.weight", "model.layers.0.mlp.gate.weight",
         "model.layers.0.input_layernorm.weight",
         "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]


def test_blocks():
    assert block_of("model.layers.0.mlp.experts.3.up_proj.weight") == "model.layers.0.mlp"
    assert block_of("model.layers.12.input_layernorm.weight") == "model.layers.12.input_layernorm"
    assert block_of("lm_head.weight") == "lm_head"
    assert expand_to_blocks(["model.layers.0.self_attn.k_proj.weight"], NAMES) == NAMES[1:4]
    check_complete_blocks(NAMES[1:4] + ["lm_head.weight"], NAMES)
    with pytest.raises(InputError, match="lacks 'model.layers.0.self_attn.v_proj.weight'"):
        check_complete_blocks(NAMES[1:3], NAMES)
    with pytest.raises(InputError, match="lacks 'model.layers.0.mlp.experts.1.up_proj.weight'"):
        check_complete_blocks(NAMES[4:5] + NAMES[6:7], NAMES)
    with pytest.raises(InputError, match="not in the engine's checkpoint"):
        check_complete_blocks(["model.layers.7.mlp.gate.weight"], NAMES)


def test_update_needs_a_running_engine():
    from skyrl_numerics.engine.weight_update import update_vllm_weights

    class Closed:  # a VLLMGenerator after close(): .llm is None
        llm = None

    with pytest.raises(InputError, match="running vllm.LLM") as ei:
        update_vllm_weights(Closed(), {"lm_head.weight": torch.zeros(2)})
    assert ei.value.field == "llm"


def test_checkpoint_state_dict_is_the_checkpoint(qwen_moe_dir):
    """transformers fuses the experts in memory; the reverted names and bytes are the file's."""
    from safetensors.torch import load_file

    from skyrl_numerics.models import load_hf_model

    sd = checkpoint_state_dict(load_hf_model(qwen_moe_dir))
    disk = load_file(str(qwen_moe_dir / "model.safetensors"))
    assert set(sd) == set(disk) == set(checkpoint_names(qwen_moe_dir))
    for k in disk:
        assert sd[k].dtype == disk[k].dtype and torch.equal(sd[k].contiguous().view(-1).view(
            torch.uint8), disk[k].view(-1).view(torch.uint8)), k


def _perturbed(model, scale=0.01, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
    return model


@pytest.mark.vllm
def test_engine_picks_up_synced_weights(vllm_qwen, qwen_moe_dir, tmp_path):
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.trainer.logprobs import trainer_logprobs
    from skyrl_numerics.sync.weight_sync import DeltaPublisher, DeltaReceiver
    from skyrl_numerics.engine.weight_update import engine_weight_digest, update_vllm_weights

    gen = vllm_qwen
    # every VLLMGenerator installs the weight-sync worker extension: a failure here is a failure
    digest0 = engine_weight_digest(gen)
    assert len(digest0) > 0 and all(isinstance(v, str) and v for v in digest0.values())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, 40).tolist() for _ in range(8)]
    kw = dict(max_tokens=32, seed=11)
    before = gen.generate(prompts, **kw)

    old_model = load_hf_model(qwen_moe_dir)
    new_model = _perturbed(load_hf_model(qwen_moe_dir))
    base = {k: v.clone() for k, v in checkpoint_state_dict(old_model).items()}

    # trainer publishes v0 (snapshot) and v1 (delta); the engine side receives and verifies
    pub = DeltaPublisher(tmp_path / "sync")
    pub.publish(base)
    m1 = pub.publish(checkpoint_state_dict(new_model))
    rec = DeltaReceiver(tmp_path / "sync")
    assert [m.version for m in rec.sync()] == [0, 1]
    try:
        up = update_vllm_weights(gen, rec.state, changed=m1.changed)
        # norms were not perturbed: their blocks stay out of the update
        assert up.tensors == len(expand_to_blocks(m1.changed, base)) < len(base)
        assert engine_weight_digest(gen) != digest0
        after = gen.generate(prompts, **kw)

        gap = lambda model, r: float(np.abs(trainer_logprobs(model, r).logprobs
                                            - r.rollout_logprobs).mean())
        gap_new, gap_old = gap(new_model, after), gap(old_model, after)
        gap_before = gap(old_model, before)
        # the engine now computes the new weights' logprobs, to the usual engine/trainer gap...
        assert gap_new < 2e-2, (gap_new, gap_old)
        assert gap_new < 3 * gap_before + 5e-3
        # ...and not the old ones
        assert gap_old > 10 * gap_new, (gap_new, gap_old)

        # a partial block is refused before the engine is touched
        d_mid = engine_weight_digest(gen)
        with pytest.raises(InputError, match="partial update"):
            update_vllm_weights(gen, {"model.layers.0.self_attn.q_proj.weight":
                                      base["model.layers.0.self_attn.q_proj.weight"]})
        assert engine_weight_digest(gen) == d_mid
    finally:
        update_vllm_weights(gen, base)
    assert engine_weight_digest(gen) == digest0
    restored = gen.generate(prompts, **kw)
    np.testing.assert_array_equal(restored.response_tokens, before.response_tokens)
    np.testing.assert_array_equal(restored.rollout_logprobs, before.rollout_logprobs)


def test_whole_block_rule_property(qwen_moe_dir):
    """Any union of whole blocks passes; dropping one tensor of a touched block is refused."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    names = sorted(checkpoint_names(qwen_moe_dir))
    blocks = sorted({block_of(n) for n in names})
    assert "model.layers.0.mlp" in blocks and "model.layers.1.self_attn" in blocks

    @settings(max_examples=30, deadline=None)
    @given(chosen=st.sets(st.sampled_from(blocks), min_size=1), drop=st.integers(0, 10**6))
    def prop(chosen, drop):
        subset = [n for n in names if block_of(n) in chosen]
        check_complete_blocks(subset, names)
        assert sorted(expand_to_blocks(subset[:1], names)) == sorted(
            n for n in names if block_of(n) == block_of(subset[0]))
        if len(subset) > 1:
            victim = subset[drop % len(subset)]
            rest = [n for n in subset if n != victim]
            if any(block_of(n) == block_of(victim) for n in rest):
                with pytest.raises(InputError, match="partial update"):
                    check_complete_blocks(rest, names)

    prop()
