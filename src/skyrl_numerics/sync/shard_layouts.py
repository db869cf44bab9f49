"""The two layouts :mod:`.shard_plan` connects: megatron-core (trainer) and vLLM (engine), per HF tensor.

HF tensors per layer ``l`` (``P = model.layers.l.``; ``nh`` heads, ``ng`` KV heads, ``d`` head dim,
``E`` experts of width ``f``, ``H`` hidden, ``V`` vocabulary):

- Qwen3-MoE (GQA): ``P self_attn.{q,k,v,o}_proj``, ``{q,k}_norm``, ``P mlp.gate`` (router),
  ``P mlp.experts.e.{gate,up,down}_proj``, the two layer norms; ``model.embed_tokens``,
  ``model.norm``, ``lm_head``.
- DeepSeek-V3 family (MLA, ``kv_lora_rank`` in the config): ``q_proj`` or ``q_a_proj`` /
  ``q_a_layernorm`` / ``q_b_proj``, ``kv_a_proj_with_mqa`` [r + rope, H], ``kv_a_layernorm``,
  ``kv_b_proj`` [nh·(nope + v), r], ``o_proj``; dense MLP in the first ``first_k_dense_replace``
  layers, ``shared_experts.*`` beside the routed ones, ``e_score_correction_bias``.

Megatron (``megatron_layout``, the layout of ``trainer/megatron/mapping.py``): ranks from
megatron-core's ``RankGenerator`` (order ``tp-cp-ep-dp-pp``, expert-TP 1). TP splits ``linear_qkv``
rows by whole KV groups (each group ``[q heads; k; v]``), ``linear_proj`` columns, vocabulary rows
(``torch.chunk`` blocks), dense/shared ``linear_fc1 = [gate; up]`` rows and ``linear_fc2`` columns,
MLA ``linear_q(_up)_proj`` / ``linear_kv_up_proj`` rows by heads; norms, routers and MLA down
projections are replicated; experts whole per EP rank; layers in contiguous PP stages (embedding on
the first, norm and output layer on the last). For MLA the rope rows' de-interleave (a permutation
inside one rank's block: the same bytes) is left to the receiving rank and not placed here.

vLLM (``vllm_layout``): ``world = tp × dp`` ranks, rank ``= dp_rank·tp + tp_rank``; each data-parallel
replica holds attention, dense MLP and vocabulary TP-split (``qkv_proj = [q; k; v]`` of the rank's
heads, KV head ``tp_rank·ng/tp`` replicated when ``tp > ng``; ``VocabParallelEmbedding`` blocks of
``V`` padded to a multiple of 64·tp... exactly ``pad_vocab_size(V, 64)`` split in ``tp``);
experts either TP-split along ``f`` (``w13 = [gate; up]``, ``w2`` columns) or, with ``ep=True``,
whole and spread over all ``world`` ranks in contiguous blocks (vLLM's linear placement). MLA:
``fused_qkv_a_proj = [q_a; kv_a]`` (with q LoRA) or ``kv_a_proj_with_mqa`` replicated,
``q(_b)_proj`` / ``kv_b_proj`` rows by heads, ``o_proj`` columns.
"""
from __future__ import annotations

from skyrl_numerics.errors import InputError
from skyrl_numerics.hf_config import moe_dims

from .shard_plan import Layout


def _cfg(config) -> dict:
    return dict(config if isinstance(config, dict) else config.to_dict())


def _n_experts(c):
    """Routed experts (:func:`skyrl_numerics.hf_config.moe_dims`: every name configs use)."""
    return moe_dims(c).num_experts


def _mla(c) -> bool:
    return bool(c.get("kv_lora_rank"))


def _moe_layer(c, l) -> bool:
    """Does layer ``l`` route (:meth:`~skyrl_numerics.hf_config.MoEDims.is_moe_layer`: Qwen3-MoE's
    ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek-V3's ``first_k_dense_replace``)?"""
    return moe_dims(c).is_moe_layer(l)


