"""The GPT-OSS invariant family (``invariant/gpt_oss.py``) without vLLM:

- its numbers are GPT-OSS's: in fp32 the logits of HF transformers' ``GptOssForCausalLM``
  (attention sinks, a sliding window the prompt outruns, YaRN with ``truncate=False``, the
  biased router, the clamped SwiGLU over the interleaved gate/up layout) within 1e-5; in bf16
  no farther from HF fp32 than HF's own bf16 forward (twice its error at most);
- what the engine runs equals the trainer bit for bit: a paged, chunked, token-by-token
  forward over rows read back from a slot store (gathered, or in place through the slots;
  bf16 and FP8 cache rows),
  requests of equal query counts batched with ``kv_lens``, against the full-sequence forward;
  packed trainer batches against each sequence alone; the grouped experts against the
  per-expert loop; the autograd forward against the no-grad one;
- routes: top-k of the router logits, numbered over every layer;
- what it cannot reproduce is refused naming the field (MXFP4, tied lm-head, layer types).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.blocks import Rope, UnsupportedConfig
from skyrl_numerics.models import build_tiny_model, load_hf_model, tiny_config

pytestmark = pytest.mark.isa


@pytest.fixture(scope="module")
def bf16_dir():
    return build_tiny_model("gpt_oss")


@pytest.fixture(scope="module")
def model(bf16_dir):
    return from_checkpoint(bf16_dir)


def _ids(n, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(2, 512, n))


def test_fp32_forward_is_hf_gpt_oss():
    d = build_tiny_model("gpt_oss", dtype="float32")
    m = from_checkpoint(d, dtype=torch.float32)
    assert m.dims.windows == (32, None)
    ids = _ids(90, 1)                                     # 90 > the window of 32
    with torch.no_grad():
        ours = m.logits(m.sequence_hidden(ids))
        ref = load_hf_model(d, dtype="float32")(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() < 1e-5


def test_bf16_forward_is_as_close_to_hf_fp32_as_hf_bf16(bf16_dir, model):
    ids = _ids(64, 2)
    with torch.no_grad():
        ours = model.logits(model.sequence_hidden(ids)).float()
        ref = load_hf_model(bf16_dir, dtype="float32")(ids[None]).logits[0]
        stock = load_hf_model(bf16_dir)(ids[None]).logits[0].float()
    err, stock_err = (ours - ref).abs().max().item(), (stock - ref).abs().max().item()
    assert stock_err > 0 and err <= 2 * stock_err, (err, stock_err)


def test_yarn_without_truncation_is_hf_rope():
    """``truncate=False`` (gpt-oss's YaRN): fractional correction bounds, HF's inv_freq and
    attention scaling."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = GptOssConfig(**{k: v for k, v in tiny_config("gpt_oss").items()
                          if k not in ("model_type", "architectures")})
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    rope = Rope.from_config(cfg, 64, "neox")
    assert torch.allclose(rope.inv_freq, inv.float(), rtol=1e-6, atol=0)
    assert abs(rope.mscale - scale) < 1e-6
    trunc = Rope.from_config(GptOssConfig(**{**cfg.to_dict(), "rope_parameters": {
        **cfg.rope_parameters, "truncate": True}}), 64, "neox")
    assert not torch.equal(trunc.inv_freq, rope.inv_freq)


def _decode(model, seqs, chunks, paged_read):
    """A paged engine in miniature: each request's rows in its own shuffled slots, prefill in
    ``chunks`` then one token per step for every live request together (``kv_lens``)."""
    rng = np.random.default_rng(0)
    n_slots = sum(len(s) for s in seqs)
    perm = torch.from_numpy(rng.permutation(n_slots))
    starts = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    slot_of = [perm[starts[r]:starts[r + 1]] for r in range(len(seqs))]
    store: dict[int, torch.Tensor] = {}
    out = [[] for _ in seqs]

    def step(work):                                   # [(request, start, n)]
        ids = torch.cat([seqs[r][a:a + n] for r, a, n in work])
        pos = torch.cat([torch.arange(a, a + n) for _, a, n in work])
        slots = torch.cat([slot_of[r][a:a + n] for r, a, n in work])
        qsl = np.concatenate([[0], np.cumsum([n for _, _, n in work])])

        def attend(i, q, rows):
            st = store.setdefault(i, torch.zeros(n_slots, model.kv.row_bytes, dtype=torch.uint8))
            st[slots] = model.kv.encode(i, rows)
            res = q.new_zeros(q.shape)
            groups: dict[int, list[int]] = {}
            for j, (_, _, n) in enumerate(work):
                groups.setdefault(n, []).append(j)
            for js in groups.values():
                lens = [work[j][1] + work[j][2] for j in js]
                L = max(lens)
                Q = torch.stack([q[qsl[j]:qsl[j + 1]] for j in js])
                kl = torch.tensor(lens) if len(js) > 1 else None
                idx = torch.zeros(len(js), L, dtype=torch.long)
                for b, j in enumerate(js):
                    idx[b, :lens[b]] = slot_of[work[j][0]][:lens[b]]
                if paged_read:
                    o = model.attn_core_paged(i, Q, st.view(model.kv.dtype), idx, kl)
                else:
                    o = model.attn_core(i, Q, model.kv.decode(i, st[idx]), kl)
                for b, j in enumerate(js):
                    res[qsl[j]:qsl[j + 1]] = o[b, :work[j][2]]
            return res
        h = model.forward_tokens(ids, pos, attend)
        for j, (r, _, _) in enumerate(work):
            out[r].append(h[qsl[j]:qsl[j + 1]])

    for work in chunks:
        step(work)
    pos = {r: sum(n for w in chunks for rr, _, n in w if rr == r) for r in range(len(seqs))}
    while any(pos[r] < len(seqs[r]) for r in pos):
        live = [r for r in pos if pos[r] < len(seqs[r])]
        step([(r, pos[r], 1) for r in live])
        for r in live:
            pos[r] += 1
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("kv,paged_read", [("auto", False), ("auto", True), ("fp8", False)])
def test_paged_chunked_decode_equals_the_trainer_forward(bf16_dir, model, kv, paged_read):
    """Also with an FP8 cache (rows stored as E4M3 bytes; the trainer sends its rows through
    the same format)."""
    if kv != "auto":
        model = from_checkpoint(bf16_dir, kv_cache=kv)
    seqs = [_ids(n, 10 + n) for n in (70, 45, 50)]   # past the window of 32
    chunks = [[(0, 0, 20), (1, 0, 7)], [(1, 7, 30), (2, 0, 13), (0, 20, 1)], [(2, 13, 30)]]
    with torch.no_grad():
        got = _decode(model, seqs, chunks, paged_read)
        for r, s in enumerate(seqs):
            assert torch.equal(got[r], model.sequence_hidden(s)), r


