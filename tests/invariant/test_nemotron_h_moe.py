"""Nemotron 3's ``moe`` blocks in the ``nemotron_h`` family, trainer side (no engine): HF's own
``NemotronHForCausalLM`` built from transformers' ``NemotronHConfig`` is the reference (float32
against its float64 twin: our error within a few times HF's own), for the plain MoE (Nano) and
the LatentMoE (Super, ``moe_latent_size``); the router is HF's ``NemotronHTopkRouter``'s; the
grouped non-gated experts are the per-expert loop bit for bit; routes and hidden states do not
depend on what shares the call; the config fields it cannot reproduce are refused by name."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.hf_config import moe_dims, moe_layout, nemotron_block_types
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.blocks import UnsupportedConfig, routed_experts, sigmoid_group_topk
from skyrl_numerics.invariant.nemotron_h import InvariantNemotronH
from hf_agreement import assert_fp32_within_hfs_own_error, hf_eager, token_ids
from skyrl_numerics.models import build_tiny_model, load_hf_model, tiny_config

LATENT = {"moe_latent_size": 32}




@pytest.mark.parametrize("over", [{}, LATENT], ids=["nano", "latent"])
def test_fp32_logits_are_hfs_within_hfs_own_error(over):
    """Same float32 weights, 56 tokens through Mamba-2, MoE, attention, MoE blocks:
    |ours - HF fp64| at most 4x HF fp32's own error plus 64 ulps of the logit scale (measured:
    ours 2.0e-6 vs HF's 2.2e-6 at scale 2.3; latent 1.5e-6 vs 1.5e-6)."""
    d = build_tiny_model("nemotron_h_moe", dtype="float32", **over)
    m = from_checkpoint(d, dtype=torch.float32)
    assert m.dims.moe is not None and m.dims.moe_layers == (1, 3)
    assert_fp32_within_hfs_own_error(d, m, token_ids(56, 1))


def test_bf16_logits_as_close_to_hf_fp64_as_hfs_own_bf16():
    """The bf16 checkpoint: |ours - HF fp64| at most 2x |HF bf16 - HF fp64| (HF sums the
    weighted experts in fp32, we round each product to bf16 as vLLM's fused MoE does;
    measured 0.025 vs HF's 0.023 at scale 2.3)."""
    d = build_tiny_model("nemotron_h_moe")
    m = from_checkpoint(d)
    ids = token_ids(40, 2)
    with torch.no_grad():
        ours = m.logits(m.sequence_hidden(ids)).double()
        hf = load_hf_model(d)(ids[None]).logits[0].double()
        ref = hf_eager(d)(ids[None]).logits[0]
    assert (ours - ref).abs().max() <= 2 * (hf - ref).abs().max()


def test_router_is_hfs_nemotron_router():
    """HF's ``NemotronHTopkRouter`` (fp32: sigmoid, bias-steered group-limited top-k,
    renormalized, scaled) and :func:`sigmoid_group_topk` choose the same experts with the same
    weights (HF's top-k is unsorted: compared as (id, weight) sets)."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    cfg = NemotronHConfig(**{k: v for k, v in tiny_config("nemotron_h_moe", n_routed_experts=16,
                                                          n_group=4, topk_group=2,
                                                          num_experts_per_tok=3).items()
                             if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    router = NemotronHTopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.05)
    x = torch.randn(64, cfg.hidden_size)
    with torch.no_grad():
        logits, hw, hids = router(x)
    w, ids = sigmoid_group_topk(logits, router.e_score_correction_bias, 3, 4, 2, True, 2.5)
    hs, hi = hids.sort(dim=-1)
    os_, oi = ids.sort(dim=-1)
    assert torch.equal(hs, os_)
    assert torch.equal(hw.gather(1, hi), w.gather(1, oi))


@settings(max_examples=8, deadline=None)
@given(T=st.integers(0, 40), k=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_grouped_relu2_experts_are_the_loop_bit_for_bit(T, k, seed):
    """Non-gated ``(up, down)`` experts: the grouped bf16 path (one GEMM call per projection)
    gives the per-expert loop's bits."""
    g = torch.Generator().manual_seed(seed)
    E, H, inter = 6, 32, 48
    mats = [(torch.randn(inter, H, generator=g).bfloat16(), torch.randn(H, inter, generator=g).bfloat16())
            for _ in range(E)]
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(T, k, generator=g)
    with torch.no_grad():
        grouped = routed_experts(x, ids, w, mats.__getitem__, num_experts=E)
        looped = routed_experts(x, ids, w, mats.__getitem__)
    assert torch.equal(grouped, looped)


