"""The PPO core on multi-turn rollouts: observation tokens (``loss_mask`` False) leave the loss,
its denominator, the correction and its metrics — the update equals the one computed on the
model tokens alone, whatever the observation tokens' logprobs are."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics import correction as corr
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.config import TrainerConfig
from skyrl_numerics.trainer.ppo_step import ppo_update


def _rollout(rng, turns_per_row):
    """Rows of alternating observation / model segments (turn 0: model only)."""
    prompts, resp, lps, mask, turns = [], [], [], [], []
    for n_turns in turns_per_row:
        r, lp, m, t = [], [], [], []
        for k in range(n_turns):
            if k:
                for _ in range(int(rng.integers(1, 4))):     # observation tokens
                    r.append(int(rng.integers(0, 64))); lp.append(None); m.append(False); t.append(k)
            for _ in range(int(rng.integers(1, 4))):         # model tokens
                r.append(int(rng.integers(0, 64))); lp.append(float(-rng.random() * 3))
                m.append(True); t.append(k)
        prompts.append([1, 2, 3]); resp.append(r); lps.append(lp); mask.append(m); turns.append(t)
    return Rollout.from_lists(prompts, resp, lps, loss_mask=mask, turns=turns,
                              group_ids=np.zeros(len(prompts), np.int64))


def _update(ro, theta, rewards, correction, old):
    """One ppo_update where the "policy" logprob of token j is theta[j] (a leaf tensor)."""
    theta = theta.clone().requires_grad_(True)
    cu = np.asarray(ro.response_cu, np.int64)
    mb = SimpleNamespace(token_index=np.arange(ro.num_response_tokens, dtype=np.int64), cu_seqlens=cu)
    out = ppo_update(ro, rewards, TrainerConfig(), micro_batches=[mb],
                     forward=lambda _mb: (theta, torch.zeros_like(theta)),
                     update=lambda: (0.0, 1), correction=correction, old_logprobs=old)
    return out, theta.grad.clone()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), use_tis=st.booleans())
def test_observation_tokens_never_count(seed, use_tis):
    rng = np.random.default_rng(seed)
    ro = _rollout(rng, [int(x) for x in rng.integers(1, 4, size=3)])
    m = ro.loss_mask
    theta = torch.from_numpy(np.where(m, ro.rollout_logprobs, -1.0).astype(np.float32)
                             + rng.normal(0, 0.3, m.size).astype(np.float32))
    old = theta.detach().numpy() + rng.normal(0, 0.1, m.size).astype(np.float32)
    rewards = rng.random(len(ro))
    fn = (lambda *a, **k: corr.token_tis(*a, **k, cap=1.2)) if use_tis else None
    out, grad = _update(ro, theta, rewards, fn, old)
    # observation tokens get no gradient and are not counted
    assert (grad[torch.from_numpy(~m)] == 0).all()
    assert out["n_tokens"] == float(m.sum())
    # their values do not matter: scramble the policy and old logprobs there
    theta2, old2 = theta.clone(), old.copy()
    theta2[torch.from_numpy(~m)] = torch.from_numpy(rng.normal(0, 5, int((~m).sum())).astype(np.float32))
    old2[~m] = rng.normal(0, 5, int((~m).sum()))
    out2, grad2 = _update(ro, theta2, rewards, fn, old2)
    assert torch.equal(grad, grad2)
    for k in ("loss", "clipfrac", "ratio_mean", "ppo_kl"):
        assert out[k] == out2[k], k
    if use_tis:     # the correction's metrics are over model tokens only
        ref = corr.token_tis(torch.from_numpy(old[m]), torch.from_numpy(ro.rollout_logprobs[m]), cap=1.2)
        assert out["correction/frac_tokens_clipped"] == pytest.approx(
            ref.metrics["frac_tokens_clipped"], abs=1e-12)


def test_single_turn_rollout_unchanged():
    """A rollout without turn arrays keeps every token (the mask path is not taken)."""
    rng = np.random.default_rng(0)
    ro = _rollout(rng, [1, 1])
    plain = Rollout.from_lists([[1, 2, 3]] * 2, [ro.response(0).tolist(), ro.response(1).tolist()],
                               [ro.logprobs(0).tolist(), ro.logprobs(1).tolist()],
                               group_ids=np.zeros(2, np.int64))
    theta = torch.from_numpy(plain.rollout_logprobs.copy())
    out, grad = _update(plain, theta, np.array([0.0, 1.0]), None, None)
    assert out["n_tokens"] == plain.num_response_tokens and (grad != 0).all()