def hf_shapes(config) -> dict:
    """``{HF tensor name: shape}`` of a Qwen3-MoE or DeepSeek-V3-family config (no weights read)."""
    c = _cfg(config)
    H, V, L, nh = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["num_attention_heads"]
    E, f = _n_experts(c), c.get("moe_intermediate_size")
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not c.get("tie_word_embeddings"):
        out["lm_head.weight"] = (V, H)
    for l in range(L):
        P = f"model.layers.{l}."
        out[P + "input_layernorm.weight"] = (H,)
        out[P + "post_attention_layernorm.weight"] = (H,)
        if _mla(c):
            r, rope, nope, v = (c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"],
                                c["v_head_dim"])
            q = nh * (nope + rope)
            if c.get("q_lora_rank"):
                out[P + "self_attn.q_a_proj.weight"] = (c["q_lora_rank"], H)
                out[P + "self_attn.q_a_layernorm.weight"] = (c["q_lora_rank"],)
                out[P + "self_attn.q_b_proj.weight"] = (q, c["q_lora_rank"])
            else:
                out[P + "self_attn.q_proj.weight"] = (q, H)
            out[P + "self_attn.kv_a_proj_with_mqa.weight"] = (r + rope, H)
            out[P + "self_attn.kv_a_layernorm.weight"] = (r,)
            out[P + "self_attn.kv_b_proj.weight"] = (nh * (nope + v), r)
            out[P + "self_attn.o_proj.weight"] = (H, nh * v)
        else:
            ng = c["num_key_value_heads"]
            d = c.get("head_dim") or H // nh
            out[P + "self_attn.q_proj.weight"] = (nh * d, H)
            out[P + "self_attn.k_proj.weight"] = (ng * d, H)
            out[P + "self_attn.v_proj.weight"] = (ng * d, H)
            out[P + "self_attn.o_proj.weight"] = (H, nh * d)
            out[P + "self_attn.q_norm.weight"] = (d,)
            out[P + "self_attn.k_norm.weight"] = (d,)
        if not _moe_layer(c, l):
            i = c["intermediate_size"]
            out.update({P + "mlp.gate_proj.weight": (i, H), P + "mlp.up_proj.weight": (i, H),
                        P + "mlp.down_proj.weight": (H, i)})
            continue
        out[P + "mlp.gate.weight"] = (E, H)
        if _mla(c):
            out[P + "mlp.gate.e_score_correction_bias"] = (E,)
        if c.get("n_shared_experts"):
            s = c["n_shared_experts"] * f
            out.update({P + "mlp.shared_experts.gate_proj.weight": (s, H),
                        P + "mlp.shared_experts.up_proj.weight": (s, H),
                        P + "mlp.shared_experts.down_proj.weight": (H, s)})
        for e in range(E):
            X = f"{P}mlp.experts.{e}."
            out.update({X + "gate_proj.weight": (f, H), X + "up_proj.weight": (f, H),
                        X + "down_proj.weight": (H, f)})
    return out


