"""The FSDP2 trainer: differentiable forward with the alignment pieces, one update, LoRA,
checkpoints; and (slow) a 2-process gloo FSDP2 step against the single-process step."""
from __future__ import annotations

import contextlib
import functools
import os

import numpy as np
import pytest
import torch

from skyrl_numerics import correction
from skyrl_numerics.errors import InputError
from skyrl_numerics.models import build_tiny_model, load_hf_model
from skyrl_numerics.rollout import Rollout
from skyrl_numerics.trainer.fsdp.checkpoint import load_checkpoint, save_checkpoint
from skyrl_numerics.trainer.fsdp.forward import policy_logprobs
from skyrl_numerics.trainer.config import TrainerConfig
from skyrl_numerics.trainer.fsdp.trainer import FSDPTrainer
from skyrl_numerics.trainer.logprobs import trainer_logprobs
from skyrl_numerics.trainer.fsdp.lora import apply_lora, merge_lora_state_dict

LENS = [5, 9, 3, 7, 6, 4, 8, 2]


def fp32_model():
    return load_hf_model(build_tiny_model("qwen3_moe"), dtype="float32")


def make_rollout(noise: float = 0.05, seed: int = 0) -> tuple[Rollout, np.ndarray]:
    """8 sequences in 2 groups of 4; rollout logprobs = the fp32 model's own + N(0, noise)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 512, 4 + i % 3).tolist() for i in range(len(LENS))]
    resp = [rng.integers(2, 512, n).tolist() for n in LENS]
    r = Rollout.from_lists(prompts, resp, [[-1.0] * n for n in LENS], group_ids=np.repeat([0, 1], 4),
                           sampling={"temperature": 1.0})
    tl = trainer_logprobs(fp32_model(), r).logprobs
    lp = np.minimum(tl + rng.normal(0, noise, tl.shape), 0.0).astype(np.float32)
    d = {f: getattr(r, f) for f in r.__dataclass_fields__}
    return Rollout(**{**d, "rollout_logprobs": lp}), rng.random(len(LENS))


@pytest.fixture(scope="module")
def batch():
    return make_rollout()


def weights(trainer) -> dict:
    return trainer.state_dict()


# ---- forward -------------------------------------------------------------------------------------
def test_policy_logprobs_equal_trainer_logprobs_and_have_grad(batch):
    r, _ = batch
    m = fp32_model()
    lp, ent = policy_logprobs(m, r)
    ref = trainer_logprobs(m, r, batch_size=len(r))
    np.testing.assert_array_equal(lp.detach().numpy(), ref.logprobs)
    np.testing.assert_array_equal(ent.detach().numpy(), ref.entropy)
    assert lp.requires_grad
    lp.sum().backward()
    assert m.lm_head.weight.grad is not None and m.model.embed_tokens.weight.grad.abs().sum() > 0
    # rows in any order: outputs follow the rows given
    sub, _ = policy_logprobs(m, r, rows=[5, 1])
    cu = r.response_cu
    want = np.concatenate([ref.logprobs[cu[5]:cu[6]], ref.logprobs[cu[1]:cu[2]]])
    np.testing.assert_allclose(sub.detach().numpy(), want, atol=1e-5)


def test_support_replay_forward(batch):
    from skyrl_numerics.replay import PackedSupport

    r, _ = batch
    m = fp32_model()
    d = {f: getattr(r, f) for f in r.__dataclass_fields__}
    full = Rollout(**{**d, "support": PackedSupport.full(r.num_response_tokens, 512)})
    plain, _ = policy_logprobs(m, r)
    sup, _ = policy_logprobs(m, full, use_support=True)
    np.testing.assert_allclose(sup.detach().numpy(), plain.detach().numpy(), atol=1e-5)
    # a smaller support (sampled token + 7 others) renormalizes: logprob rises by -log p(S) > 0
    rng = np.random.default_rng(0)
    sets = [sorted({int(t)} | set(rng.choice(512, 7, replace=False).tolist())) for t in r.response_tokens]
    small = Rollout(**{**d, "support": PackedSupport.from_sets(sets, 512)})
    lp_s, _ = policy_logprobs(m, small, use_support=True)
    assert (lp_s.detach() > plain.detach()).all()
    lp_s.sum().backward()
    assert m.lm_head.weight.grad.abs().sum() > 0
    with pytest.raises(InputError, match="support"):
        policy_logprobs(m, r, use_support=True)


def test_route_replay_forward(batch):
    from skyrl_numerics.replay import record_routes

    r, _ = batch
    m = fp32_model()
    with record_routes(m) as rec, torch.no_grad():
        own, _ = policy_logprobs(m, r)
    seq_lens = r.prompt_lens + r.response_lens
    routes = rec.routes(seq_lens, drop_last=True)  # like an engine capture: the last token never ran
    replayed, _ = policy_logprobs(m, r, routes=routes)
    np.testing.assert_allclose(replayed.detach().numpy(), own.numpy(), atol=1e-5)
    from skyrl_numerics.replay import PackedRoutes

    vals = (np.asarray(routes.values).astype(np.int64) + 3) % 8  # other experts
    other = PackedRoutes.from_sequences([vals[a:b] for a, b in zip(routes.cu_seqlens[:-1], routes.cu_seqlens[1:])], 8)
    moved, _ = policy_logprobs(m, r, routes=other)
    assert np.abs(moved.detach().numpy() - own.numpy()).max() > 1e-2
    with pytest.raises(InputError, match="routes"):
        policy_logprobs(m, r, routes=True)  # the rollout carries none


# ---- one update ----------------------------------------------------------------------------------
def test_step_moves_logprobs_along_advantage(batch):
    r, rewards = batch
    t = FSDPTrainer(fp32_model(), TrainerConfig(lr=1e-4, grad_clip=None, micro_batch_size=3))
    before = t.logprobs(r)
    met = t.step(r, rewards)
    after = t.logprobs(r)
    from skyrl_numerics.trainer.losses import grpo_advantages, token_advantages

    adv = token_advantages(grpo_advantages(rewards, r.group_ids), r.response_cu).numpy()
    delta = after - before
    assert delta[adv > 0].mean() > 0 > delta[adv < 0].mean()
    assert met["ratio_mean"] == 1.0 and met["clipfrac"] == 0.0 and met["n_tokens"] == r.num_response_tokens
    # on-policy, ratio 1: loss = -mean_t A_t
    assert met["loss"] == pytest.approx(-adv.mean(), abs=1e-6)
    assert t.global_step == 1 and met["grad_norm"] > 0


def test_step_with_correction_and_old_logprobs(batch):
    r, rewards = batch
    cfg = TrainerConfig(lr=1e-4, advantage="rloo", aggregation="seq_mean_token_mean",
                        correction=functools.partial(correction.masked_is, hi=1.05), micro_batch_size=4)
    t = FSDPTrainer(fp32_model(), cfg)
    old = t.logprobs(r)
    c = correction.masked_is(old, r.rollout_logprobs, cu_seqlens=r.response_cu, hi=1.05)
    assert 0 < c.metrics["frac_tokens_masked"] < 1
    met = t.step(r, rewards)
    # the no-grad pass is log π_old: ratio 1, ℓ = -A; loss = mean over kept sequences of token means of w·(-A)
    from skyrl_numerics.trainer.losses import aggregate, rloo_advantages, token_advantages

    adv = token_advantages(rloo_advantages(rewards, r.group_ids), r.response_cu).double()
    want = aggregate(-adv, torch.as_tensor(c.mask), torch.as_tensor(c.weights), cu_seqlens=r.response_cu,
                     mode="seq_mean_token_mean")
    assert met["loss"] == pytest.approx(float(want), abs=1e-6)
    assert met["n_tokens"] == int(c.mask.sum())
    assert met["correction/frac_tokens_masked"] == pytest.approx(c.metrics["frac_tokens_masked"], abs=1e-9)
    # a stale π_old: ratios move away from 1 and the clip engages
    stale = old + np.random.default_rng(1).normal(0, 0.3, old.shape).astype(np.float32)
    met2 = t.step(r, rewards, old_logprobs=stale)
    assert met2["clipfrac"] > 0 and met2["ratio_mean"] != 1.0
    # a correction by name (token TIS, default cap 2) on a rollout noisy enough that the cap engages:
    # its metrics equal w_t = min(exp(log π_old - log π_rollout), 2) computed here in float64
    rn, _ = make_rollout(noise=0.5, seed=2)
    by_name = FSDPTrainer(fp32_model(), TrainerConfig(correction="token_tis")).step(rn, rewards)
    ratio = np.exp(trainer_logprobs(fp32_model(), rn).logprobs.astype(np.float64)
                   - rn.rollout_logprobs.astype(np.float64))
    assert 0 < (ratio > 2).mean() < 1
    assert by_name["correction/mean_ratio"] == pytest.approx(ratio.mean(), rel=1e-6)
    assert by_name["correction/mean_weight"] == pytest.approx(np.minimum(ratio, 2.0).mean(), rel=1e-6)
    assert by_name["correction/frac_tokens_clipped"] == pytest.approx((ratio > 2).mean(), abs=1e-9)
    assert by_name["correction/frac_tokens_masked"] == 0.0


def test_step_with_support_and_route_replay(batch):
    """Both replay pieces switched on in the trainer: with the full vocabulary as support and the
    trainer's own recorded routes, the update equals the plain one (to fp32 rounding)."""
    from skyrl_numerics.replay import PackedSupport, record_routes

    r, rewards = batch
    m = fp32_model()
    with record_routes(m) as rec, torch.no_grad():
        policy_logprobs(m, r)
    d = {f: getattr(r, f) for f in r.__dataclass_fields__}
    rr = Rollout(**{**d, "routes": rec.routes(r.prompt_lens + r.response_lens, drop_last=True),
                    "support": PackedSupport.full(r.num_response_tokens, 512)})
    cfg = dict(lr=1e-4, grad_clip=None, micro_batch_size=3)
    plain = FSDPTrainer(fp32_model(), TrainerConfig(**cfg))
    replay = FSDPTrainer(m, TrainerConfig(use_support=True, route_replay=True, **cfg))
    a, b = plain.step(r, rewards), replay.step(rr, rewards)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    wa, wb = weights(plain), weights(replay)
    diff = torch.cat([(wa[k] - wb[k]).abs().reshape(-1) for k in wa])
    assert diff.max() <= 0.1 * cfg["lr"]  # measured 0.009 lr (Adam's first step ≈ lr · sign(g))


