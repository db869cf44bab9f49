"""The vLLM-style pieces of the HF DeepSeek-V3 forward (doctor/mla_attribution/): exact in
fp64 where the math is the same, different (and close) in bf16, restored bitwise on exit, and the
rotary-kernel emulation pinned to vLLM CPU's own kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_numerics.models import load_hf_model
from skyrl_numerics.doctor import mla_attribution as A
from skyrl_numerics.doctor.mla_attribution import hf_forward as HF


@pytest.fixture(scope="module")
def bf16(deepseek_v3_dir):
    return load_hf_model(deepseek_v3_dir)


@pytest.fixture(scope="module")
def fp64(deepseek_v3_dir):
    m = load_hf_model(deepseek_v3_dir, dtype="float64")
    m.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    return m


def _ids(B=2, S=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 512, (B, S), generator=g)


def _hidden(model, ids, **kw):
    with torch.no_grad():
        return model.model(input_ids=ids, **kw).last_hidden_state


def test_absorbed_equals_expanded_in_fp64():
    g = torch.Generator().manual_seed(0)
    B, H, S, P, R, V, L = 2, 3, 7, 8, 4, 8, 16
    d = torch.float64
    q_nope = torch.randn(B, H, S, P, generator=g, dtype=d)
    q_pe = torch.randn(B, H, S, R, generator=g, dtype=d)
    c, k_pe = torch.randn(B, S, L, generator=g, dtype=d), torch.randn(B, S, R, generator=g, dtype=d)
    kv_b = torch.nn.Linear(L, H * (P + V), bias=False).to(d)
    w = kv_b.weight.view(H, P + V, L)
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    bias = torch.zeros(S, S, dtype=d).masked_fill(future, float("-inf"))
    ab = A.absorbed_attention(q_nope, q_pe, c, k_pe, w[:, :P], w[:, P:], 0.3, bias, d)
    ex = A.expanded_attention(q_nope, q_pe, c, k_pe, kv_b, P, 0.3, bias, d)
    assert (ab - ex).abs().max() < 1e-10


@pytest.mark.parametrize("prefill,rope", [("absorbed", "hf"), ("expanded", "hf"),
                                          ("absorbed", "vllm")])
def test_vllm_mla_is_exact_in_fp64(fp64, prefill, rope):
    ids = _ids()
    ref = _hidden(fp64, ids)
    with A.vllm_style_mla(fp64, [5, 9], prefill=prefill, rope=rope):
        got = _hidden(fp64, ids)
    assert (got - ref).abs().max() < 1e-10


def test_restored_forward_is_bitwise_the_original(bf16):
    ids = _ids()
    ref = _hidden(bf16, ids)
    attn = HF._modules(bf16, "DeepseekV3Attention")
    with A.vllm_style(bf16, ["mla", "router", "moe", "mlp"], rope="vllm"):
        assert all("forward" in m.__dict__ for m in attn)
        patched = _hidden(bf16, ids)
    assert not any("forward" in m.__dict__ for m in bf16.modules())
    assert torch.equal(_hidden(bf16, ids), ref)
    # in bf16 the formulations round differently: not equal, but close
    assert not torch.equal(patched, ref)
    assert ((patched - ref).float().norm() / ref.float().norm()) < 5e-2


def test_patch_is_restored_after_an_error(bf16):
    with pytest.raises(RuntimeError, match="boom"):
        with A.vllm_style_mla(bf16):
            raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in bf16.modules())


def test_hf_formulation_path_is_bitwise_hf(bf16):
    """The patched forward's HF branch (used by vllm_cpu_rope) is HF's own computation."""
    ids = _ids(seed=3)
    ref = _hidden(bf16, ids)
    with HF._mla_patch(bf16, formulation="hf", prompt_lens=None, prefill="absorbed", rope="hf",
                       rope_positions=None, what="test"):
        got = _hidden(bf16, ids)
    assert torch.equal(got, ref)


def test_cpu_rope_with_true_positions_is_exact_in_fp64(fp64):
    ids = _ids(B=2, S=10)
    ref = _hidden(fp64, ids)
    H = fp64.config.num_attention_heads
    true = [np.tile(np.arange(10), (H + 1, 1))] * 2
    with A.vllm_cpu_rope(fp64, true):
        assert (_hidden(fp64, ids) - ref).abs().max() < 1e-10
    wrong = [np.zeros((H + 1, 10), dtype=np.int64)] * 2
    with A.vllm_cpu_rope(fp64, wrong):
        assert (_hidden(fp64, ids) - ref).abs().max() > 1e-3


def test_moe_router_mlp_pieces_match_hf_in_fp64(fp64):
    ids = _ids(seed=5)
    ref = _hidden(fp64, ids)
    for pieces in (["router"], ["moe"], ["mlp"], ["router", "moe", "mlp"]):
        with A.vllm_style(fp64, pieces):
            # HF's router computes in fp32 even in an fp64 model: agreement to fp32 level
            assert (_hidden(fp64, ids) - ref).abs().max() < 1e-5, pieces


def test_cpu_rope_positions_hand_computed(fp64):
    cfg = fp64.config  # 4 heads; k_pe token stride (64 + 512 + 64) / 64 = 10 kernel rows
    P, R = 16, 4
    pos = A.cpu_rope_positions([P], [R], cfg)[0]
    assert pos.shape == (cfg.num_attention_heads + 1, P + R)
    # prefill (16 tokens): kernel rows 0..15 = (token r // 4, head r % 4), rotated by position r
    np.testing.assert_array_equal(pos[:4, :4], np.arange(16).reshape(4, 4).T)
    assert (pos[:4, 4:16] == 0).all()
    # keys: kernel row 10 t is token t's k_pe, for 10 t < 16
    np.testing.assert_array_equal(pos[4, :16], [0, 10] + [0] * 14)
    # decode (1 token): head 0 and the key rotated correctly, heads 1..3 not at all
    np.testing.assert_array_equal(pos[0, 16:19], [16, 17, 18])
    assert (pos[1:4, 16:19] == 0).all()
    np.testing.assert_array_equal(pos[4, 16:19], [16, 17, 18])
    assert (pos[:, 19] == 19).all()  # the last sampled token is never fed


def test_schedule_and_input_errors(bf16, fp64):
    with pytest.raises(ValueError, match="prompt_lens"):
        with A.vllm_style_mla(bf16, prefill="expanded"):
            pass
    with pytest.raises(ValueError, match="unknown pieces"):
        with A.vllm_style(bf16, ["mla", "nope"]):
            pass
    with pytest.raises(ValueError, match="rope_positions"):
        with A.vllm_style(bf16, ["cpu_rope"]):
            pass
    with pytest.raises(ValueError, match="DeepseekV3Attention"):
        with A.vllm_style_mla(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(ValueError, match="3 entries"):
        with A.vllm_style_mla(fp64, [1, 2, 3], prefill="expanded"):
            _hidden(fp64, _ids())
    steps = A.lockstep_schedule([3, 2], [3, 1])
    assert steps == [[(0, 0, 3), (1, 0, 2)], [(0, 3, 1)], [(0, 4, 1)]]


@pytest.mark.vllm
def test_emulation_matches_vllm_cpu_rotary_kernel(fp64):
    """vLLM CPU's own rotary op on the views MLA passes it rotates exactly the rows
    cpu_rope_positions predicts (fp32 tensors, so the comparison is exact to fp32)."""
    ops = pytest.importorskip("vllm._custom_ops")
    cfg = fp64.config
    H, Pn, R, L, Q = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                      cfg.kv_lora_rank, cfg.q_lora_rank)
    # one engine step: request 0 decodes position 7, request 1 prefills positions 0..12
    step = [(0, 7, 1), (1, 0, 13)]
    toks = [(row, p) for row, s, n in step for p in range(s, s + n)]
    T = len(toks)
    positions = torch.tensor([p for _, p in toks])
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(T, Q + L + R, generator=g)           # fused q_a / kv_a output
    q = torch.randn(T, H, Pn + R, generator=g)               # q_b_proj output, per head
    q_pe, k_pe = q[..., Pn:], fused[:, Q + L:].unsqueeze(1)  # the views MLA passes
    q0, k0 = q_pe.clone(), k_pe.clone()
    theta = cfg.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.float) / R))
    ang = torch.arange(64, dtype=torch.float)[:, None] * inv[None]
    cache = torch.cat([ang.cos(), ang.sin()], dim=-1)
    ops.rotary_embedding(positions, q_pe, k_pe, R, cache, False)

    def gptj(x, p):  # interleaved rotation of x [R] by position p (vLLM's own layout)
        c, s = ang[p].cos(), ang[p].sin()
        x1, x2 = x[0::2], x[1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten()

    pos = A.cpu_rope_positions([7, 13], [2, 1], cfg, steps=[step])
    for t, (row, p) in enumerate(toks):
        for h in range(H):
            want = gptj(q0[t, h], int(pos[row][h, p]))
            assert torch.allclose(q_pe[t, h], want, atol=1e-5), (t, h)
        assert torch.allclose(k_pe[t, 0], gptj(k0[t, 0], int(pos[row][H, p])), atol=1e-5), t


@pytest.mark.vllm
def test_rowwise_rope_fix_rotates_every_head_by_its_position(fp64):
    """MLARopeFixExtension's wrapper: vLLM's own rotary layer, called through 2-D copies of the
    MLA views, rotates every query head and key by the token's own position."""
    ops = pytest.importorskip("vllm._custom_ops")
    cfg = fp64.config
    H, Pn, R, L, Q = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                      cfg.kv_lora_rank, cfg.q_lora_rank)
    theta = cfg.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, R, 2, dtype=torch.float) / R))
    ang = torch.arange(64, dtype=torch.float)[:, None] * inv[None]
    cache = torch.cat([ang.cos(), ang.sin()], dim=-1)

    def rope(positions, query, key):  # what vLLM's RotaryEmbedding.forward_cpu does
        ops.rotary_embedding(positions, query, key, R, cache, False)
        return query, key

    def ref(x, positions):  # [T, n * R] rotated per R-chunk by each token's position
        T = x.shape[0]
        x = x.view(T, -1, R)
        c, s_ = ang[positions].cos()[:, None], ang[positions].sin()[:, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s_, x2 * c + x1 * s_], -1).reshape(T, -1)

    T = 9
    positions = torch.tensor([5, 0, 1, 2, 3, 4, 5, 6, 7])
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(T, Q + L + R, generator=g)
    q = torch.randn(T, H, Pn + R, generator=g)
    q0, k0 = q[..., Pn:].clone(), fused[:, Q + L:].clone()
    k_pe = fused[:, Q + L:].unsqueeze(1)
    from skyrl_numerics.engine.vllm_patches import _RowwiseRope

    q[..., Pn:], k_pe = _RowwiseRope(rope)(positions, q[..., Pn:], k_pe)
    ref_q, ref_k = ref(q0.reshape(T, -1), positions), ref(k0, positions)
    assert torch.allclose(q[..., Pn:].reshape(T, -1), ref_q, atol=1e-5)
    assert torch.allclose(k_pe.reshape(T, -1), ref_k, atol=1e-5)


def test_recorded_steps_maps_requests_to_rows():
    from skyrl_numerics.rollout import Rollout

    ro = Rollout.from_lists([[5, 6, 7], [8, 9]], [[10, 11], [12, 13]],
                            [[-1.0, -1.0], [-1.0, -1.0]])

    class FakeLLM:
        def collective_rpc(self, name, args=()):
            assert name == "skyrl_mla_schedule_fetch"
            warm = [["w-1", "w-1"], [0, 1], [2, 3]]
            s1 = [["a-x"] * 3, [0, 1, 2], [5, 6, 7]]
            s2 = [["a-x", "b-y", "b-y"], [3, 0, 1], [10, 8, 9]]
            s3 = [["b-y", "a-x"], [2, 4], [12, 11]]
            return [[warm, s1, s2, s3]]

    class FakeGen:
        llm = FakeLLM()

    steps = A.recorded_steps(FakeGen(), ro)
    assert steps == [[(0, 0, 3)], [(0, 3, 1), (1, 0, 2)], [(1, 2, 1), (0, 4, 1)]]