def test_packed_trainer_batches_equal_each_sequence_alone(model):
    seqs = [_ids(n, s) for s, n in enumerate([5, 40, 1, 66, 9, 33])]
    with torch.no_grad():
        alone = torch.cat([model.sequence_hidden(s) for s in seqs])
        for bs in (2, 6):
            parts = [model.packed_hidden(seqs[a:a + bs]) for a in range(0, len(seqs), bs)]
            assert torch.equal(torch.cat(parts), alone), bs


@pytest.mark.parametrize("T", [1, 7, 50])
def test_grouped_experts_are_the_per_expert_loop(model, T):
    g = torch.Generator().manual_seed(T)
    x = (torch.randn(T, model.dims.hidden, generator=g) * 2).bfloat16()
    p = "model.layers.0.mlp.experts."
    gu_b, dn_b = model.w(p + "gate_up_proj_bias"), model.w(p + "down_proj_bias")
    biases = (gu_b[:, 0::2], gu_b[:, 1::2], dn_b)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
    w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    with torch.no_grad():
        mats = model.expert_mats(0)
        grouped = model.grouped_experts(x, ids, w, mats, biases)
        looped = model.looped_experts(x, ids, w, mats, biases)
    assert torch.equal(grouped, looped)


def test_the_autograd_forward_has_the_engine_bits_and_trains_the_sinks(bf16_dir, model):
    """Trainer forward with gradients (expert weights as views, attention backward from the
    fp64 reference) = the no-grad forward bit for bit; the sinks and the interleaved experts get
    gradients."""
    m = from_checkpoint(bf16_dir)
    for p in m.parameters():
        p.requires_grad_(True)
    ids = _ids(50, 3)
    h = m.sequence_hidden(ids)
    with torch.no_grad():
        assert torch.equal(h.detach(), model.sequence_hidden(ids))
    m.logits(h).float().logsumexp(-1).sum().backward()
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.experts.gate_up_proj",
                 "model.layers.1.mlp.router.weight"):
        g = m.params[m._names[name]].grad
        assert g is not None and g.abs().sum() > 0, name


def test_routes_are_the_top_k_router_logits_of_every_layer(model):
    seen = {}
    model.route_hook = lambda layer, ids: seen.setdefault(layer, ids.clone())
    try:
        with torch.no_grad():
            model.sequence_hidden(_ids(12, 4))
    finally:
        model.route_hook = None
    assert sorted(seen) == [0, 1] and model.route_info() == {"layers": 2, "k": 2, "num_experts": 8}
    assert all(v.shape == (12, 2) and len(set(map(tuple, v.sort(-1)[0].tolist()))) > 1
               for v in seen.values())


@pytest.mark.parametrize("over,field", [
    # gpt-oss's own MXFP4 experts: refused by the vendor-checkpoint reader, before the family
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": None}, "layer_types"),
])
def test_unreproducible_config_is_refused_naming_the_field(over, field):
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    cfg = {**tiny_config("gpt_oss"), **over}
    with pytest.raises(UnsupportedConfig) as e:
        engine_overrides(json.loads(json.dumps(cfg)))
    assert e.value.field == field


def test_a_weight_update_in_place_reaches_the_expert_copies(bf16_dir):
    """The engine's in-place weight sync (``load_named``) bumps the HF tensors' versions: the
    de-interleaved expert copies are rebuilt, so the forward is a freshly loaded model's."""
    from skyrl_numerics.invariant.base import iter_checkpoint_tensors

    m = from_checkpoint(bf16_dir)
    ids = _ids(20, 6)
    with torch.no_grad():
        before = m.sequence_hidden(ids)
        new = {n: (t.float() * 1.5).to(t.dtype) for n, t in iter_checkpoint_tensors(bf16_dir)
               if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")}
        m.load_named(new.items())
        after = m.sequence_hidden(ids)
        fresh = from_checkpoint(bf16_dir)
        fresh.load_named(new.items())
        assert not torch.equal(after, before)
        assert torch.equal(after, fresh.sequence_hidden(ids))
