"""Advantages, PPO-clip, aggregation and KL estimators against hand-computed values and a
per-token pure-Python reference (math module, no torch)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.trainer.losses import (aggregate, compute_advantages, grpo_advantages, kl_estimators,
                                           ppo_clip_loss, rloo_advantages, token_advantages)

S3 = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1, 0]


# ---- advantages --------------------------------------------------------------------------------
def test_grpo_hand_values():
    r = [1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 3.0]
    g = [0, 0, 0, 0, 1, 1, 2]
    a = grpo_advantages(r, g, eps=1e-6)
    want = [0.5 / (S3 + 1e-6), -0.5 / (S3 + 1e-6)] * 2 + [0.0, 0.0, 3.0 / (1 + 1e-6)]
    np.testing.assert_allclose(a.numpy(), want, rtol=1e-6)
    assert a.dtype == torch.float32 and not a.requires_grad


def test_grpo_without_std_and_group_order():
    r = torch.tensor([3.0, 1.0, 5.0, 0.0, 4.0], dtype=torch.float64)
    g = torch.tensor([7, 2, 7, 2, 7])  # interleaved, non-contiguous ids
    a = grpo_advantages(r, g, std_normalize=False)
    np.testing.assert_allclose(a.numpy(), [-1.0, 0.5, 1.0, -0.5, 0.0], rtol=0, atol=1e-15)
    assert a.dtype == torch.float64


def test_rloo_hand_values():
    r = [1.0, 0.0, 1.0, 0.0, 2.0, 4.0, 3.0]
    g = [0, 0, 0, 0, 1, 1, 2]
    a = rloo_advantages(r, g)
    # 1 - (0+1+0)/3 = 2/3 ; 0 - 2/3 ; 2 - 4 ; 4 - 2 ; singleton keeps its reward
    np.testing.assert_allclose(a.numpy(), [2 / 3, -2 / 3, 2 / 3, -2 / 3, -2.0, 2.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(compute_advantages("rloo", r, g).numpy(), a.numpy())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=8),
       st.floats(-3, 3), st.floats(0.5, 4))
def test_advantage_properties(rewards, shift, scale):
    r = np.array(rewards)
    g = np.zeros(len(r), dtype=np.int64)
    # RLOO sums to zero in a group and equals n/(n-1) times the mean-centred reward
    a = rloo_advantages(r, g).double().numpy()
    n = len(r)
    np.testing.assert_allclose(a, n / (n - 1) * (r - r.mean()), atol=1e-5)
    # GRPO is invariant to a shift; with std normalisation (eps=0) also to a positive scale
    if r.std() > 1e-3:
        a1 = grpo_advantages(r, g, eps=0.0).numpy()
        a2 = grpo_advantages(r * scale + shift, g, eps=0.0).numpy()
        np.testing.assert_allclose(a1, a2, atol=1e-4)
    np.testing.assert_allclose(grpo_advantages(r + shift, g, std_normalize=False).numpy(),
                               grpo_advantages(r, g, std_normalize=False).numpy(), atol=1e-4)


def test_advantage_errors():
    with pytest.raises(InputError, match="rewards"):
        grpo_advantages([1.0, float("nan")], [0, 0])
    with pytest.raises(InputError, match="group_ids"):
        grpo_advantages([1.0, 2.0], [0])
    with pytest.raises(InputError, match="advantage"):
        compute_advantages("ppo", [1.0])


def test_token_advantages():
    a = token_advantages(torch.tensor([1.0, -2.0, 3.0]), np.array([0, 2, 2, 5]))
    assert a.tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]
    with pytest.raises(InputError, match="cu_seqlens"):
        token_advantages(torch.tensor([1.0]), np.array([0, 1, 2]))


# ---- PPO-clip ------------------------------------------------------------------------------------
def _ref_token_loss(lp, old, a, eps_low, eps_high, dual=None):
    """Pure-Python ℓ_t = -min(r A, clip(r, 1-εl, 1+εh) A), optional dual clip."""
    r = math.exp(lp - old)
    c = min(max(r, 1 - eps_low), 1 + eps_high)
    loss = -min(r * a, c * a)
    if dual is not None and a < 0:
        loss = min(loss, -dual * a)
    return loss


def test_ppo_clip_hand_values_and_gradient():
    old = torch.zeros(5, dtype=torch.float64)
    lp = torch.tensor([0.5, -0.5, math.log(1.1), -0.5, math.log(1.25)], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    out = ppo_clip_loss(lp, old, adv, eps_low=0.2, eps_high=0.28)
    # r = e^.5 > 1.28 clipped -> -1.28 ; r = e^-.5 < .8 with A<0 clipped -> +.8 ; 1.1*2 ; e^-.5*1 (A>0, low side
    # is not clipped) ; 1.25 < 1.28 unclipped
    want = [-1.28, 0.8, -2.2, -math.exp(-0.5), -1.25]
    np.testing.assert_allclose(out.per_token.detach().numpy(), want, rtol=1e-12)
    assert out.loss.item() == pytest.approx(sum(want) / 5, rel=1e-12)
    out.loss.backward()
    # clipped tokens get no gradient; others d/dlp (-r A)/N = -r A / 5
    g = lp.grad.numpy()
    np.testing.assert_allclose(g, [0.0, 0.0, -2.2 / 5, -math.exp(-0.5) / 5, -1.25 / 5], rtol=1e-12, atol=0)
    assert out.metrics["clipfrac_high"] == pytest.approx(1 / 5)
    assert out.metrics["clipfrac_low"] == pytest.approx(1 / 5)
    assert out.metrics["clipfrac"] == pytest.approx(2 / 5)
    # symmetric eps (0.2): r = 1.25 is now clipped to 1.2
    sym = ppo_clip_loss(lp, old, adv, eps_low=0.2, eps_high=0.2)
    assert sym.per_token[4].item() == pytest.approx(-1.2, rel=1e-12)


def test_dual_clip():
    lp = torch.tensor([math.log(5.0), math.log(5.0)], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    plain = ppo_clip_loss(lp, torch.zeros(2, dtype=torch.float64), adv, eps_high=0.28)
    dual = ppo_clip_loss(lp, torch.zeros(2, dtype=torch.float64), adv, eps_high=0.28, dual_clip=3.0)
    np.testing.assert_allclose(plain.per_token.numpy(), [5.0, -1.28], rtol=1e-12)
    np.testing.assert_allclose(dual.per_token.numpy(), [3.0, -1.28], rtol=1e-12)
    assert dual.metrics["dual_clipfrac"] == 0.5


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 0), st.floats(-3, 0), st.floats(-2, 2), st.booleans(),
                          st.floats(0, 2)), min_size=1, max_size=12),
       st.floats(0.05, 0.4), st.floats(0.05, 0.5), st.sampled_from([None, 2.0, 3.0]))
def test_ppo_clip_matches_python_reference(rows, eps_low, eps_high, dual):
    lp, old, adv, keep, w = (torch.tensor(c, dtype=torch.float64) for c in zip(*rows))
    keep = keep.bool()
    out = ppo_clip_loss(lp, old, adv, mask=keep, weights=w, eps_low=eps_low, eps_high=eps_high, dual_clip=dual)
    ref = [_ref_token_loss(*r[:3], eps_low, eps_high, dual) for r in rows]
    np.testing.assert_allclose(out.per_token.numpy(), ref, rtol=1e-9, atol=1e-12)
    kept = [(x, r[4]) for x, r in zip(ref, rows) if r[3]]
    want = sum(x * wt for x, wt in kept) / len(kept) if kept else 0.0
    assert out.loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_ppo_clip_errors():
    x = torch.zeros(3)
    with pytest.raises(InputError, match="old_logprobs"):
        ppo_clip_loss(x, torch.zeros(2), x)
    with pytest.raises(InputError, match="eps"):
        ppo_clip_loss(x, x, x, eps_low=1.5)
    with pytest.raises(InputError, match="dual_clip"):
        ppo_clip_loss(x, x, x, dual_clip=0.5)


# ---- aggregation ---------------------------------------------------------------------------------
def test_aggregation_hand_values():
    ell = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    w = torch.tensor([1.0, 0.5, 9.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    cu = np.array([0, 3, 3, 6])  # seq 0: tokens 0-2, seq 1 empty, seq 2: tokens 3-5
    # token mean: (1 + 1 + 8 + 5 + 6) / 5 ; the masked token (w=9) leaves numerator and denominator
    assert aggregate(ell, mask, w, mode="token_mean").item() == pytest.approx(21 / 5)
    # seq-mean-token-mean: seq0 (1 + 1)/2 = 1, seq2 (8 + 5 + 6)/3 ; empty seq not counted
    want = (1.0 + 19 / 3) / 2
    assert aggregate(ell, mask, w, cu_seqlens=cu, mode="seq_mean_token_mean").item() == pytest.approx(want)
    # a global denominator (data-parallel) overrides the local count
    assert aggregate(ell, mask, w, mode="token_mean", denominator=10).item() == pytest.approx(2.1)
    assert aggregate(ell, mask, w, cu_seqlens=cu, mode="seq_mean_token_mean",
                     denominator=4).item() == pytest.approx((1.0 + 19 / 3) / 4)


def test_aggregation_split_batch_sums_to_whole():
    """Σ over shards of (shard numerator / global D) == whole-batch loss: the data-parallel identity."""
    g = torch.Generator().manual_seed(0)
    ell = torch.randn(20, generator=g, dtype=torch.float64)
    mask = torch.rand(20, generator=g) > 0.3
    cu = np.array([0, 4, 9, 9, 15, 20])
    whole = aggregate(ell, mask, cu_seqlens=cu, mode="seq_mean_token_mean")
    parts = (aggregate(ell[:9], mask[:9], cu_seqlens=cu[:3], mode="seq_mean_token_mean", denominator=4)
             + aggregate(ell[9:], mask[9:], cu_seqlens=cu[2:] - 9, mode="seq_mean_token_mean", denominator=4))
    n_kept_seqs = sum(bool(mask[a:b].any()) for a, b in zip(cu[:-1], cu[1:]))
    assert n_kept_seqs == 4
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)
    tok = aggregate(ell[:7], mask[:7], denominator=int(mask.sum())) + aggregate(ell[7:], mask[7:],
                                                                                 denominator=int(mask.sum()))
    assert tok.item() == pytest.approx(aggregate(ell, mask).item(), rel=1e-12)


def test_aggregation_all_masked_gives_zero_with_grad():
    ell = torch.ones(3, requires_grad=True)
    loss = aggregate(ell, torch.zeros(3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and ell.grad.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(InputError, match="aggregation"):
        aggregate(ell, mode="sum")


# ---- KL ------------------------------------------------------------------------------------------
def test_kl_estimators_hand_values():
    lp = np.array([-1.0, -2.0, -0.5])
    ref = np.array([-1.5, -1.0, -0.5])
    d = ref - lp  # [-0.5, 1.0, 0.0]
    out = kl_estimators(lp, ref)
    assert out["kl_k1"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    assert out["kl_k2"] == pytest.approx((0.125 + 0.5 + 0.0) / 3)
    assert out["kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    masked = kl_estimators(lp, ref, mask=[True, False, True])
    assert masked["kl_k3"] == pytest.approx((math.exp(-0.5) - 1 + 0.5) / 2)