def _split(n: int, parts: int, i: int) -> tuple:
    """``torch.chunk``'s block ``i`` of ``n`` rows in ``parts``."""
    size = -(-n // parts)
    return (min(i * size, n), min((i + 1) * size, n))


def _even(n: int, parts: int, i: int, what: str) -> tuple:
    if n % parts:
        raise InputError(f"{what} = {n} is not divisible by {parts}", field=what)
    return (i * n // parts, (i + 1) * n // parts)


def _whole(shape) -> tuple:
    return tuple((0, s) for s in shape)


# ---- megatron-core -------------------------------------------------------------------------------
def megatron_layout(config, *, tp: int = 1, ep: int = 1, pp: int = 1, world: int | None = None) -> Layout:
    """megatron-core's placement of the HF tensors on ``world`` ranks (module docstring)."""
    from megatron.core.parallel_state import RankGenerator

    c = _cfg(config)
    shapes = hf_shapes(c)
    world = world or tp * ep * pp
    if world % (tp * pp) or world % (ep * pp):
        raise InputError(f"world {world} is not a multiple of tp×pp={tp * pp} and ep×pp={ep * pp}",
                         field="world")
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=1, ep=ep, dp=world // (ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    tp_of, pp_of, ep_of = {}, {}, {}
    for g in dense.get_ranks("tp"):
        for i, r in enumerate(g):
            tp_of[r] = i
    for g in dense.get_ranks("pp"):
        for i, r in enumerate(g):
            pp_of[r] = i
    for g in expert.get_ranks("ep"):
        for i, r in enumerate(g):
            ep_of[r] = i
    L, H, nh, E = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], _n_experts(c)
    lay = Layout(f"megatron tp{tp} ep{ep} pp{pp}", world, shapes)
    stage = [min(l * pp // L, pp - 1) for l in range(L)]
    first = [sum(1 for k in range(l) if stage[k] == stage[l]) for l in range(L)]   # local index
    for r in range(world):
        t, s, er = tp_of[r], pp_of[r], ep_of[r]

        def rep(name, hfn):
            lay.add(r, name, hfn, _whole(shapes[hfn]), shape=shapes[hfn])

        def rows(name, hfn, rng, at=0, shape=None):
            sh = shapes[hfn]
            lay.add(r, name, hfn, ((rng[0], rng[1]),) + _whole(sh[1:]), (at,) + (0,) * (len(sh) - 1),
                    shape)

        def cols(name, hfn, rng):
            sh = shapes[hfn]
            lay.add(r, name, hfn, ((0, sh[0]), rng), shape=(sh[0], rng[1] - rng[0]))

        if s == 0:
            v = _split(shapes["model.embed_tokens.weight"][0], tp, t)
            rows("embedding.word_embeddings.weight", "model.embed_tokens.weight", v, shape=(v[1] - v[0], H))
        if s == pp - 1:
            rep("decoder.final_layernorm.weight", "model.norm.weight")
            head = "lm_head.weight" if "lm_head.weight" in shapes else "model.embed_tokens.weight"
            v = _split(shapes[head][0], tp, t)
            rows("output_layer.weight", head, v, shape=(v[1] - v[0], H))
        for l in range(L):
            if stage[l] != s:
                continue
            P, M = f"model.layers.{l}.", f"decoder.layers.{first[l]}."
            rep(M + "input_layernorm.weight", P + "input_layernorm.weight")
            rep(M + "pre_mlp_layernorm.weight", P + "post_attention_layernorm.weight")
            A = M + "self_attention."
            if _mla(c):
                _megatron_mla(lay, r, c, shapes, P, A, tp, t, rep, rows, cols)
            else:
                ng = c["num_key_value_heads"]
                d = c.get("head_dim") or H // nh
                hpg, gl = nh // ng, _even(ng, tp, t, "num_key_value_heads")
                name, width = A + "linear_qkv.weight", (hpg + 2) * d
                for i, g in enumerate(range(*gl)):
                    base = i * width
                    rows(name, P + "self_attn.q_proj.weight", (g * hpg * d, (g + 1) * hpg * d), base)
                    rows(name, P + "self_attn.k_proj.weight", (g * d, (g + 1) * d), base + hpg * d)
                    rows(name, P + "self_attn.v_proj.weight", (g * d, (g + 1) * d), base + (hpg + 1) * d)
                lay.shapes[(r, name)] = ((gl[1] - gl[0]) * width, H)
                cols(A + "linear_proj.weight", P + "self_attn.o_proj.weight",
                     (gl[0] * hpg * d, gl[1] * hpg * d))
                rep(A + "q_layernorm.weight", P + "self_attn.q_norm.weight")
                rep(A + "k_layernorm.weight", P + "self_attn.k_norm.weight")
            if not _moe_layer(c, l):
                _fc(lay, rows, cols, shapes, P + "mlp.", M + "mlp.", tp, t, r)
                continue
            rep(M + "mlp.router.weight", P + "mlp.gate.weight")
            if _mla(c):
                rep(M + "mlp.router.expert_bias", P + "mlp.gate.e_score_correction_bias")
            if c.get("n_shared_experts"):
                _fc(lay, rows, cols, shapes, P + "mlp.shared_experts.", M + "mlp.shared_experts.", tp, t, r)
            lo, hi = _even(E, ep, er, "num_experts")
            for e in range(lo, hi):
                X, Y = f"{P}mlp.experts.{e}.", f"{M}mlp.experts.local_experts.{e - lo}."
                fw = shapes[X + "gate_proj.weight"][0]
                rows(Y + "linear_fc1.weight", X + "gate_proj.weight", (0, fw), 0, (2 * fw, H))
                rows(Y + "linear_fc1.weight", X + "up_proj.weight", (0, fw), fw)
                rep(Y + "linear_fc2.weight", X + "down_proj.weight")
    return lay


def _fc(lay, rows, cols, shapes, P, M, tp, t, r):
    i = shapes[P + "gate_proj.weight"][0]
    lo, hi = _even(i, tp, t, "intermediate_size")
    H = shapes[P + "gate_proj.weight"][1]
    rows(M + "linear_fc1.weight", P + "gate_proj.weight", (lo, hi), 0, (2 * (hi - lo), H))
    rows(M + "linear_fc1.weight", P + "up_proj.weight", (lo, hi), hi - lo)
    cols(M + "linear_fc2.weight", P + "down_proj.weight", (lo, hi))


def _megatron_mla(lay, r, c, shapes, P, A, tp, t, rep, rows, cols):
    nh, rope, nope, v = c["num_attention_heads"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    h0, h1 = _even(nh, tp, t, "num_attention_heads")
    if c.get("q_lora_rank"):
        rep(A + "linear_q_down_proj.weight", P + "self_attn.q_a_proj.weight")
        rep(A + "linear_q_up_proj.layer_norm_weight", P + "self_attn.q_a_layernorm.weight")
        q = P + "self_attn.q_b_proj.weight"
        rows(A + "linear_q_up_proj.weight", q, (h0 * (nope + rope), h1 * (nope + rope)), 0,
             ((h1 - h0) * (nope + rope), shapes[q][1]))
    else:
        q = P + "self_attn.q_proj.weight"
        rows(A + "linear_q_proj.weight", q, (h0 * (nope + rope), h1 * (nope + rope)), 0,
             ((h1 - h0) * (nope + rope), shapes[q][1]))
    rep(A + "linear_kv_down_proj.weight", P + "self_attn.kv_a_proj_with_mqa.weight")
    rep(A + "linear_kv_up_proj.layer_norm_weight", P + "self_attn.kv_a_layernorm.weight")
    kv = P + "self_attn.kv_b_proj.weight"
    rows(A + "linear_kv_up_proj.weight", kv, (h0 * (nope + v), h1 * (nope + v)), 0,
         ((h1 - h0) * (nope + v), shapes[kv][1]))
    cols(A + "linear_proj.weight", P + "self_attn.o_proj.weight", (h0 * v, h1 * v))


# ---- vLLM ------------------------------------------------------------------------------------------
def pad_vocab(v: int, to: int = 64) -> int:
    """vLLM's ``pad_vocab_size`` (``DEFAULT_VOCAB_PADDING_SIZE`` 64)."""
    return -(-v // to) * to


def vllm_layout(config, *, tp: int = 1, dp: int = 1, ep: bool = False) -> Layout:
    """vLLM's placement of the HF tensors on ``tp × dp`` ranks (module docstring)."""
    c = _cfg(config)
    shapes = hf_shapes(c)
    L, H, nh, E = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], _n_experts(c)
    world = tp * dp
    lay = Layout(f"vllm tp{tp} dp{dp}" + (" ep" if ep else ""), world, shapes)
    for r in range(world):
        t = r % tp

        def rep(name, hfn):
            lay.add(r, name, hfn, _whole(shapes[hfn]), shape=shapes[hfn])

        def rows(name, hfn, rng, at=0, shape=None):
            sh = shapes[hfn]
            lay.add(r, name, hfn, ((rng[0], rng[1]),) + _whole(sh[1:]), (at,) + (0,) * (len(sh) - 1), shape)

        def cols(name, hfn, rng):
            sh = shapes[hfn]
            lay.add(r, name, hfn, ((0, sh[0]), rng), shape=(sh[0], rng[1] - rng[0]))

        V = shapes["model.embed_tokens.weight"][0]
        per = pad_vocab(V) // tp
        vr = (min(t * per, V), min((t + 1) * per, V))
        rows("model.embed_tokens.weight", "model.embed_tokens.weight", vr, shape=(per, H))
        head = "lm_head.weight" if "lm_head.weight" in shapes else "model.embed_tokens.weight"
        rows("lm_head.weight", head, vr, shape=(per, H))
        rep("model.norm.weight", "model.norm.weight")
        for l in range(L):
            P = f"model.layers.{l}."
            rep(P + "input_layernorm.weight", P + "input_layernorm.weight")
            rep(P + "post_attention_layernorm.weight", P + "post_attention_layernorm.weight")
            if _mla(c):
                _vllm_mla(lay, r, c, shapes, P, tp, t, rep, rows, cols)
            else:
                ng = c["num_key_value_heads"]
                d = c.get("head_dim") or H // nh
                h0, h1 = _even(nh, tp, t, "num_attention_heads")
                if tp >= ng:
                    g0 = t * ng // tp
                    g1 = g0 + 1
                else:
                    g0, g1 = _even(ng, tp, t, "num_key_value_heads")
                name = P + "self_attn.qkv_proj.weight"
                qn, kn = (h1 - h0) * d, (g1 - g0) * d
                rows(name, P + "self_attn.q_proj.weight", (h0 * d, h1 * d), 0, (qn + 2 * kn, H))
                rows(name, P + "self_attn.k_proj.weight", (g0 * d, g1 * d), qn)
                rows(name, P + "self_attn.v_proj.weight", (g0 * d, g1 * d), qn + kn)
                cols(P + "self_attn.o_proj.weight", P + "self_attn.o_proj.weight", (h0 * d, h1 * d))
                rep(P + "self_attn.q_norm.weight", P + "self_attn.q_norm.weight")
                rep(P + "self_attn.k_norm.weight", P + "self_attn.k_norm.weight")
            if not _moe_layer(c, l):
                _gate_up(lay, rows, cols, shapes, P + "mlp.", tp, t)
                continue
            rep(P + "mlp.gate.weight", P + "mlp.gate.weight")
            if _mla(c):
                rep(P + "mlp.gate.e_score_correction_bias", P + "mlp.gate.e_score_correction_bias")
            if c.get("n_shared_experts"):
                _gate_up(lay, rows, cols, shapes, P + "mlp.shared_experts.", tp, t)
            f = c["moe_intermediate_size"]
            w13, w2 = P + "mlp.experts.routed_experts.w13_weight", P + "mlp.experts.routed_experts.w2_weight"
            if ep:
                lo, hi = _even(E, world, r, "num_experts")
                f0, f1 = 0, f
            else:
                lo, hi = 0, E
                f0, f1 = _even(f, tp, t, "moe_intermediate_size")
            n, fw = hi - lo, f1 - f0
            for e in range(lo, hi):
                X, i = f"{P}mlp.experts.{e}.", e - lo
                lay.add(r, w13, X + "gate_proj.weight", ((f0, f1), (0, H)), (i, 0, 0), (n, 2 * fw, H))
                lay.add(r, w13, X + "up_proj.weight", ((f0, f1), (0, H)), (i, fw, 0))
                lay.add(r, w2, X + "down_proj.weight", ((0, H), (f0, f1)), (i, 0, 0), (n, H, fw))
    return lay


def _gate_up(lay, rows, cols, shapes, P, tp, t):
    """vLLM's ``gate_up_proj = [gate; up]`` rows and ``down_proj`` columns of the rank."""
    i = shapes[P + "gate_proj.weight"][0]
    H = shapes[P + "gate_proj.weight"][1]
    lo, hi = _even(i, tp, t, "intermediate_size")
    rows(P + "gate_up_proj.weight", P + "gate_proj.weight", (lo, hi), 0, (2 * (hi - lo), H))
    rows(P + "gate_up_proj.weight", P + "up_proj.weight", (lo, hi), hi - lo)
    cols(P + "down_proj.weight", P + "down_proj.weight", (lo, hi))


def _vllm_mla(lay, r, c, shapes, P, tp, t, rep, rows, cols):
    nh, rope, nope, v = c["num_attention_heads"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    h0, h1 = _even(nh, tp, t, "num_attention_heads")
    A = P + "self_attn."
    kva = A + "kv_a_proj_with_mqa.weight"
    if c.get("q_lora_rank"):
        qa = A + "q_a_proj.weight"
        nq, H = shapes[qa]
        rows(A + "fused_qkv_a_proj.weight", qa, (0, nq), 0, (nq + shapes[kva][0], H))
        rows(A + "fused_qkv_a_proj.weight", kva, (0, shapes[kva][0]), nq)
        rep(A + "q_a_layernorm.weight", A + "q_a_layernorm.weight")
        q = A + "q_b_proj.weight"
    else:
        rep(kva, kva)
        q = A + "q_proj.weight"
    rows(q, q, (h0 * (nope + rope), h1 * (nope + rope)), 0, ((h1 - h0) * (nope + rope), shapes[q][1]))
    rep(A + "kv_a_layernorm.weight", A + "kv_a_layernorm.weight")
    kv = A + "kv_b_proj.weight"
    rows(kv, kv, (h0 * (nope + v), h1 * (nope + v)), 0, ((h1 - h0) * (nope + v), shapes[kv][1]))
    cols(A + "o_proj.weight", A + "o_proj.weight", (h0 * v, h1 * v))