def test_step_with_an_empty_response():
    """A micro-batch with no response tokens still runs backward (FSDP ranks must all reduce)."""
    r = Rollout.from_lists([[3, 4, 5], [6, 7], [9, 9]], [[], [8, 9], [10]], [[], [-1.0, -2.0], [-0.5]],
                           group_ids=[0, 0, 0])
    t = FSDPTrainer(fp32_model(), TrainerConfig(micro_batch_size=1, grad_clip=None))
    w0 = weights(t)
    met = t.step(r, [1.0, 0.0, 0.5])
    assert met["n_tokens"] == 3 and met["grad_norm"] > 0
    assert any(not torch.equal(w0[k], v) for k, v in weights(t).items())
    assert t.logprobs(r).shape == (3,)


def test_step_input_errors(batch):
    r, rewards = batch
    t = FSDPTrainer(fp32_model(), TrainerConfig())
    with pytest.raises(InputError, match="rewards"):
        t.step(r, rewards[:3])
    with pytest.raises(InputError, match="old_logprobs"):
        t.step(r, rewards, old_logprobs=np.zeros(3))
    with pytest.raises(InputError, match="advantage"):
        TrainerConfig(advantage="ppo")
    with pytest.raises(InputError, match="correction"):
        TrainerConfig(correction="nope") and FSDPTrainer(fp32_model(), TrainerConfig(correction="nope"))
    with pytest.raises(InputError, match="routes"):
        FSDPTrainer(fp32_model(), TrainerConfig(route_replay=True)).step(r, rewards)


