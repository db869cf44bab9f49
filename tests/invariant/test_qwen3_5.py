"""The ``qwen3_5`` / ``qwen3_5_moe`` families (Qwen3.5 text models: Qwen3-Next's hybrid with
separate GDN projections; dense or routed MLPs), trainer side, against HF's own
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` built from transformers' config classes:
float32 within a few times HF's own error against its float64 twin, bf16 within HF bf16's own
error, and the same code as Qwen3-Next (the same weights regrouped into Qwen3-Next's fused
layout give the same bits)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.blocks import UnsupportedConfig
from skyrl_numerics.invariant.qwen3_5 import InvariantQwen3_5, InvariantQwen3_5Moe
from skyrl_numerics.invariant.qwen3_next import InvariantQwen3Next
from hf_agreement import assert_fp32_within_hfs_own_error, assert_packing_and_prefix_invariant, hf_eager, token_ids
from skyrl_numerics.models import build_tiny_model, load_hf_model, tiny_config

BF16_ULP = 2.0 ** -8
FAMILIES = {"qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
            "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig")}



def _tensor_names(d) -> set:
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return set(f.keys())



@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_checkpoint_is_transformers_own(family):
    from transformers import AutoConfig

    arch, cfg_cls = FAMILIES[family]
    cfg = AutoConfig.from_pretrained(str(build_tiny_model(family)))
    assert type(cfg).__name__ == cfg_cls and cfg.architectures == [arch]
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}


# an M-RoPE config as Qwen3.5 checkpoints carry it (interleaved sections over the 8 rotated
# frequencies of head_dim 64 x 0.25): for text positions it is plain RoPE
MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                             "mrope_interleaved": True}}


@pytest.mark.parametrize("family, over", [("qwen3_5", {}), ("qwen3_5_moe", {}),
                                          ("qwen3_5_moe", MROPE),
                                          ("qwen3_5", {"tie_word_embeddings": True})])
def test_fp32_logits_are_hfs_within_hfs_own_error(family, over):
    """Same float32 weights, a 56-token sequence: |ours - HF fp64| at most 4x HF fp32's own
    |HF fp32 - HF fp64| plus 64 ulps of the logit scale (measured: ours 2.0e-6 / 2.7e-6 from HF
    fp32 at scale 2.6 / 2.2); also with M-RoPE sections and with a tied lm-head (the small
    Qwen3.5 models: no ``lm_head.weight`` in the checkpoint)."""
    if over.get("tie_word_embeddings"):
        assert "lm_head.weight" not in _tensor_names(build_tiny_model(family, dtype="float32",
                                                                      **over))
    d = build_tiny_model(family, dtype="float32", **over)
    m = from_checkpoint(d, dtype=torch.float32)
    assert_fp32_within_hfs_own_error(d, m, token_ids(56, 1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_logits_within_hf_bf16s_own_error(family):
    """The bf16 checkpoint: |ours - HF fp64 (same bf16 weights)| at most 2x HF bf16's own error
    plus one bf16 ulp of the logit scale (HF rounds RoPE's cos/sin and the conv in bf16 where
    we stay fp32)."""
    d = build_tiny_model(family)
    m = from_checkpoint(d)
    ids = token_ids(40, 2)
    with torch.no_grad():
        ours = m.logits(m.sequence_hidden(ids)).double()
        hf = load_hf_model(d)(ids[None]).logits[0].double()
        ref = hf_eager(d, torch.float64)(ids[None]).logits[0]
    scale = ref.abs().max().item()
    hf_err = (hf - ref).abs().max().item()
    assert (ours - ref).abs().max().item() <= 2 * hf_err + BF16_ULP * scale, hf_err


def _as_qwen3_next(m: InvariantQwen3_5Moe) -> InvariantQwen3Next:
    """The same weights in Qwen3-Next's layout: ``in_proj_qkvz`` / ``in_proj_ba`` grouped per
    key head (per key head: its q, its k, its r value heads' v, their z; then b, a)."""
    cfg = SimpleNamespace(**dict(tiny_config("qwen3_next"), num_hidden_layers=m.dims.layers,
                                 layer_types=list(m.dims.layer_types)))
    nx = InvariantQwen3Next(**InvariantQwen3Next.config_parts(cfg))
    g, r = m.gdn, m.gdn.v_heads // m.gdn.k_heads
    kd = g.k_heads * g.k_dim
    own = {k.replace("__", "."): w for k, w in m.params.items()}
    for i in m.linear_layers():
        p = f"model.layers.{i}.linear_attn."
        qkv, z = own.pop(p + "in_proj_qkv.weight"), own.pop(p + "in_proj_z.weight")
        b, a = own.pop(p + "in_proj_b.weight"), own.pop(p + "in_proj_a.weight")
        per = lambda w, n: w.reshape(g.k_heads, n, -1)  # noqa: E731
        own[p + "in_proj_qkvz.weight"] = torch.cat(
            [per(qkv[:kd], g.k_dim), per(qkv[kd:2 * kd], g.k_dim), per(qkv[2 * kd:], r * g.v_dim),
             per(z, r * g.v_dim)], dim=1).reshape(-1, qkv.shape[1])
        own[p + "in_proj_ba.weight"] = torch.cat([per(b, r), per(a, r)], dim=1).reshape(-1, b.shape[1])
    with torch.no_grad():
        for n, w in own.items():
            nx.w(n).copy_(w)
    return nx


def test_qwen3_5_moe_is_qwen3_nexts_code():
    """Qwen3.5-MoE's weights regrouped into Qwen3-Next's fused layout run through Qwen3-Next's
    family give the same bits: only the projection layout differs."""
    m = from_checkpoint(build_tiny_model("qwen3_5_moe"))
    nx = _as_qwen3_next(m)
    ids = token_ids(33, 4)
    with torch.no_grad():
        assert torch.equal(m.sequence_hidden(ids), nx.sequence_hidden(ids))


@pytest.fixture(scope="module")
def moe_model():
    return from_checkpoint(build_tiny_model("qwen3_5_moe"))


@settings(max_examples=4)
@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_bf16_forward_is_prefix_and_packing_invariant(moe_model, lens, seed):
    """Several sequences packed into one forward: each gets the bits it gets alone, and a
    prefix's rows are the whole sequence's first rows."""
    assert_packing_and_prefix_invariant(moe_model, lens, seed)


def test_routes_every_layer_of_the_moe_and_none_of_the_dense():
    moe = from_checkpoint(build_tiny_model("qwen3_5_moe"))
    assert moe.moe_layer_ids() == [0, 1]
    assert moe.route_info() == {"layers": 2, "k": 2, "num_experts": 8}
    dense = from_checkpoint(build_tiny_model("qwen3_5"))
    assert dense.moe_layer_ids() is None
    with pytest.raises(InputError) as e:
        dense.route_info()
    assert e.value.field == "capture_routes"


@pytest.mark.parametrize("family, over, field", [
    ("qwen3_5", {"attention_bias": True}, "attention_bias"),
    ("qwen3_5", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_5", {"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3_5", {"intermediate_size": None}, "intermediate_size"),
    ("qwen3_5_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ("qwen3_5_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("qwen3_5_moe", {"linear_num_key_heads": 2, "linear_num_value_heads": 3},
     "linear_num_value_heads"),
])
def test_configs_it_cannot_reproduce_are_refused(family, over, field):
    cfg = SimpleNamespace(**json.loads(json.dumps(tiny_config(family, **over))))
    cls = InvariantQwen3_5Moe if family == "qwen3_5_moe" else InvariantQwen3_5
    with pytest.raises(UnsupportedConfig) as e:
        cls.config_parts(cfg)
    assert e.value.field == field


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_bitwise_entry_points_accept_qwen3_5(family):
    """The engine overrides name the hybrid invariant model (no engine started)."""
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    cfg = json.loads((build_tiny_model(family) / "config.json").read_text())
    over = engine_overrides(cfg)
    assert over["architectures"] == [f"SkyrlInvariant{FAMILIES[family][0]}"]
    assert over["skyrl_base_arch"] == FAMILIES[family][0]


def test_stock_vllm_without_torchvision_is_refused_in_one_line(capsys):
    """vLLM's own Qwen3.5 module imports torchvision (through qwen3_vl.py); where it does not
    import, a stock engine / serve is refused naming it before any engine starts, and the
    batch-invariant path still builds its command."""
    pytest.importorskip("vllm")
    from skyrl_numerics.cli import main
    from skyrl_numerics.engine.arch_check import missing_stock_import
    from skyrl_numerics.trainer import VLLMGenerator

    why = missing_stock_import("Qwen3_5ForCausalLM")
    if why is None:
        pytest.skip("torchvision imports here: stock vLLM can load its Qwen3.5 module")
    d = build_tiny_model("qwen3_5")
    with pytest.raises(InputError, match="torchvision") as e:
        VLLMGenerator(d)
    assert e.value.field == "architectures" and "Qwen3_5ForCausalLM" in str(e.value)
    assert main(["serve", str(d), "--print-command"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0], err
    assert main(["serve", str(d), "--batch-invariant", "--print-command"]) == 0
    assert "SkyrlInvariantQwen3_5ForCausalLM" in capsys.readouterr().out


def test_mrope_fields_are_dropped_for_vllm_and_nothing_else():
    """A text checkpoint's M-RoPE sections would make vLLM hand 3-row positions: the engine
    overrides drop them (and only them) from ``rope_parameters``; without them nothing is
    overridden."""
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    cfg = json.loads((build_tiny_model("qwen3_5_moe", **MROPE) / "config.json").read_text())
    rp = engine_overrides(cfg)["rope_parameters"]
    assert rp == {k: v for k, v in MROPE["rope_parameters"].items()
                  if k not in ("mrope_section", "mrope_interleaved")}
    plain = json.loads((build_tiny_model("qwen3_5_moe") / "config.json").read_text())
    assert "rope_parameters" not in engine_overrides(plain)
