"""Property test of the HF <-> megatron-core mapping (trainer/megatron/mapping.py), every family in its table.

For random small dimensions of each family: HF -> megatron -> HF is bitwise the identity, from either HF
form (checkpoint names, transformers>=5 fused experts) through either megatron expert layout (sequential,
grouped), and through TP x EP shards and back. The HF names and shapes come from ``sync.shard_layouts``'s
``hf_shapes`` (written separately from the mapping), the fused form is built here from the per-expert one.
No megatron-core import: the mapping is pure tensor re-layout.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.models import tiny_config
from skyrl_numerics.sync.shard_layouts import hf_shapes
from skyrl_numerics.trainer.megatron.mapping import FAMILIES, hf_to_megatron, megatron_to_hf, shard_for_rank, unshard

pytestmark = pytest.mark.megatron


@st.composite
def qwen3_moe(draw):
    ng = draw(st.integers(1, 3))
    tp = draw(st.sampled_from([1, 2]))
    return tiny_config("qwen3_moe", num_key_value_heads=ng * tp, num_attention_heads=ng * tp * draw(st.integers(1, 2)),
                       head_dim=draw(st.integers(1, 4)), hidden_size=draw(st.integers(1, 6)),
                       vocab_size=tp * draw(st.integers(1, 5)), num_hidden_layers=draw(st.integers(1, 3)),
                       num_experts=draw(st.sampled_from([1, 2, 4])), moe_intermediate_size=draw(st.integers(1, 4))), tp


@st.composite
def deepseek_v3(draw):
    L = draw(st.integers(1, 3))
    return tiny_config("deepseek_v3", num_attention_heads=draw(st.integers(1, 3)), hidden_size=draw(st.integers(1, 6)),
                       q_lora_rank=draw(st.integers(1, 4)), kv_lora_rank=draw(st.integers(1, 4)),
                       qk_nope_head_dim=draw(st.integers(1, 3)), qk_rope_head_dim=2 * draw(st.integers(1, 3)),
                       v_head_dim=draw(st.integers(1, 3)), vocab_size=draw(st.integers(1, 5)), num_hidden_layers=L,
                       first_k_dense_replace=draw(st.integers(0, L)), n_routed_experts=draw(st.sampled_from([1, 2, 4])),
                       n_shared_experts=draw(st.integers(0, 2)), moe_intermediate_size=draw(st.integers(1, 4)),
                       intermediate_size=draw(st.integers(1, 4)), rope_interleave=draw(st.booleans())), 1


def _checkpoint(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in hf_shapes(cfg).items()}


def _fused(sd):
    """transformers>=5 in-memory experts: ``experts.gate_up_proj [E, 2f, H]`` = [gate_e; up_e], ``down_proj``."""
    out, experts = {}, {}
    for k, v in sd.items():
        head, sep, tail = k.partition(".mlp.experts.")
        if not sep:
            out[k] = v
            continue
        e, proj = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(int(e), {})[proj] = v
    for head, es in experts.items():
        order = [es[e] for e in sorted(es)]
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in order])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([x["down_proj"] for x in order])
    return out


def _bitwise(got, want):
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def test_the_table_covers_every_family_the_trainer_supports():
    from skyrl_numerics.trainer.megatron.model import SUPPORTED

    assert set(FAMILIES) == set(SUPPORTED)


@settings(max_examples=30, deadline=None)
@given(st.one_of(qwen3_moe(), deepseek_v3()), st.integers(0, 2 ** 31), st.sampled_from([1, 2, 4]))
def test_hf_megatron_hf_round_trip_is_bitwise(case, seed, ep):
    cfg, tp = case
    hf = _checkpoint(cfg, seed)
    fused = _fused(hf)
    ep = ep if cfg.get("num_experts", cfg.get("n_routed_experts")) % ep == 0 else 1
    for grouped in (False, True):
        mc = hf_to_megatron(hf, cfg, grouped_experts=grouped)
        _bitwise(hf_to_megatron(fused, cfg, grouped_experts=grouped), mc)  # both HF forms: one megatron dict
        _bitwise(megatron_to_hf(mc, cfg), hf)
        _bitwise(megatron_to_hf(mc, cfg, fused=True), fused)
        parts = [(r % ep, r % tp, shard_for_rank(mc, cfg, tp_rank=r % tp, tp=tp, ep_rank=r % ep, ep=ep))
                 for r in range(max(tp, ep))]
        _bitwise(megatron_to_hf(unshard(parts, cfg), cfg), hf)


def _hf_model_checkpoint(cfg):
    """Checkpoint-named weights of the HF model of ``cfg`` (transformers' own classes: Mixtral's
    ``block_sparse_moe`` names, Qwen2's q/k/v biases), for the families ``hf_shapes`` does not lay out."""
    from skyrl_numerics.engine.weight_update import checkpoint_state_dict
    from skyrl_numerics.models import init_tiny_model

    return {k: v.detach().clone() for k, v in checkpoint_state_dict(init_tiny_model(cfg, 0)).items()}


_SMALL = {"qwen3_moe": {"head_dim": 2},
          "deepseek_v3": {"kv_lora_rank": 2, "q_lora_rank": 2, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
                          "v_head_dim": 2, "first_k_dense_replace": 1}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_both_directions_check_the_same_shapes(family):
    cfg = tiny_config(family, hidden_size=4, vocab_size=6, num_hidden_layers=2, moe_intermediate_size=2,
                      intermediate_size=2, **_SMALL.get(family, {"head_dim": 2}))
    hf = _checkpoint(cfg, 0) if family in _SMALL else _hf_model_checkpoint(cfg)
    mc = hf_to_megatron(hf, cfg)
    _bitwise(megatron_to_hf(mc, cfg), hf)
    for name in (next(iter(hf)), "model.norm.weight"):
        with pytest.raises(InputError, match="shape"):
            hf_to_megatron(dict(hf, **{name: hf[name][..., :-1]}), cfg)
    mlp = "router" if "decoder.layers.1.mlp.router.weight" in mc else "linear_fc1"
    for name in ("decoder.layers.1.input_layernorm.weight", f"decoder.layers.1.mlp.{mlp}.weight"):
        with pytest.raises(InputError, match="shape") as e:
            megatron_to_hf(dict(mc, **{name: mc[name][..., :-1]}), cfg)
        assert e.value.field == name