@pytest.fixture(scope="module")
def latent_bf16():
    return from_checkpoint(build_tiny_model("nemotron_h_moe", **LATENT))


@settings(max_examples=4, deadline=None)
@given(lens=st.lists(st.integers(1, 24), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_hidden_states_and_routes_do_not_depend_on_the_batch(latent_bf16, lens, seed):
    """Packed with others == alone, hidden states and every MoE layer's routes; a prefix's
    rows are the whole sequence's."""
    m = latent_bf16
    seqs = [token_ids(n, seed + j) for j, n in enumerate(lens)]
    routes: dict = {}
    m.route_hook = lambda layer, ids: routes.setdefault(layer, []).append(ids.clone())
    try:
        with torch.no_grad():
            alone = [m.sequence_hidden(s) for s in seqs]
            packed = m.packed_hidden(seqs)
            pre = m.sequence_hidden(seqs[0][:max(1, lens[0] // 2)])
    finally:
        m.route_hook = None
    assert torch.equal(packed, torch.cat(alone))
    assert torch.equal(alone[0][:pre.shape[0]], pre)
    assert sorted(routes) == [0, 1]
    for layer in routes:
        assert torch.equal(routes[layer][len(seqs)], torch.cat(routes[layer][:len(seqs)]))
    assert m.route_info() == {"layers": 2, "k": 2, "num_experts": 8} and m.moe_layer_ids() == [1, 3]


@pytest.mark.parametrize("over, field", [
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"block_configs": [{"block_type": "moe"}]}, "block_configs"),
])
def test_moe_configs_it_cannot_reproduce_are_refused(over, field):
    cfg = SimpleNamespace(**json.loads(json.dumps(tiny_config("nemotron_h_moe", **over))))
    with pytest.raises(UnsupportedConfig) as e:
        InvariantNemotronH.config_parts(cfg)
    assert e.value.field == field


def test_mtp_tensors_are_skipped_like_hf_and_vllm():
    m = InvariantNemotronH.from_config(SimpleNamespace(**tiny_config("nemotron_h_moe")))
    assert m.ignored_weight("mtp.layers.0.mixer.gate.weight")
    assert not m.ignored_weight("backbone.layers.1.mixer.gate.weight")


def test_moe_dims_reads_nemotrons_moe_blocks():
    """``hf_config.moe_dims`` on the tiny checkpoints: the MoE layers are the ``moe`` blocks
    (from the saved config.json and from transformers' config object; NVIDIA's
    ``hybrid_override_pattern`` too); a dense config stays dense although its config class
    stores ``n_routed_experts``."""
    from transformers import AutoConfig

    d = build_tiny_model("nemotron_h_moe")
    saved = json.loads((d / "config.json").read_text())
    for cfg in (saved, AutoConfig.from_pretrained(str(d))):
        md = moe_dims(cfg)
        assert (md.num_experts, md.top_k, md.moe_intermediate, md.n_shared) == (8, 2, 64, 1)
        assert md.moe_layers() == [1, 3] and moe_layout(cfg) == (8, [1, 3])
    nvidia = {k: v for k, v in saved.items() if k != "layers_block_type"}
    nvidia["hybrid_override_pattern"] = "MEM*E"
    nvidia["num_hidden_layers"] = 5
    assert nemotron_block_types(nvidia)[1] == "moe" and moe_layout(nvidia) == (8, [1, 4])
    dense = json.loads((build_tiny_model("nemotron_h") / "config.json").read_text())
    assert dense.get("n_routed_experts") and moe_layout(dense) is None
    assert moe_layout({**nvidia, "hybrid_override_pattern": "M*M-M"}) is None
