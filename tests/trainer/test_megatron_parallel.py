"""megatron-core TP 2 x EP 2 over gloo on 2 CPU processes, against one process.

One spawn (module fixture) runs everything on the 2 ranks and saves rank 0's results; the tests compare:
vocab-parallel logprobs / entropy / support replay and their gradients (bitwise against the 1-process run of
the same partition; tolerance against the plain full-vocabulary computation), R3 through RouterReplay in
GPTModel.forward, apply_megatron_qat shards against the unsharded fake-quant, and MegatronTrainer
(logprobs, one step, gathered weights) against the 1-rank MegatronTrainer and the FSDP trainer.
"""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
pytest.importorskip("megatron.core")

LENS = [5, 7, 3, 6]
LR = 1e-3
# fp32 tolerances (measured values in the comments / docs/megatron.md)
LP_ATOL = 2e-5        # TP2xEP2 vs 1 rank, and megatron vs FSDP (HF) trainer logprobs
SPLIT_ATOL = 2e-6     # vocab split in 2 vs one log_softmax over the whole vocabulary
QAT_RULES = [("*.self_attention.linear_qkv", "nvfp4"), ("*.self_attention.linear_proj", "int4_g32"),
             ("*.mlp.experts", "nvfp4")]


def make_rollout(with_routes=False, with_support=False):
    from skyrl_numerics.replay import PackedRoutes, PackedSupport
    from skyrl_numerics.rollout import Rollout

    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, 4 + i % 3).tolist() for i in range(len(LENS))]
    resp = [rng.integers(2, 512, n).tolist() for n in LENS]
    r = Rollout.from_lists(prompts, resp, [[-6.0] * n for n in LENS], group_ids=np.repeat([0, 1], 2),
                           sampling={"temperature": 0.8})
    d = {f: getattr(r, f) for f in r.__dataclass_fields__}
    if with_routes:  # engine convention: prompt + response - 1 positions, 2 layers, top-2 of 8
        seqs = [np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)])
                          for _ in range(len(p) + n - 1)]) for p, n in zip(prompts, LENS)]
        d["routes"] = PackedRoutes.from_sequences(seqs, 8)
    if with_support:
        sets = [sorted({int(t)} | set(rng.choice(512, 40, replace=False).tolist())) for t in r.response_tokens]
        d["support"] = PackedSupport.from_sets(sets, 512)
    return Rollout(**d), rng.random(len(LENS))