@pytest.mark.isa
def test_batch_invariant_step(batch):
    """The step runs under batch_invariant_mode, forward and backward (MoE expert-weight grads go
    through the grouped-GEMM backward override), and the mode does not change what is computed
    beyond rounding: same loss and gradient norm as the plain step, and the update moves the
    logprobs the same way."""
    r, rewards = batch
    small = dict(lr=1e-6, weight_decay=0.01, micro_batch_size=8)   # a small step: it moves the logprobs alike
    t = FSDPTrainer(fp32_model(), TrainerConfig(batch_invariant=True, **small))
    p = FSDPTrainer(fp32_model(), TrainerConfig(**small))
    before = t.logprobs(r)
    np.testing.assert_allclose(before, p.logprobs(r), atol=1e-5)
    met, pmet = t.step(r, rewards), p.step(r, rewards)
    assert met["loss"] == pytest.approx(pmet["loss"], rel=1e-5, abs=1e-7)
    assert met["grad_norm"] == pytest.approx(pmet["grad_norm"], rel=1e-4) and met["grad_norm"] > 0
    after = t.logprobs(r)
    assert not np.array_equal(after, before)
    np.testing.assert_allclose(after, p.logprobs(r), atol=1e-4)


def _permuted(r: Rollout, order) -> Rollout:
    """The same sequences in another order (other neighbours, other padding in a micro-batch)."""
    order = list(order)
    return Rollout.from_lists([r.prompt(i).tolist() for i in order], [r.response(i).tolist() for i in order],
                              [r.logprobs(i).tolist() for i in order], group_ids=np.asarray(r.group_ids)[order],
                              sampling=dict(r.sampling))


