"""The ``qwen3_next`` family (Gated DeltaNet + gated full attention, MoE), trainer side: HF's
own ``Qwen3NextForCausalLM`` is the reference (float32 against its float64 twin: our error
within a few times HF's own), and the fixed-order recurrence gives a token the same bits
whatever shares its call and however its sequence is cut into chunks."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.blocks import UnsupportedConfig
from skyrl_numerics.invariant.qwen3_next import InvariantQwen3Next
from hf_agreement import assert_fp32_within_hfs_own_error, assert_packing_and_prefix_invariant, hf_eager, token_ids
from skyrl_numerics.models import build_tiny_model, load_hf_model, tiny_config





@pytest.mark.parametrize("over", [{}, {"layer_types": ["full_attention", "linear_attention",
                                                       "linear_attention"],
                                       "num_hidden_layers": 3, "mlp_only_layers": [1]}])
def test_fp32_logits_are_hfs_within_hfs_own_error(over):
    """Same float32 weights, a 56-token sequence: |ours - HF fp64| at most 4x HF fp32's own
    |HF fp32 - HF fp64| plus 64 ulps of the logit scale (measured: ours 3.0e-6, HF's 2.2e-6 at
    scale 2.2) — the math is HF's: zero-centred norms, output gate, partial RoPE, the conv and
    the gated delta rule, the shared expert's gate."""
    d = build_tiny_model("qwen3_next", dtype="float32", **over)
    m = from_checkpoint(d, dtype=torch.float32)
    assert_fp32_within_hfs_own_error(d, m, token_ids(56, 1))


def test_bf16_logits_follow_hf_bf16():
    """The bf16 checkpoint: within 2 bf16 ulps of the logit scale of HF's own bf16 forward
    (HF rounds its RoPE cos/sin and the conv in bf16 where we stay fp32; measured 1 ulp)."""
    d = build_tiny_model("qwen3_next")
    m = from_checkpoint(d)
    ids = token_ids(40, 2)
    with torch.no_grad():
        ours = m.logits(m.sequence_hidden(ids)).float()
        ref = load_hf_model(d)(ids[None]).logits[0].float()
    assert (ours - ref).abs().max().item() <= 2 * 2.0 ** -8 * ref.abs().max().item()


@pytest.fixture(scope="module")
def bf16_model():
    return from_checkpoint(build_tiny_model("qwen3_next"))


@settings(max_examples=6)
@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_bf16_forward_is_prefix_and_packing_invariant(bf16_model, lens, seed):
    """Several sequences packed into one forward: each gets the bits it gets alone, and a
    prefix's rows are the whole sequence's first rows."""
    assert_packing_and_prefix_invariant(bf16_model, lens, seed)


