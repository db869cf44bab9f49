"""The ``nemotron_h`` family (Mamba-2 + attention + ReLU² MLP blocks), trainer side: HF's own
``NemotronHForCausalLM`` is the reference (float32 against its float64 twin: our error within
a few times HF's own), and the fixed-order Mamba-2 recurrence gives a token the same bits
whatever shares its call and however its sequence is cut into chunks."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.blocks import UnsupportedConfig
from skyrl_numerics.invariant.nemotron_h import InvariantNemotronH
from hf_agreement import assert_fp32_within_hfs_own_error, assert_packing_and_prefix_invariant, token_ids
from skyrl_numerics.models import build_tiny_model, load_hf_model, tiny_config




@pytest.mark.parametrize("over", [{}, {"n_groups": 2, "layers_block_type": [
    "full_attention", "linear_attention", "mlp", "linear_attention"], "num_hidden_layers": 4}])
def test_fp32_logits_are_hfs_within_hfs_own_error(over):
    """Same float32 weights, a 56-token sequence (longer than the config's chunk_size 32, so
    HF's chunked SSD scan crosses a chunk): |ours - HF fp64| at most 4x HF fp32's own error plus
    64 ulps of the logit scale (measured: ours 2.0e-6, HF's 1.5e-6 at scale 2.2)."""
    d = build_tiny_model("nemotron_h", dtype="float32", **over)
    m = from_checkpoint(d, dtype=torch.float32)
    assert_fp32_within_hfs_own_error(d, m, token_ids(56, 1))


def test_bf16_logits_follow_hf_bf16():
    """The bf16 checkpoint: within 2 bf16 ulps of the logit scale of HF's own bf16 forward
    (measured 1 ulp)."""
    d = build_tiny_model("nemotron_h")
    m = from_checkpoint(d)
    ids = token_ids(40, 2)
    with torch.no_grad():
        ours = m.logits(m.sequence_hidden(ids)).float()
        ref = load_hf_model(d)(ids[None]).logits[0].float()
    assert (ours - ref).abs().max().item() <= 2 * 2.0 ** -8 * ref.abs().max().item()


@pytest.fixture(scope="module")
def bf16_model():
    return from_checkpoint(build_tiny_model("nemotron_h"))


@settings(max_examples=5)
@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_bf16_forward_is_prefix_and_packing_invariant(bf16_model, lens, seed):
    assert_packing_and_prefix_invariant(bf16_model, lens, seed)


@settings(max_examples=6)
@given(n=st.integers(2, 24), cuts=st.lists(st.integers(1, 23), max_size=4),
       others=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_scan_state_is_chunking_and_batch_invariant(bf16_model, n, cuts, others, seed):
    """The Mamba-2 layer's stateful part: one go == chunks handing (conv, S) on, and a
    sequence's bits in a batch of others are its own."""
    m, md = bf16_model, bf16_model.mamba_dims
    i = m.linear_layers()[0]
    gen = torch.Generator().manual_seed(seed)
    B = 1 + others
    xbc = torch.randn(B, n, md.conv_dim, generator=gen).bfloat16()
    dt = torch.rand(B, n, md.heads, generator=gen) * 0.1 + 1e-3
    conv0, S0 = m.zero_state(B)
    conv0 = torch.randn(conv0.shape, generator=gen).bfloat16()
    S0 = torch.randn(S0.shape, generator=gen) * 0.1
    with torch.no_grad():
        y_all, c_all, S_all = m.scan(i, xbc, dt, None, conv0, S0)
        bounds = sorted({0, n, *[c for c in cuts if c < n]})
        c, S, outs = conv0[:1], S0[:1], []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            y, c, S = m.scan(i, xbc[:1, lo:hi], dt[:1, lo:hi], None, c, S)
            outs.append(y)
    assert torch.equal(torch.cat(outs, dim=1), y_all[:1])
    assert torch.equal(c, c_all[:1]) and torch.equal(S, S_all[:1])


def test_fp32_gradient_is_hf_autograds():
    """fp32 backward against HF float64 autograd: each weight gradient's relative error at
    most 4x HF fp32's own plus 1e-5."""
    d = build_tiny_model("nemotron_h", dtype="float32")
    m = from_checkpoint(d, dtype=torch.float32)
    hf, h64 = load_hf_model(d, dtype="float32"), load_hf_model(d, dtype="float64")
    for p in m.parameters():
        p.requires_grad_(True)
    ids = token_ids(40, 3)
    with torch.enable_grad():
        for out in (lambda: m.logits(m.sequence_hidden(ids)), lambda: hf(ids[None]).logits[0],
                    lambda: h64(ids[None]).logits[0]):
            out().logsumexp(-1).sum().backward()
    for name in ("backbone.layers.0.mixer.in_proj.weight", "backbone.layers.0.mixer.conv1d.weight",
                 "backbone.layers.0.mixer.A_log", "backbone.layers.0.mixer.D",
                 "backbone.layers.0.mixer.dt_bias", "backbone.layers.0.mixer.norm.weight",
                 "backbone.layers.1.mixer.q_proj.weight", "backbone.layers.2.mixer.up_proj.weight"):
        hf_name = name.replace("backbone.", "model.")      # (HF's module path; the file's is ours)
        ref = h64.get_parameter(hf_name).grad
        ours = m.params[name.replace(".", "__")].grad
        assert ours is not None, name
        rel = lambda g: ((g.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        assert rel(ours) <= 4 * rel(hf.get_parameter(hf_name).grad) + 1e-5, (name, rel(ours))


@pytest.mark.parametrize("over, field", [
    ({"layers_block_type": ["linear_attention", "sliding_attention", "mlp"]}, "layers_block_type"),
    ({"layers_block_type": ["linear_attention", "moe", "mlp"]}, "n_routed_experts"),   # no experts
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"use_bias": True}, "use_bias"),
])
def test_configs_it_cannot_reproduce_are_refused(over, field):
    from types import SimpleNamespace

    cfg = SimpleNamespace(**json.loads(json.dumps(tiny_config("nemotron_h", **over))))
    with pytest.raises(UnsupportedConfig) as e:
        InvariantNemotronH.config_parts(cfg)
    assert e.value.field == field