def _per_seq(flat, r: Rollout) -> list:
    cu = r.response_cu
    return [flat[cu[i]:cu[i + 1]] for i in range(len(r))]


@pytest.mark.isa
def test_batch_invariant_logprobs_identical_for_any_micro_batch(batch):
    """batch_invariant=True: every sequence's logprobs have the same bits whatever micro-batch it
    shares (micro_batch_size 1, 3, 4, 8 = the whole trainer batch of 8; another row order, hence
    other neighbours and padding), in the no-grad pass and in the differentiable forward the
    update backpropagates; close to the plain forward."""
    r, _ = batch
    m = fp32_model()
    runs = {mbs: FSDPTrainer(m, TrainerConfig(batch_invariant=True, micro_batch_size=mbs)).logprobs(r)
            for mbs in (1, 3, 4, 8)}
    for mbs in (3, 4, 8):
        np.testing.assert_array_equal(runs[mbs], runs[1], err_msg=f"micro_batch_size {mbs}")
    order = [6, 1, 7, 0, 3, 5, 2, 4]
    pr = _permuted(r, order)
    perm = FSDPTrainer(m, TrainerConfig(batch_invariant=True, micro_batch_size=3)).logprobs(pr)
    base = _per_seq(runs[1], r)
    for j, got in enumerate(_per_seq(perm, pr)):
        np.testing.assert_array_equal(got, base[order[j]], err_msg=f"sequence {order[j]} at row {j}")
    from skyrl_numerics.kernels import batch_invariant_mode
    with batch_invariant_mode():
        lp, _ = policy_logprobs(m, r)                      # one forward of all 8, with grad
    assert lp.requires_grad
    np.testing.assert_array_equal(lp.detach().numpy(), runs[1])
    plain = FSDPTrainer(fp32_model(), TrainerConfig()).logprobs(r)
    np.testing.assert_allclose(runs[8], plain, atol=1e-5)