@settings(max_examples=8)
@given(n=st.integers(2, 24), cuts=st.lists(st.integers(1, 23), max_size=4),
       others=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_scan_state_is_chunking_and_batch_invariant(bf16_model, n, cuts, others, seed):
    """The stateful part of a linear layer (conv + gated delta rule): a sequence scanned in one
    go, or in chunks handing the (conv, S) state on (chunked prefill, then decodes), gives the
    same output bits and final state; scanned in a batch beside other sequences (other states),
    its bits again."""
    m, g = bf16_model, bf16_model.gdn
    i = m.linear_layers()[0]
    gen = torch.Generator().manual_seed(seed)
    B = 1 + others
    qkv = torch.randn(B, n, g.conv_dim, generator=gen).bfloat16()
    beta = torch.rand(B, n, g.v_heads, generator=gen).bfloat16()
    dlog = -torch.rand(B, n, g.v_heads, generator=gen) * 2
    conv0, S0 = m.zero_state(B)
    conv0 = torch.randn(conv0.shape, generator=gen).bfloat16()
    S0 = torch.randn(S0.shape, generator=gen) * 0.1
    with torch.no_grad():
        o_all, c_all, S_all = m.scan(i, qkv, beta, dlog, conv0, S0)
        bounds = sorted({0, n, *[c for c in cuts if c < n]})
        c, S, outs = conv0[:1], S0[:1], []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            o, c, S = m.scan(i, qkv[:1, lo:hi], beta[:1, lo:hi], dlog[:1, lo:hi], c, S)
            outs.append(o)
    assert torch.equal(torch.cat(outs, dim=1), o_all[:1])
    assert torch.equal(c, c_all[:1]) and torch.equal(S, S_all[:1])


def test_decode_from_the_state_is_the_prefill(bf16_model):
    """The engine's path through the model: a prompt, then one token at a time with each
    linear layer's state handed on (a keeper like the engine's) and the attention reading the
    cached rows, gives the rows of one prefill of the whole sequence."""
    m = bf16_model
    ids = token_ids(20, 7)

    class Keeper:
        def __init__(self):
            self.state = {}

        def mix(self, model, i, qkv, beta, dlog, positions):
            st0 = self.state.get(i) if int(positions[0]) > 0 else None
            conv0, S0 = st0 if st0 is not None else model.zero_state(1)
            o, conv, S = model.scan(i, qkv[None], beta[None], dlog[None], conv0, S0)
            self.state[i] = (conv, S)
            return o[0]

    rows = {}

    def attend(i, q, r):
        rows[i] = torch.cat([rows[i], r]) if i in rows and q.shape[0] == 1 else r
        R = m.cache_roundtrip(i, rows[i])
        return m.attn_core(i, q[None], R[None], None)[0]

    keeper = Keeper()
    m.recurrent = keeper
    try:
        with torch.no_grad():
            got = [m.forward_tokens(ids[:12], torch.arange(12), attend)]
            for t in range(12, 20):
                got.append(m.forward_tokens(ids[t:t + 1], torch.tensor([t]), attend))
    finally:
        m.recurrent = None
    with torch.no_grad():
        assert torch.equal(torch.cat(got), m.sequence_hidden(ids))


def test_fp32_gradient_is_hf_autograds():
    """fp32 backward of a loss over every position, against HF float64 autograd: each weight
    gradient's relative error at most 4x HF fp32's own plus 1e-5 (the decay parameters A_log and
    dt_bias are ill-conditioned: HF's own error 3.7e-4, ours 1.1e-3; the projections 1e-6)."""
    d = build_tiny_model("qwen3_next", dtype="float32")
    m = from_checkpoint(d, dtype=torch.float32)
    hf, h64 = load_hf_model(d, dtype="float32"), hf_eager(d)
    for p in m.parameters():
        p.requires_grad_(True)
    ids = token_ids(24, 3)
    with torch.enable_grad():
        for model, out in ((m, lambda: m.logits(m.sequence_hidden(ids))),
                           (hf, lambda: hf(ids[None]).logits[0]), (h64, lambda: h64(ids[None]).logits[0])):
            out().logsumexp(-1).sum().backward()
    for name in ("model.layers.0.linear_attn.in_proj_qkvz.weight",
                 "model.layers.0.linear_attn.in_proj_ba.weight", "model.layers.0.linear_attn.A_log",
                 "model.layers.0.linear_attn.dt_bias", "model.layers.0.linear_attn.conv1d.weight",
                 "model.layers.0.linear_attn.norm.weight", "model.layers.1.self_attn.q_proj.weight",
                 "model.layers.1.input_layernorm.weight", "model.layers.1.mlp.shared_expert_gate.weight"):
        ref = h64.get_parameter(name).grad
        ours = m.params[name.replace(".", "__")].grad
        assert ours is not None, name
        rel = lambda g: ((g.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        assert rel(ours) <= 4 * rel(hf.get_parameter(name).grad) + 1e-5, (name, rel(ours))


@pytest.mark.parametrize("over, field", [
    ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_configs_it_cannot_reproduce_are_refused(over, field):
    from types import SimpleNamespace

    cfg = SimpleNamespace(**json.loads(json.dumps(tiny_config("qwen3_next", **over))))
    with pytest.raises(UnsupportedConfig) as e:
        InvariantQwen3Next.config_parts(cfg)
    assert e.value.field == field


def test_mtp_draft_tensors_are_skipped_and_others_refused(tmp_path):
    """A hub Qwen3-Next checkpoint ships its multi-token-prediction module under ``mtp.`` (vLLM
    drops the prefix): the invariant model loads such a checkpoint with the same bits as without
    it; any other tensor it would not run is still refused, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = build_tiny_model("qwen3_next")
    d = tmp_path / "with_mtp"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    extra = {"mtp.fc.weight": torch.zeros(8, 8, dtype=torch.bfloat16),
             "mtp.layers.0.input_layernorm.weight": torch.ones(8, dtype=torch.bfloat16)}
    save_file({**tensors, **extra}, str(d / "model.safetensors"))
    ids = token_ids(20, 9)
    with torch.no_grad():
        assert torch.equal(from_checkpoint(d).sequence_hidden(ids), from_checkpoint(src).sequence_hidden(ids))
    save_file({**tensors, "model.extra.weight": torch.zeros(4, dtype=torch.bfloat16)},
              str(d / "model.safetensors"))
    with pytest.raises(InputError, match="does not use") as e:
        from_checkpoint(d)
    assert e.value.field == "model.extra.weight"
