"""Sharded transfer plans (sync/shard_plan.py, shard_layouts.py).

The megatron layout is checked against the real re-layout code (``mapping.hf_to_megatron`` +
``shard_for_rank``, with ranks from megatron-core's ``RankGenerator``); a plan run on those shards
must give every vLLM rank exactly its layout's tensors, bitwise, while each rank receives only its
own slices."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.models import tiny_config
from skyrl_numerics.sync import shard_layouts as sl
from skyrl_numerics.sync import shard_plan as sp

pytestmark = pytest.mark.megatron


def _cfg(**kw):
    base = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=301)
    base.update(kw)
    return tiny_config("qwen3_moe", **base)


def _hf(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in sl.hf_shapes(cfg).items()}


def _ranks(tp, ep, world):
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=tp, ep=1, dp=world // tp, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    exp = RankGenerator(tp=1, ep=ep, dp=world // ep, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    tpr = {r: i for g in dense.get_ranks("tp") for i, r in enumerate(g)}
    epr = {r: i for g in exp.get_ranks("ep") for i, r in enumerate(g)}
    return tpr, epr


@pytest.mark.parametrize("tp,ep,world", [(1, 1, 1), (2, 1, 2), (2, 2, 2), (1, 2, 4), (2, 2, 4), (2, 4, 4)])
def test_megatron_layout_is_what_the_mapping_builds(tp, ep, world):
    from skyrl_numerics.trainer.megatron import mapping

    cfg = _cfg()
    hf = _hf(cfg)
    got = sp.materialize(sl.megatron_layout(cfg, tp=tp, ep=ep, world=world), hf)
    full = mapping.hf_to_megatron(hf, cfg)
    tpr, epr = _ranks(tp, ep, world)
    for r in range(world):
        want = mapping.shard_for_rank(full, cfg, tp_rank=tpr[r], tp=tp, ep_rank=epr[r], ep=ep)
        assert set(got[r]) == set(want)
        for k in want:
            assert torch.equal(got[r][k], want[k]), (r, k)


def _run(cfg, src, dst):
    hf = _hf(cfg, seed=1)
    p = sp.plan(src, dst)
    p.check()
    have = sp.materialize(src, hf)
    want = sp.materialize(dst, hf)
    out = {r: {k: torch.zeros_like(v) for k, v in d.items()} for r, d in want.items()}
    sp.execute(p, have, out)
    for r in want:
        for k in want[r]:
            assert torch.equal(out[r][k], want[r][k]), (r, k)
    return p


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2, 4]), dp_mul=st.sampled_from([1, 2]),
       vtp=st.sampled_from([1, 2, 4]), vdp=st.sampled_from([1, 2]), vep=st.booleans(),
       ng=st.sampled_from([1, 2, 4]), vocab=st.integers(200, 400))
def test_plan_gives_every_engine_rank_its_shards(tp, ep, dp_mul, vtp, vdp, vep, ng, vocab):
    cfg = _cfg(num_key_value_heads=ng, vocab_size=vocab)
    world = max(tp, ep) * dp_mul
    if world % tp or world % ep or ng % tp or (vep and 8 % (vtp * vdp)):
        return
    src = sl.megatron_layout(cfg, tp=tp, ep=ep, world=world)
    dst = sl.vllm_layout(cfg, tp=vtp, dp=vdp, ep=vep)
    p = _run(cfg, src, dst)
    # each engine rank receives (local copies included) exactly the bytes of its own pieces
    assert p.received(local=True) == dst.rank_bytes(2)
    # and no rank sends what it does not hold (check() raised otherwise); sums agree
    assert sum(p.sent().values()) == sum(p.received().values())
    full = p.full_bytes()
    recv = p.received(local=True)
    assert all(recv[r] <= full[r] for r in full)
    if vtp > 1:        # a TP-sharded engine rank reads less than the whole tensors it touches
        assert all(recv[r] < full[r] for r in full)
    if vtp > 1 or (vep and vdp > 1):  # a rank of a TP or EP engine: less than the whole model
        assert all(recv[r] < p.model_bytes() for r in recv)


def test_colocated_ranks_copy_locally():
    """Same tp on both sides, same rank numbers, a vocabulary both sides cut alike: nothing crosses
    ranks — attention and vocabulary shards are local, and megatron's whole experts (expert-TP 1,
    replicated over both ranks) hold the half that vLLM TP2 cuts along f."""
    cfg = _cfg(vocab_size=320)
    dst = sl.vllm_layout(cfg, tp=2)
    p = _run(cfg, sl.megatron_layout(cfg, tp=2, ep=1, world=2), dst)
    assert p.links() == {} and p.sent() == {}
    assert p.received(local=True) == dst.rank_bytes(2)


def test_vocabulary_cut_differently_moves_only_the_boundary_rows():
    """301 rows: megatron's ``torch.chunk`` gives rank 0 rows 0-150, vLLM pads to 320 and gives
    rank 0 rows 0-159: rows 151-159 of the embedding and of the LM head cross from rank 1 to rank 0,
    and nothing else."""
    cfg = _cfg(vocab_size=301)
    p = _run(cfg, sl.megatron_layout(cfg, tp=2, ep=1, world=2), sl.vllm_layout(cfg, tp=2))
    H = cfg["hidden_size"]
    assert p.links() == {(1, 0): 2 * 9 * H * 2}
    assert {t.dst_tensor for t in p.transfers if t.src_rank != t.dst_rank} == {
        "model.embed_tokens.weight", "lm_head.weight"}


def test_expert_parallel_moves_only_foreign_experts():
    """megatron EP2 → vLLM EP over 2 ranks: experts sit where vLLM wants them (contiguous blocks
    on both sides), so the only bytes that cross ranks are the vLLM-side vocabulary padding…
    none: the plan moves nothing between ranks."""
    cfg = _cfg()
    p = _run(cfg, sl.megatron_layout(cfg, tp=1, ep=2, world=2), sl.vllm_layout(cfg, tp=1, dp=2, ep=True))
    assert p.links() == {}
    # swapped ownership (vLLM's rank 0 wants megatron rank 1's experts) moves exactly those
    cfg4 = _cfg()
    p = _run(cfg4, sl.megatron_layout(cfg4, tp=1, ep=4, world=4), sl.vllm_layout(cfg4, tp=1, dp=2, ep=True))
    E, f, H, L = cfg4["num_experts"], cfg4["moe_intermediate_size"], cfg4["hidden_size"], 2
    # vLLM rank 0 wants experts 0-3, megatron ranks 0/1 hold 0-1/2-3 (ranks 2,3 hold 4-5/6-7)
    per_expert = 3 * f * H * 2
    assert p.links()[(1, 0)] >= 2 * L * per_expert


def test_plan_refuses_layouts_of_different_models_and_uncovered_blocks():
    a, b = _cfg(), _cfg(vocab_size=302)
    with pytest.raises(InputError, match="disagree"):
        sp.plan(sl.megatron_layout(a), sl.vllm_layout(b))
    src = sl.megatron_layout(a, tp=2, world=2)
    src.pieces = [q for q in src.pieces if not (q.rank == 1 and q.hf == "lm_head.weight")]
    with pytest.raises(InputError, match="lm_head.weight.*not wholly held"):
        sp.plan(src, sl.vllm_layout(a))
    with pytest.raises(InputError, match="num_key_value_heads = 2 is not divisible by 4"):
        sl.megatron_layout(a, tp=4, world=4)


def test_check_refuses_a_corrupted_plan():
    cfg = _cfg()
    p = sp.plan(sl.megatron_layout(cfg, tp=2, world=2), sl.vllm_layout(cfg, tp=1))
    t = p.transfers[3]
    dropped = sp.Plan(p.transfers[:3] + p.transfers[4:], p.itemsize, p.dst, p.src)
    with pytest.raises(InputError, match="plan covers"):
        dropped.check()
    twice = sp.Plan(p.transfers + [t], p.itemsize, p.dst, p.src)
    with pytest.raises(InputError, match="plan covers|written twice"):
        twice.check()
    bad = sp.Transfer(t.src_rank, t.src_tensor, tuple((a + 10**6, b + 10**6) for a, b in t.src_box),
                      t.dst_rank, t.dst_tensor, t.dst_box, t.numel)
    wrong = sp.Plan(p.transfers[:3] + [bad] + p.transfers[4:], p.itemsize, p.dst, p.src)
    with pytest.raises(InputError, match="does not hold"):
        wrong.check()


def test_mla_layouts_cover_every_tensor():
    """DeepSeek-V3 family (q LoRA on and off, shared experts, a dense first layer): every HF tensor
    is held whole by each side's ranks together, and the plan gives each vLLM rank its bytes."""
    for q_lora in (None, 32):
        cfg = tiny_config("deepseek_v3", num_hidden_layers=2, q_lora_rank=q_lora)
        shapes = sl.hf_shapes(cfg)
        for lay in (sl.megatron_layout(cfg, tp=2, ep=2, world=4), sl.vllm_layout(cfg, tp=2),
                    sl.vllm_layout(cfg, tp=2, dp=2, ep=True)):
            held = {}
            for q in lay.pieces:
                held.setdefault(q.hf, set()).add(q.box)
            for name, shape in shapes.items():
                assert sum(math.prod(b - a for a, b in box) for box in held[name]) == math.prod(shape), \
                    (lay.name, name)
        p = sp.plan(sl.megatron_layout(cfg, tp=2, ep=2, world=4), sl.vllm_layout(cfg, tp=2))
        p.check()