def _step_capturing_input_grads(r, rewards, mbs):
    """One batch-invariant step; returns (metrics, per-sequence gradient of the loss w.r.t. the
    input embeddings of its tokens [len, H])."""
    t = FSDPTrainer(fp32_model(), TrainerConfig(batch_invariant=True, micro_batch_size=mbs, grad_clip=None))
    grads = []

    def hook(_mod, _inp, out):
        if out.requires_grad:
            out.register_hook(lambda g: grads.append(g.detach().clone()))

    handle = t.model.get_input_embeddings().register_forward_hook(hook)
    try:
        met = t.step(r, rewards)
    finally:
        handle.remove()
    lens = r.prompt_lens + r.response_lens
    per_seq = []
    for j, g in enumerate(grads):                 # micro-batches in order: rows j*mbs ... (one rank)
        for b in range(g.shape[0]):
            i = j * mbs + b
            per_seq.append(g[b, :lens[i]])
    assert len(per_seq) == len(r)
    return met, per_seq


@pytest.mark.isa
def test_batch_invariant_step_gradient_contributions_identical(batch):
    """batch_invariant=True, trainer batch of 8: each sequence's contribution to the update's
    backward — the gradient w.r.t. its input embeddings, token by token — has the same bits for
    micro_batch_size 1, 3 and 8 (a row of every GEMM depends on that row only: forward and
    backward go through the mode). The summed parameter gradients are sums over micro-batches
    and tokens in another association, so they (and the loss) agree to rounding only; without
    the mode the per-token gradients differ already (not asserted: machine dependent)."""
    r, rewards = batch
    runs = {mbs: _step_capturing_input_grads(r, rewards, mbs) for mbs in (1, 3, 8)}
    met1, g1 = runs[1]
    assert met1["n_tokens"] == r.num_response_tokens and met1["grad_norm"] > 0
    assert all(float(g.abs().sum()) > 0 for g in g1)
    for mbs in (3, 8):
        met, g = runs[mbs]
        for i in range(len(r)):
            assert torch.equal(g[i], g1[i]), f"micro_batch_size {mbs}, sequence {i}"
        assert met["loss"] == pytest.approx(met1["loss"], rel=1e-5)
        assert met["grad_norm"] == pytest.approx(met1["grad_norm"], rel=1e-5)
        assert met["n_tokens"] == met1["n_tokens"] and met["ratio_mean"] == 1.0


def test_qat_recipe_wraps_experts_and_trains(batch):
    from torch.nn.utils import parametrize

    r, rewards = batch
    t = FSDPTrainer(fp32_model(), TrainerConfig(qat="nvfp4", lr=1e-3))
    experts = t.model.model.layers[0].mlp.experts
    assert parametrize.is_parametrized(experts)
    before = experts.parametrizations.down_proj.original.detach().clone()
    met = t.step(r, rewards)
    assert np.isfinite(met["loss"])
    # the STE lets the full-precision master weights move
    assert not torch.equal(experts.parametrizations.down_proj.original, before)


# ---- LoRA ----------------------------------------------------------------------------------------
def test_lora_starts_at_base_trains_adapters_and_merges(batch):
    r, rewards = batch
    base = fp32_model()
    ref, _ = policy_logprobs(base, r)
    t = FSDPTrainer(fp32_model(), TrainerConfig(lr=1e-2, lora_rank=4, grad_clip=None, weight_decay=0.0))
    assert len(t.lora_modules) == 8  # q/k/v/o in 2 layers
    with torch.no_grad():
        start, _ = policy_logprobs(t.model, r)
    assert torch.equal(start, ref.detach())  # B = 0: the adapted model is the base model
    w0 = weights(t)
    t.step(r, rewards)
    w1 = weights(t)
    changed = {k for k in w0 if not torch.equal(w0[k], w1[k])}
    assert changed == {k for k in w0 if k.endswith("lora_B")}  # A gets no grad while B = 0; base frozen
    t.step(r, rewards)
    with torch.no_grad():
        lora_lp, _ = policy_logprobs(t.model, r)
    merged = fp32_model()
    merged.load_state_dict(t.full_state_dict())
    with torch.no_grad():
        merged_lp, _ = policy_logprobs(merged, r)
    assert (lora_lp - ref.detach()).abs().max() > 1e-3  # the adapters did change the policy
    np.testing.assert_allclose(merged_lp.numpy(), lora_lp.numpy(), atol=1e-5)
    assert set(merge_lora_state_dict(w1)) == set(base.state_dict())
    with pytest.raises(InputError, match="lora_patterns"):
        apply_lora(fp32_model(), patterns=("*.nothing",))


