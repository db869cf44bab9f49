"""Multi-turn tool-using trajectories through the real vLLM CPU engine (``generate_multiturn``).

- the trajectory rollout is well formed: model and observation tokens interleave by turn, logprobs
  exactly on model tokens, the toy tool's observations where they belong, later turns hit the
  prefix cache;
- routes shipped as turn deltas assemble (``RouteTrace``) into exactly the routes of a full-prefix
  resend of every turn, with fewer bytes;
- the invariant engine + the invariant trainer: Δ = 0 on every model token of every turn, with
  support replay; the trainer's routers choose exactly the assembled routes; the engine's top-K
  logprobs and its full logits row (digest) of every model token equal the trainer's;
- a bad environment (ids outside the vocabulary) is refused naming trajectory and turn.
"""
from __future__ import annotations

import numpy as np
import pytest

from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.errors import InputError
from skyrl_numerics.gap import measure
from skyrl_numerics.engine.multiturn import EnvStep, KeyValueEnv

pytestmark = pytest.mark.vllm

TURNS = 4


def _prompts(gen, n=3, seed=11, length=136):
    # longer than vLLM CPU's 128-token block: later turns hit the prefix cache
    return make_prompts(n, length, gen.vocab_size, seed=seed)


@pytest.fixture(scope="module")
def inv_traj(vllm_qwen_invariant):
    gen = vllm_qwen_invariant
    return gen.generate_multiturn(_prompts(gen), KeyValueEnv, max_turns=TURNS, max_tokens=6, n=2,
                                  seed=5, top_k=16, capture_support=True, topk_logprobs=8,
                                  logits_digest=True)


def test_trajectory_structure(inv_traj):
    ro = inv_traj
    ro.validate()
    assert ro.is_multi_turn and len(ro) == 6
    assert list(ro.group_ids) == [0, 0, 1, 1, 2, 2]
    nt = ro.num_turns
    assert nt.max() == TURNS and nt.min() >= 1
    env = KeyValueEnv()
    for i in range(len(ro)):
        a, b = int(ro.response_cu[i]), int(ro.response_cu[i + 1])
        m, t, tok = ro.loss_mask[a:b], ro.turns[a:b], ro.response_tokens[a:b]
        lp = ro.rollout_logprobs[a:b]
        assert np.isnan(lp[~m]).all() and np.isfinite(lp[m]).all()
        for k in range(1, int(nt[i])):     # each later turn opens with the tool's reply
            obs = tok[(t == k) & ~m]
            assert obs[0] == env.open_token and obs[-1] == env.close_token
            assert len(obs) in (3, 2 + env.value_len)
            model_prev = tok[(t == k - 1) & m]
            env.reset(ro.prompt(i))
            assert obs.tolist() == env.step(model_prev.tolist()).observation
    # later turns re-send the history: the prefix cache serves it
    per_turn = ro.meta["num_cached_tokens_per_turn"]
    assert len(per_turn) == TURNS   # (turn 0: the second trajectory of a prompt hits the first)
    assert all(c >= 128 for turn in per_turn[1:] for c in turn), per_turn
    assert len(ro.meta["env_reward"]) == len(ro)


def test_route_deltas_equal_full_resend(vllm_qwen_invariant, inv_traj):
    full = vllm_qwen_invariant.generate_multiturn(
        _prompts(vllm_qwen_invariant), KeyValueEnv, max_turns=TURNS, max_tokens=6, n=2, seed=5,
        top_k=16, capture_support=True, route_deltas=False)
    np.testing.assert_array_equal(full.response_tokens, inv_traj.response_tokens)
    assert inv_traj.routes == full.routes
    np.testing.assert_array_equal(inv_traj.routes.seq_lens,
                                  inv_traj.prompt_lens + inv_traj.response_lens - 1)
    rb, fb = inv_traj.meta["route_bytes"], full.meta["route_bytes"]
    assert rb["full_resend"] == fb["full_resend"]
    assert rb["delta"] == inv_traj.routes.values.nbytes      # each position shipped once
    assert rb["delta"] < fb["delta"] == fb["full_resend"]


def test_invariant_trainer_bitwise_every_turn(qwen_moe_dir, inv_traj):
    from skyrl_numerics.invariant import from_checkpoint
    from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

    ro = inv_traj
    model = from_checkpoint(qwen_moe_dir)
    out = invariant_trainer_logprobs(model, ro, use_support=True, return_routes=True)
    rep = measure(out.logprobs, ro.rollout_logprobs, ro.loss_mask, cu_seqlens=ro.response_cu,
                  turns=ro.turns)
    s = rep.summary()
    assert s["n_tokens"] == int(ro.loss_mask.sum()) and s["max_abs"] == 0.0
    assert s["frac_bitwise_equal"] == 1.0
    assert [r["turn"] for r in rep.per_turn] == list(range(TURNS))
    assert all(r["max_abs"] == 0.0 for r in rep.per_turn)
    # the routes assembled from turn deltas are the ones the trainer's routers choose
    assert out.routes == ro.routes
    # beyond the sampled token: the engine's top-8 (processed: within the top-16 support) of
    # every model token equals the trainer's, bit for bit and as a set
    from skyrl_numerics.invariant.rollout_forward import invariant_topk

    d = invariant_topk(model, ro, use_support=True)
    assert d["positions"] == int(ro.loss_mask.sum()) and d["frac_bitwise"] == 1.0, d
    # and the whole distribution: every model token's full logits row, by digest
    from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest

    g = invariant_logits_digest(model, ro)
    assert g["positions"] == int(ro.loss_mask.sum()) and g["frac_bitwise"] == 1.0, g
    assert len(ro.logits_digest) == ro.num_response_tokens
    assert not ro.logits_digest.digests[~ro.loss_mask].any()    # observation rows: zeros


def test_bad_observation_refused(vllm_qwen_invariant):
    class Bad(KeyValueEnv):
        def step(self, model_tokens):
            return EnvStep([1, 2, self.vocab_size + 7], 0.0, False)

    with pytest.raises(InputError, match=r"trajectory 0, turn 0: observation token 519"):
        vllm_qwen_invariant.generate_multiturn(_prompts(vllm_qwen_invariant, 1, length=8), Bad,
                                               max_turns=2, max_tokens=2)