def _vocab_case(h, targets, support, tp_rank, group):
    """Vocab-parallel lp/ent on this rank's lm-head shard with gradient; returns what the parent compares."""
    import torch.distributed as dist

    from skyrl_numerics.trainer.megatron.vocab_parallel import vocab_parallel_logprobs

    x = h.clone().requires_grad_(True)
    w = torch.randn(256, h.shape[1], generator=torch.Generator().manual_seed(1 + tp_rank)) * 0.2
    w.requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x, w, targets, vocab_start=256 * tp_rank, vocab_size=512, group=group,
                                      support=support, chunk=100)
    (lp.sum() + 0.5 * ent.sum()).backward()
    gx = x.grad.clone()
    dist.all_reduce(gx, group=group)  # what megatron's gather/reduce-scatter mapping does
    ws, gws = [torch.empty_like(w) for _ in range(2)], [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(ws, w.detach(), group=group)
    dist.all_gather(gws, w.grad, group=group)
    return {"lp": lp.detach(), "ent": ent.detach(), "gx": gx, "w": torch.cat(ws), "gw": torch.cat(gws)}


def _worker(rank, world, model_dir, out, ds_dir):
    import torch.distributed as dist
    from megatron.core.transformer.moe.router import TopKRouter

    from skyrl_numerics.quant import QATRule
    from skyrl_numerics.replay.megatron import megatron_record_routes, megatron_replay_indices, megatron_route_replay
    from skyrl_numerics.trainer.config import TrainerConfig
    from skyrl_numerics.trainer.megatron.forward import _rows_routes
    from skyrl_numerics.trainer.megatron.trainer import MegatronTrainer

    res = {}
    r, rew = make_rollout()
    # -- A: the trainer: logprobs, one step, gathered weights; vocab-parallel pieces on its hidden states
    t = MegatronTrainer(model_dir, TrainerConfig(lr=LR, weight_decay=0.0), tp=2, ep=2)
    t.keep_grads = True
    res["layout"] = (t.tp_rank, t.ep_rank)
    res["lp0"] = t.logprobs(r)
    from skyrl_numerics.sync.weight_sync import DeltaPublisher

    bf16 = lambda sd: {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}  # noqa: E731  as served
    before = bf16(t.full_state_dict())  # collective: gathered from the TP/EP shards on every rank
    pub = DeltaPublisher(f"{out}/sync") if rank == 0 else None
    if pub is not None:
        pub.publish(before, full=True)
    res["metrics"] = t.step(r, rew)
    from skyrl_numerics.trainer.megatron.mapping import gather_full

    res["grads"] = gather_full(t.last_grads, t.hf_config)
    res["weights"] = t.full_state_dict()
    if pub is not None:
        m = pub.publish(bf16(res["weights"]))
        res["delta"] = (m.is_full, m.payload_nbytes, m.raw_nbytes, len(m.changed))
    res["lp1"] = t.logprobs(r)
    ids = torch.from_numpy(np.stack([np.resize(r.response_tokens, 12), np.resize(r.response_tokens[::-1], 12)]))
    with torch.no_grad():
        h = t.policy.hidden(ids.long())
    hs = h.reshape(-1, h.shape[-1]).float()
    targets = torch.from_numpy(np.resize(r.response_tokens, hs.shape[0]).astype(np.int64))
    rs, _ = make_rollout(with_support=True)
    from skyrl_numerics.trainer.fsdp.forward import support_subset

    sup = support_subset(rs.support, np.arange(hs.shape[0]) % rs.num_response_tokens)
    targets_s = torch.from_numpy(rs.response_tokens[np.arange(hs.shape[0]) % rs.num_response_tokens].astype(np.int64))
    res["vp_full"] = dict(_vocab_case(hs, targets, None, t.tp_rank, t.tp_group), h=hs, targets=targets)
    res["vp_support"] = dict(_vocab_case(hs, targets_s, sup, t.tp_rank, t.tp_group), targets=targets_s, support=sup)
    t.close()

    # -- B: R3 in GPTModel.forward (sequence-parallel blocks), support replay in the trainer
    rr, _ = make_rollout(with_routes=True, with_support=True)
    t = MegatronTrainer(model_dir, TrainerConfig(route_replay=True, use_support=True), tp=2, ep=2)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, i, o: seen.append(o[1].detach().clone()))
             for m in t.gpt.modules() if isinstance(m, TopKRouter)]
    res["lp_r3"] = t.logprobs(rr)  # one micro-batch (8 rows max): one forward
    for hk in hooks:
        hk.remove()
    mb = next(t.micro_batches(rr))
    Sp = -(-mb.input_ids.shape[1] // 2) * 2
    want = megatron_replay_indices(_rows_routes(rr.routes, mb.rows), seq_len=Sp, tp_rank=t.tp_rank, tp_size=2)
    ok = len(seen) == 2
    for layer, rmap in enumerate(seen):  # routing map [local tokens, E]: exactly the replayed experts
        chosen = torch.zeros_like(rmap)
        chosen.scatter_(1, want[layer], True)
        ok = ok and torch.equal(rmap.bool(), chosen.bool())
    res["r3_routes_equal"] = ok
    with torch.no_grad():  # record the model's own routes, replay them: bitwise the same forward
        with megatron_record_routes() as rec:
            h0 = t.policy.hidden(mb.input_ids)
        full = rec.gather(t.tp_group)
        seq_lens = [Sp] * len(mb.rows)
        routes = full.routes(8, seq_lens=seq_lens, seq_len=Sp)
        with megatron_route_replay(routes, seq_len=Sp, tp_rank=t.tp_rank, tp_size=2):
            h1 = t.policy.hidden(mb.input_ids)
    res["record_replay_bitwise"] = bool(torch.equal(h0, h1))
    res["recorded_tokens"] = int(full.indices[0].shape[0])
    t.close()

    # -- C: QAT on ColumnParallel / RowParallel / experts: each rank's weight = its shard of the full fake-quant
    t = MegatronTrainer(model_dir, TrainerConfig(qat=[QATRule(p, rec_) for p, rec_ in QAT_RULES]), tp=2, ep=2)
    fq = {}
    for name, mod in t.gpt.named_modules():
        if name in t.qat_wrapped:
            fq[name] = mod.weight.detach().clone()
    res["qat"] = fq
    res["lp_qat"] = t.logprobs(r)
    t.close()

    # -- D: batch_invariant_mode() under megatron-core, TP2 x EP2: the same bits at every micro-batch size
    t = MegatronTrainer(model_dir, TrainerConfig(batch_invariant=True, lr=LR), tp=2, ep=2)
    lps = {}
    for mbs in (4, 3, 1):
        t.config.micro_batch_size = mbs
        lps[mbs] = t.logprobs(r)
    res["bi_lps"] = lps
    res["bi_step"] = t.step(r, rew)
    t.close()
    # -- E: DeepSeek-V3 (MLA, shared expert, dense first layer) with EP 2 and TP 1: 2 data-parallel copies
    t = MegatronTrainer(ds_dir, TrainerConfig(lr=LR, weight_decay=0.0), tp=1, ep=2)
    t.keep_grads = True
    res["ds_lp0"] = t.logprobs(r)
    res["ds_metrics"] = t.step(r, rew)
    res["ds_grads"] = gather_full(t.last_grads, t.hf_config)
    res["ds_weights"] = t.full_state_dict()
    t.close()
    if rank == 0:
        torch.save(res, f"{out}/rank0.pt")
    else:
        torch.save({"layout": res["layout"], "qat": res["qat"], "lp0": res["lp0"]}, f"{out}/rank1.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def two_ranks(qwen_moe_dir, deepseek_v3_dir, tmp_path_factory):
    from skyrl_numerics.trainer.megatron.trainer import spawn_megatron

    out = tmp_path_factory.mktemp("mcore")
    spawn_megatron(_worker, qwen_moe_dir, str(qwen_moe_dir), str(out), str(deepseek_v3_dir), tp=2, ep=2,
                   timeout=900)
    torch.set_num_threads(1)  # the ranks ran with one thread each: the same kernels here
    r0 = torch.load(out / "rank0.pt", weights_only=False)
    r0["sync_dir"] = str(out / "sync")
    return r0, torch.load(out / "rank1.pt", weights_only=False)


@pytest.fixture(scope="module")
def single(qwen_moe_dir, two_ranks):
    """The same runs on one rank (MegatronTrainer TP=EP=1) and the FSDP trainer."""
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.trainer.config import TrainerConfig
    from skyrl_numerics.trainer.fsdp.trainer import FSDPTrainer
    from skyrl_numerics.trainer.megatron.trainer import MegatronTrainer
    from skyrl_numerics.engine.weight_update import checkpoint_state_dict

    r, rew = make_rollout()
    rr, _ = make_rollout(with_routes=True, with_support=True)
    out = {}
    t = MegatronTrainer(qwen_moe_dir, TrainerConfig(lr=LR, weight_decay=0.0))
    t.keep_grads = True
    out["lp0"] = t.logprobs(r)
    out["metrics"] = t.step(r, rew)
    out["grads"] = dict(t.last_grads)
    out["weights"] = t.full_state_dict()
    t.close()
    t = MegatronTrainer(qwen_moe_dir, TrainerConfig(route_replay=True, use_support=True))
    out["lp_r3"] = t.logprobs(rr)
    t.close()
    f = FSDPTrainer(load_hf_model(qwen_moe_dir, dtype="float32"), TrainerConfig(lr=LR, weight_decay=0.0))
    out["fsdp_lp0"] = f.logprobs(r)
    out["fsdp_metrics"] = f.step(r, rew)
    out["fsdp_weights"] = {k: v.detach().clone() for k, v in checkpoint_state_dict(f.model).items()}
    f = FSDPTrainer(load_hf_model(qwen_moe_dir, dtype="float32"), TrainerConfig(route_replay=True, use_support=True))
    out["fsdp_lp_r3"] = f.logprobs(rr)
    return out


@pytest.fixture(scope="module")
def single_ds(deepseek_v3_dir, two_ranks):
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.trainer.config import TrainerConfig
    from skyrl_numerics.trainer.fsdp.trainer import FSDPTrainer
    from skyrl_numerics.trainer.megatron.trainer import MegatronTrainer
    from skyrl_numerics.engine.weight_update import checkpoint_state_dict

    r, rew = make_rollout()
    out = {}
    t = MegatronTrainer(deepseek_v3_dir, TrainerConfig(lr=LR, weight_decay=0.0))
    t.keep_grads = True
    out["lp0"] = t.logprobs(r)
    out["metrics"] = t.step(r, rew)
    out["grads"] = dict(t.last_grads)
    out["weights"] = t.full_state_dict()
    t.close()
    f = FSDPTrainer(load_hf_model(deepseek_v3_dir, dtype="float32"), TrainerConfig(lr=LR, weight_decay=0.0))
    out["fsdp_lp0"] = f.logprobs(r)
    out["fsdp_metrics"] = f.step(r, rew)
    out["fsdp_weights"] = {k: v.detach().clone() for k, v in checkpoint_state_dict(f.model).items()}
    return out


def test_layout_tp2_ep2(two_ranks):
    assert two_ranks[0]["layout"] == (0, 0) and two_ranks[1]["layout"] == (1, 1)
    np.testing.assert_array_equal(two_ranks[0]["lp0"], two_ranks[1]["lp0"])  # every rank: the same logprobs


@pytest.mark.parametrize("case", ["vp_full", "vp_support"])
def test_vocab_parallel_equals_single_rank(two_ranks, case):
    from skyrl_numerics.replay import support_logprobs
    from skyrl_numerics.trainer.megatron.vocab_parallel import vocab_parallel_logprobs

    got = two_ranks[0][case]
    h, w = two_ranks[0]["vp_full"]["h"], got["w"]
    support = got.get("support")
    x = h.clone().requires_grad_(True)
    wf = w.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x, wf, got["targets"], partitions=2, support=support, chunk=100)
    (lp.sum() + 0.5 * ent.sum()).backward()
    # bitwise: same shard matmuls, combines of two terms (order-free)
    assert torch.equal(lp.detach(), got["lp"]) and torch.equal(ent.detach(), got["ent"])
    assert torch.equal(x.grad, got["gx"]) and torch.equal(wf.grad, got["gw"])
    # against the whole vocabulary at once: rounding of the split sums only
    ref_lp, ref_ent = support_logprobs(h, w, got["targets"], support, method="dense")
    print(f"\nmeasured {case}: max|dlp| split vs whole {(got['lp'] - ref_lp).abs().max():.2e}, "
          f"max|dent| {(got['ent'] - ref_ent).abs().max():.2e}")
    assert (got["lp"] - ref_lp).abs().max() <= SPLIT_ATOL
    assert (got["ent"] - ref_ent).abs().max() <= SPLIT_ATOL * 10
    if support is None:
        plain = torch.log_softmax(h @ w.T, -1).gather(1, got["targets"][:, None])[:, 0]
        assert (got["lp"] - plain).abs().max() <= SPLIT_ATOL


def test_route_replay_in_gpt_forward(two_ranks, single):
    got = two_ranks[0]
    assert got["r3_routes_equal"]              # every TopKRouter used exactly the replayed experts
    assert got["record_replay_bitwise"]        # own routes recorded, replayed: the same forward bit for bit
    assert got["recorded_tokens"] % 2 == 0     # both sequence-parallel blocks gathered
    print(f"\nmeasured R3+support: TP2xEP2 vs 1 rank {np.abs(got['lp_r3'] - single['lp_r3']).max():.2e}, "
          f"vs FSDP {np.abs(got['lp_r3'] - single['fsdp_lp_r3']).max():.2e}")
    np.testing.assert_allclose(got["lp_r3"], single["lp_r3"], atol=LP_ATOL, rtol=0)
    np.testing.assert_allclose(got["lp_r3"], single["fsdp_lp_r3"], atol=LP_ATOL, rtol=0)


def test_qat_shards_equal_unsharded_fake_quant(two_ranks, qwen_moe_dir):
    from safetensors.torch import load_file

    from skyrl_numerics.quant import fake_quant
    from skyrl_numerics.trainer.megatron.mapping import hf_to_megatron

    full = hf_to_megatron({k: v.float() for k, v in load_file(str(qwen_moe_dir / "model.safetensors")).items()},
                          qwen_moe_dir)
    recipe = dict(QAT_RULES)
    n_checked = 0
    for res in two_ranks:
        tp_rank, ep_rank = res["layout"]
        for name, w in res["qat"].items():
            if ".local_experts." in name:
                layer, rest = name.split(".mlp.experts.local_experts.")
                e, lin = rest.split(".")
                g = ep_rank * 4 + int(e)
                src = full[f"{layer}.mlp.experts.local_experts.{g}.{lin}.weight"]
                parts = src.chunk(2) if lin == "linear_fc1" else (src,)
                want = torch.cat([fake_quant(p, "nvfp4") for p in parts])  # = HF gate_proj / up_proj, down_proj
            else:
                kind = "*.self_attention." + name.rsplit(".", 1)[1]
                dim = 0 if name.endswith("linear_qkv") else 1
                want = fake_quant(full[name + ".weight"], recipe[kind]).chunk(2, dim=dim)[tp_rank]
            assert torch.equal(w, want), name
            n_checked += 1
    assert n_checked == 2 * 2 * (2 + 2 * 4)  # ranks x layers x (qkv, proj, 4 local experts x fc1/fc2)
    assert np.isfinite(two_ranks[0]["lp_qat"]).all()


def test_trainer_tp2_ep2_matches_single_rank_and_fsdp(two_ranks, single):
    got = two_ranks[0]
    d_single = np.abs(got["lp0"] - single["lp0"]).max()
    d_fsdp = np.abs(got["lp0"] - single["fsdp_lp0"]).max()
    print(f"\nmeasured: max|dlp| TP2xEP2 vs 1 rank {d_single:.2e}, vs FSDP {d_fsdp:.2e}, "
          f"1-rank megatron vs FSDP {np.abs(single['lp0'] - single['fsdp_lp0']).max():.2e}")
    assert d_single <= LP_ATOL and d_fsdp <= LP_ATOL, (d_single, d_fsdp)
    for ref in (single["metrics"], single["fsdp_metrics"]):
        for k in ("loss", "entropy", "n_tokens", "clipfrac", "ratio_mean", "adv_mean", "reward_mean"):
            assert got["metrics"][k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), k
        assert got["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    # the gradient (after the TP / expert reductions, before clipping), tensor by tensor
    assert set(got["grads"]) == set(single["grads"])
    gmax = max(v.abs().max().item() for v in single["grads"].values())
    dg = max((got["grads"][k] - v).abs().max().item() for k, v in single["grads"].items())
    print(f"measured: max|dgrad| {dg:.2e} (max|grad| {gmax:.2e})")
    assert dg <= 1e-5 * gmax, (dg, gmax)
    # one AdamW step (lr 1e-3): lr * g / (|g| + eps) amplifies tiny differences of gradients near eps = 1e-8,
    # so weights agree to a fraction of lr; a wrong gradient element moves its weight by ~2 lr
    for ref in (single["weights"], single["fsdp_weights"]):
        assert set(got["weights"]) == set(ref)
        dw = max((got["weights"][k] - ref[k]).abs().max().item() for k in ref)
        print(f"measured: max|dw| after one step {dw / LR:.2e} * lr")
        assert dw <= 0.25 * LR, dw
    assert np.abs(got["lp1"] - got["lp0"]).max() > 1e-4  # the step moved the policy


@pytest.mark.isa
def test_batch_invariant_mode_under_megatron_tp2_ep2(two_ranks):
    lps = two_ranks[0]["bi_lps"]
    np.testing.assert_array_equal(lps[4], lps[1])
    np.testing.assert_array_equal(lps[4], lps[3])
    assert np.abs(lps[4] - two_ranks[0]["lp0"]).max() <= LP_ATOL  # the invariant kernels: fp32 rounding only
    assert np.isfinite(two_ranks[0]["bi_step"]["loss"]) and two_ranks[0]["bi_step"]["grad_norm"] > 0


def test_delta_sync_from_sharded_params(two_ranks):
    """Rank 0 published the weights gathered from the TP2 x EP2 shards (bf16, HF checkpoint names) before and
    after the step: a full snapshot, then an XOR delta; a receiver ends with exactly the gathered weights."""
    from skyrl_numerics.sync.weight_sync import DeltaReceiver

    got = two_ranks[0]
    is_full, payload, raw, changed = got["delta"]
    assert not is_full and 0 < payload < raw and changed > 0
    rec = DeltaReceiver(got["sync_dir"])
    applied = rec.sync()
    assert len(applied) == 2 and rec.version == applied[-1].version
    assert set(rec.state) == set(got["weights"])
    for k, v in got["weights"].items():
        assert torch.equal(torch.as_tensor(rec.state[k]), v.to(torch.bfloat16)), k


def test_deepseek_v3_ep2_matches_single_rank_and_fsdp(two_ranks, single_ds):
    """EP 2 > TP 1: both ranks run the same batch and both copies reach the experts; the trainer divides the
    expert gradient by the 2 copies (a missing division doubles it: grad norm and weights would fail)."""
    got, ref = two_ranks[0], single_ds
    d1 = np.abs(got["ds_lp0"] - ref["lp0"]).max()
    d2 = np.abs(got["ds_lp0"] - ref["fsdp_lp0"]).max()
    print(f"\nmeasured DeepSeek-V3: max|dlp| EP2 vs 1 rank {d1:.2e}, vs FSDP {d2:.2e}")
    assert d1 <= LP_ATOL and d2 <= LP_ATOL
    gmax = max(v.abs().max().item() for v in ref["grads"].values())
    dg = max((got["ds_grads"][k] - v).abs().max().item() for k, v in ref["grads"].items())
    assert dg <= 1e-5 * gmax, (dg, gmax)
    for m in (ref["metrics"], ref["fsdp_metrics"]):
        assert got["ds_metrics"]["loss"] == pytest.approx(m["loss"], rel=1e-5, abs=1e-6)
        assert got["ds_metrics"]["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-4)
    for w in (ref["weights"], ref["fsdp_weights"]):
        assert set(got["ds_weights"]) == set(w)
        assert max((got["ds_weights"][k] - v).abs().max().item() for k, v in w.items()) <= 0.25 * LR