# ---- checkpoints ---------------------------------------------------------------------------------
def test_checkpoint_round_trip_single_process(batch, tmp_path):
    r, rewards = batch
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=4)
    t = FSDPTrainer(fp32_model(), cfg)
    t.step(r, rewards)
    ck = tmp_path / "ck"
    t.save(ck)
    t.step(r, rewards)
    a = weights(t)
    t2 = FSDPTrainer(fp32_model(), cfg)
    state = t2.load(ck)
    assert state["global_step"] == 1 and t2.global_step == 1
    t2.step(r, rewards)
    b = weights(t2)
    assert all(torch.equal(a[k], b[k]) for k in a)  # weights and AdamW moments restored exactly
    # saving over an existing checkpoint replaces it whole and leaves no temp directories behind
    save_checkpoint(t2, ck)
    assert load_checkpoint(FSDPTrainer(fp32_model(), cfg), ck)["global_step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_checkpoint_errors(batch, tmp_path):
    r, rewards = batch
    t = FSDPTrainer(fp32_model(), TrainerConfig())
    with pytest.raises(InputError, match="missing"):
        t.load(tmp_path / "nope")
    t.save(tmp_path / "ck")
    lora = FSDPTrainer(fp32_model(), TrainerConfig(lora_rank=2))
    with pytest.raises(InputError, match="do not match"):
        lora.load(tmp_path / "ck")
    (tmp_path / "ck" / "trainer_state.json").write_text('{"schema": "other"}')
    with pytest.raises(InputError, match="schema"):
        t.load(tmp_path / "ck")


# ---- FSDP2 over 2 processes (gloo) ----------------------------------------------------------------
# Scenario A: micro-batches coincide (4 sequences = one rank's share), no grad clip. Each rank's
#   micro-batch forward/backward is the single process's, bit for bit; the rank loss is scaled by
#   world=2 and FSDP divides by 2 (both exact); the sum of two gradients does not depend on order.
#   So the AdamW update is bitwise identical.
# Scenario B: RLOO, seq-mean-token-mean, masked IS, stale π_old, dual clip, grad clip 0.5, two
#   micro-batches per rank (no gradient sync until the last). Now the gradients are summed in another
#   association ((g0+g1)+(g2+g3) vs ((g0+g1)+g2)+g3) and the grad norm over shards in another order:
#   a few ulp of the micro-batch gradients, |Δg| ≲ 1e-10 (fp32 ulps of summands ~1e-3). AdamW's
#   first update is lr · g / (|g| + ε) with ε = 1e-8, whose sensitivity is at most lr · |Δg| / ε
#   ≲ 1e-2 · lr (reached only where |g| ~ ε, i.e. by cancellation). Tolerance: max |Δw| ≤ 1e-2 · lr;
#   measured 2.2e-4 · lr, then 2.5e-3 · lr once masked IS computed min(r, C) instead of
#   exp(min(d, ln C)) (other last bits of the weights, so other near-cancelling elements).
#   A wrong gradient in any element would move it by up to 2 · lr (that update is ≈ lr · sign(g)),
#   and a wrong gradient scale shows in the grad-norm check.
SCEN = {
    "A": dict(lr=1e-3, micro_batch_size=4, grad_clip=None, weight_decay=0.01),
    "B": dict(lr=1e-3, micro_batch_size=2, grad_clip=0.5, advantage="rloo", aggregation="seq_mean_token_mean",
              dual_clip=3.0, correction=functools.partial(correction.masked_is, hi=1.5)),
    "lora": dict(lr=1e-2, micro_batch_size=4, grad_clip=None, weight_decay=0.0, lora_rank=4),  # as A: bitwise
}


def _stale(r: Rollout) -> np.ndarray:
    rng = np.random.default_rng(3)
    return (r.rollout_logprobs + rng.normal(0, 0.4, r.num_response_tokens)).astype(np.float32)


def _worker(rank, world, r, rewards, out_dir):
    res = {}
    for name, kw in SCEN.items():
        t = FSDPTrainer(fp32_model(), TrainerConfig(**kw))
        old = _stale(r) if name == "B" else None
        res[name] = (t.step(r, rewards, old_logprobs=old), weights(t))
        if name == "lora":
            res["lora_merged"] = t.full_state_dict()
        if name == "A":  # checkpoint round trip under FSDP2
            t.save(os.path.join(out_dir, "ck"))
            t.step(r, rewards)
            after = weights(t)
            t2 = FSDPTrainer(fp32_model(), TrainerConfig(**kw))
            t2.load(os.path.join(out_dir, "ck"))
            t2.step(r, rewards)
            again = weights(t2)  # collective: every rank takes part in the gather
            res["ckpt_equal"] = rank != 0 or all(torch.equal(after[k], v) for k, v in again.items())
    if rank == 0:
        torch.save(res, os.path.join(out_dir, "rank0.pt"))


@contextlib.contextmanager
def torch_threads(n: int):
    """torch on ``n`` threads inside the block; the previous count is restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture
def one_thread():
    """One torch thread for the test (as the spawned ranks run); later tests keep the session's."""
    with torch_threads(1):
        yield


def test_torch_threads_restores_the_count():
    n = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == n
    with pytest.raises(ValueError), torch_threads(1):
        raise ValueError("boom")
    assert torch.get_num_threads() == n


@pytest.mark.slow
def test_fsdp2_two_processes_equal_single_process(batch, tmp_path, one_thread):
    from skyrl_numerics.trainer.dist import spawn

    r, rewards = batch
    spawn(_worker, 2, r, rewards, str(tmp_path), timeout=600)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert got["ckpt_equal"]
    # the ranks ran with one thread each; the single-process reference below does too (one_thread)
    for name, kw in SCEN.items():
        t = FSDPTrainer(fp32_model(), TrainerConfig(**kw))
        met = t.step(r, rewards, old_logprobs=_stale(r) if name == "B" else None)
        ref = weights(t)
        dmet, dist_w = got[name]
        for k in ("loss", "n_tokens", "clipfrac", "ratio_mean", "entropy"):
            assert dmet[k] == pytest.approx(met[k], rel=1e-6, abs=1e-9), (name, k)
        assert dmet["grad_norm"] == pytest.approx(met["grad_norm"], rel=1e-6)
        worst = max(float((ref[k] - dist_w[k]).abs().max()) for k in ref)
        if name != "B":
            assert worst == 0.0, f"scenario {name}: not bitwise, max |Δw| = {worst}"
        else:
            # the clip, the mask and the grad clip all engaged
            assert met["clipfrac"] > 0 and met["grad_norm"] > 0.5 and 0 < met["n_tokens"] < r.num_response_tokens
            assert worst <= 1e-2 * kw["lr"], f"scenario B: max |Δw| = {worst}"
        if name == "lora":
            merged = t.full_state_dict()
            assert set(merged) == set(got["lora_merged"]) and all(torch.equal(merged[k], v)
                                                                  for k, v in got["lora_merged"].items())
    # the 2-rank checkpoint loads into a single process
    single = FSDPTrainer(fp32_model(), TrainerConfig(**SCEN["A"]))
    assert single.load(tmp_path / "ck")["world_size"] == 2
