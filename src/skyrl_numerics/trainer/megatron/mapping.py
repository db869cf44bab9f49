"""HF Qwen3-MoE <-> megatron-core GPTModel weight mapping (full tensors), and TP/EP sharding of them.

megatron-bridge does this for real models but needs CUDA Transformer Engine and transformers < 5 (a GPU
extra); this module is the small CPU mapping the issue allows, for the layout of
:func:`~.model.build_gpt_model`. Every conversion is a pure re-layout (views, cat, split, transpose,
reshape): no arithmetic, so ``hf -> megatron -> hf`` is bitwise the identity (tested).

Per layer ``l`` (``ng`` KV groups, ``nh`` heads, ``d`` head dim, ``E`` experts, ``f`` expert FFN width):

====================================================  ==========================================================
megatron-core                                          HF (checkpoint names; ``fused`` = transformers>=5 memory)
====================================================  ==========================================================
``embedding.word_embeddings.weight``                   ``model.embed_tokens.weight``
``decoder.layers.l.input_layernorm.weight``            ``model.layers.l.input_layernorm.weight``
``decoder.layers.l.self_attention.linear_qkv.weight``  q/k/v_proj, per group ``g``: rows
                                                       ``[q heads of g (nh/ng*d); k_g (d); v_g (d)]``
``...self_attention.linear_proj.weight``               ``self_attn.o_proj.weight``
``...self_attention.{q,k}_layernorm.weight``           ``self_attn.{q,k}_norm.weight``
``decoder.layers.l.pre_mlp_layernorm.weight``          ``post_attention_layernorm.weight``
``...mlp.router.weight``                               ``mlp.gate.weight``
``...mlp.experts.local_experts.e.linear_fc1.weight``   ``cat(experts.e.gate_proj, experts.e.up_proj)`` [2f, H]
                                                       (fused: ``experts.gate_up_proj[e]``)
``...mlp.experts.local_experts.e.linear_fc2.weight``   ``experts.e.down_proj.weight`` [H, f] (fused: ``down_proj[e]``)
grouped: ``...mlp.experts.weight1`` [H, E*2f]          memory of ``stack_e(fc1_e^T)`` [E, H, 2f]
grouped: ``...mlp.experts.weight2`` [E*f, H]           memory of ``stack_e(fc2_e^T)`` [E, f, H]
``decoder.final_layernorm.weight``                     ``model.norm.weight``
``output_layer.weight``                                ``lm_head.weight``
====================================================  ==========================================================

Sharding (:func:`shard_for_rank`): vocabulary rows of the embedding and lm-head, and ``linear_qkv`` rows
(whole KV groups), split in ``tp`` contiguous blocks; ``linear_proj`` columns likewise; experts by EP rank
(global expert ``ep_rank * E/ep + i`` is local ``i``); norms and router replicated.
:func:`gather_full` is the inverse (collective over the TP and EP groups).
"""
from __future__ import annotations

import re

import torch

from skyrl_numerics.errors import InputError

from .model import hf_config_dict

__all__ = ["hf_to_megatron", "megatron_to_hf", "shard_for_rank", "gather_full", "unshard"]

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _dims(cfg):
    nh, ng = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // nh
    return nh, ng, d, cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"], cfg["num_hidden_layers"]


def _take(sd: dict, key: str, shape=None):
    if key not in sd:
        raise InputError(f"missing weight {key!r}", field=key)
    t = sd[key]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise InputError(f"{key}: shape {tuple(t.shape)}, expected {tuple(shape)}", field=key)
    return t


def hf_to_megatron(hf_sd: dict, config, *, grouped_experts: bool = False) -> dict:
    """Full megatron-core state dict (tp = ep = 1 names) from an HF Qwen3-MoE state dict.

    ``hf_sd``: checkpoint names (``experts.<e>.gate_proj.weight`` …) or transformers>=5 in-memory fused
    experts (``experts.gate_up_proj`` / ``experts.down_proj``). Unknown or missing keys raise InputError.
    """
    cfg = hf_config_dict(config)
    if cfg.get("model_type") == "deepseek_v3":
        return _ds_to_megatron(hf_sd, cfg, grouped_experts)
    nh, ng, d, E, f, H, L = _dims(cfg)
    used = set()
    sd = dict(hf_sd)

    def take(k, shape=None):
        used.add(k)
        return _take(sd, k, shape)

    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight", (cfg["vocab_size"], H))}
    for l in range(L):
        p, m = f"model.layers.{l}.", f"decoder.layers.{l}."
        out[m + "input_layernorm.weight"] = take(p + "input_layernorm.weight", (H,))
        q = take(p + "self_attn.q_proj.weight", (nh * d, H)).reshape(ng, nh // ng * d, H)
        k = take(p + "self_attn.k_proj.weight", (ng * d, H)).reshape(ng, d, H)
        v = take(p + "self_attn.v_proj.weight", (ng * d, H)).reshape(ng, d, H)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, H)
        out[m + "self_attention.linear_proj.weight"] = take(p + "self_attn.o_proj.weight", (H, nh * d))
        out[m + "self_attention.q_layernorm.weight"] = take(p + "self_attn.q_norm.weight", (d,))
        out[m + "self_attention.k_layernorm.weight"] = take(p + "self_attn.k_norm.weight", (d,))
        out[m + "pre_mlp_layernorm.weight"] = take(p + "post_attention_layernorm.weight", (H,))
        out[m + "mlp.router.weight"] = take(p + "mlp.gate.weight", (E, H))
        if p + "mlp.experts.gate_up_proj" in sd:
            gu = take(p + "mlp.experts.gate_up_proj", (E, 2 * f, H))
            dn = take(p + "mlp.experts.down_proj", (E, H, f))
            fc1 = [gu[e] for e in range(E)]
            fc2 = [dn[e] for e in range(E)]
        else:
            fc1 = [torch.cat([take(f"{p}mlp.experts.{e}.gate_proj.weight", (f, H)),
                              take(f"{p}mlp.experts.{e}.up_proj.weight", (f, H))]) for e in range(E)]
            fc2 = [take(f"{p}mlp.experts.{e}.down_proj.weight", (H, f)) for e in range(E)]
        if grouped_experts:
            out[m + "mlp.experts.weight1"] = torch.stack([w.t() for w in fc1]).contiguous().reshape(H, E * 2 * f)
            out[m + "mlp.experts.weight2"] = torch.stack([w.t() for w in fc2]).contiguous().reshape(E * f, H)
        else:
            for e in range(E):
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
    out["decoder.final_layernorm.weight"] = take("model.norm.weight", (H,))
    out["output_layer.weight"] = take("lm_head.weight", (cfg["vocab_size"], H))
    extra = sorted(k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise InputError(f"{len(extra)} HF weights have no megatron-core counterpart, e.g. {extra[0]!r}",
                         field=extra[0])
    return out


def megatron_to_hf(mc_sd: dict, config, *, fused: bool = False) -> dict:
    """HF Qwen3-MoE state dict (checkpoint names; ``fused``: transformers>=5 in-memory experts) from a full
    megatron-core state dict (sequential or grouped experts)."""
    cfg = hf_config_dict(config)
    sd = {k: v for k, v in mc_sd.items() if not k.endswith("_extra_state")}
    if cfg.get("model_type") == "deepseek_v3":
        return {k: v.contiguous() for k, v in _ds_to_hf(sd, cfg, fused).items()}
    nh, ng, d, E, f, H, L = _dims(cfg)
    out = {"model.embed_tokens.weight": _take(sd, "embedding.word_embeddings.weight")}
    for l in range(L):
        p, m = f"model.layers.{l}.", f"decoder.layers.{l}."
        out[p + "input_layernorm.weight"] = _take(sd, m + "input_layernorm.weight")
        qkv = _take(sd, m + "self_attention.linear_qkv.weight", ((nh + 2 * ng) * d, H)).reshape(ng, -1, H)
        q, k, v = qkv.split([nh // ng * d, d, d], dim=1)
        out[p + "self_attn.q_proj.weight"] = q.reshape(nh * d, H)
        out[p + "self_attn.k_proj.weight"] = k.reshape(ng * d, H)
        out[p + "self_attn.v_proj.weight"] = v.reshape(ng * d, H)
        out[p + "self_attn.o_proj.weight"] = _take(sd, m + "self_attention.linear_proj.weight")
        out[p + "self_attn.q_norm.weight"] = _take(sd, m + "self_attention.q_layernorm.weight")
        out[p + "self_attn.k_norm.weight"] = _take(sd, m + "self_attention.k_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = _take(sd, m + "pre_mlp_layernorm.weight")
        out[p + "mlp.gate.weight"] = _take(sd, m + "mlp.router.weight")
        if m + "mlp.experts.weight1" in sd:
            w1 = _take(sd, m + "mlp.experts.weight1", (H, E * 2 * f)).reshape(E, H, 2 * f)
            w2 = _take(sd, m + "mlp.experts.weight2", (E * f, H)).reshape(E, f, H)
            fc1 = [w1[e].t() for e in range(E)]
            fc2 = [w2[e].t() for e in range(E)]
        else:
            fc1 = [_take(sd, f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight", (2 * f, H)) for e in range(E)]
            fc2 = [_take(sd, f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight", (H, f)) for e in range(E)]
        if fused:
            out[p + "mlp.experts.gate_up_proj"] = torch.stack(fc1)
            out[p + "mlp.experts.down_proj"] = torch.stack(fc2)
        else:
            for e in range(E):
                g, u = fc1[e].split([f, f])
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = g.contiguous()
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = u.contiguous()
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = fc2[e].contiguous()
    out["model.norm.weight"] = _take(sd, "decoder.final_layernorm.weight")
    out["lm_head.weight"] = _take(sd, "output_layer.weight")
    return {k: v.contiguous() for k, v in out.items()}


# ---- DeepSeek-V3 (MLA) ------------------------------------------------------------------------
def _rope_perm(r: int) -> torch.Tensor:
    """HF's interleaved rope channels (x0, y0, x1, y1, ...) -> de-interleaved (x0, x1, ..., y0, y1, ...)."""
    return torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])


def _experts_in(take, p, E, f, H, fused_key):
    if fused_key in take.sd:
        gu = take(p + "mlp.experts.gate_up_proj", (E, 2 * f, H))
        dn = take(p + "mlp.experts.down_proj", (E, H, f))
        return [gu[e] for e in range(E)], [dn[e] for e in range(E)]
    fc1 = [torch.cat([take(f"{p}mlp.experts.{e}.gate_proj.weight", (f, H)),
                      take(f"{p}mlp.experts.{e}.up_proj.weight", (f, H))]) for e in range(E)]
    return fc1, [take(f"{p}mlp.experts.{e}.down_proj.weight", (H, f)) for e in range(E)]


class _Taker:
    def __init__(self, sd):
        self.sd, self.used = dict(sd), set()

    def __call__(self, k, shape=None):
        self.used.add(k)
        return _take(self.sd, k, shape)

    def check_all_used(self):
        extra = sorted(k for k in self.sd if k not in self.used and not k.endswith("rotary_emb.inv_freq"))
        if extra:
            raise InputError(f"{len(extra)} HF weights have no megatron-core counterpart, e.g. {extra[0]!r}",
                             field=extra[0])


def _ds_dims(cfg):
    return (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"],
            cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["hidden_size"], cfg["num_hidden_layers"],
            int(cfg.get("first_k_dense_replace", 0) or 0), cfg["num_experts"], cfg["moe_intermediate_size"],
            (cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"], cfg["intermediate_size"])


def _ds_to_megatron(hf_sd, cfg, grouped_experts):
    nh, dn, dr, dv, ql, kl, H, L, kd, E, f, fs, fd = _ds_dims(cfg)
    if ql is None:
        raise InputError("DeepSeek-V3 without q_lora_rank is not mapped", field="q_lora_rank")
    # megatron's MLA always de-interleaves the rope channels (DeepSeek's convention, = HF rope_interleave=True);
    # for rope_interleave=False the rows are pre-permuted so that its de-interleave restores HF's order
    perm = torch.arange(dr) if cfg.get("rope_interleave", True) else torch.argsort(_rope_perm(dr))
    take = _Taker(hf_sd)
    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight", (cfg["vocab_size"], H))}
    for l in range(L):
        p, m = f"model.layers.{l}.", f"decoder.layers.{l}."
        a, ma = p + "self_attn.", m + "self_attention."
        out[m + "input_layernorm.weight"] = take(p + "input_layernorm.weight", (H,))
        out[ma + "linear_q_down_proj.weight"] = take(a + "q_a_proj.weight", (ql, H))
        out[ma + "q_layernorm.weight"] = take(a + "q_a_layernorm.weight", (ql,))
        qb = take(a + "q_b_proj.weight", (nh * (dn + dr), ql)).reshape(nh, dn + dr, ql)
        out[ma + "linear_q_up_proj.weight"] = torch.cat([qb[:, :dn], qb[:, dn:][:, perm]], 1).reshape(-1, ql)
        kva = take(a + "kv_a_proj_with_mqa.weight", (kl + dr, H))
        out[ma + "linear_kv_down_proj.weight"] = torch.cat([kva[:kl], kva[kl:][perm]])
        out[ma + "kv_layernorm.weight"] = take(a + "kv_a_layernorm.weight", (kl,))
        out[ma + "linear_kv_up_proj.weight"] = take(a + "kv_b_proj.weight", (nh * (dn + dv), kl))
        out[ma + "linear_proj.weight"] = take(a + "o_proj.weight", (H, nh * dv))
        out[m + "pre_mlp_layernorm.weight"] = take(p + "post_attention_layernorm.weight", (H,))
        if l < kd:  # dense layer
            out[m + "mlp.linear_fc1.weight"] = torch.cat([take(p + "mlp.gate_proj.weight", (fd, H)),
                                                          take(p + "mlp.up_proj.weight", (fd, H))])
            out[m + "mlp.linear_fc2.weight"] = take(p + "mlp.down_proj.weight", (H, fd))
            continue
        out[m + "mlp.router.weight"] = take(p + "mlp.gate.weight", (E, H))
        out[m + "mlp.router.expert_bias"] = take(p + "mlp.gate.e_score_correction_bias", (E,))
        fc1, fc2 = _experts_in(take, p, E, f, H, p + "mlp.experts.gate_up_proj")
        if grouped_experts:
            out[m + "mlp.experts.weight1"] = torch.stack([w.t() for w in fc1]).contiguous().reshape(H, E * 2 * f)
            out[m + "mlp.experts.weight2"] = torch.stack([w.t() for w in fc2]).contiguous().reshape(E * f, H)
        else:
            for e in range(E):
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
        if fs:
            out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [take(p + "mlp.shared_experts.gate_proj.weight", (fs, H)),
                 take(p + "mlp.shared_experts.up_proj.weight", (fs, H))])
            out[m + "mlp.shared_experts.linear_fc2.weight"] = take(p + "mlp.shared_experts.down_proj.weight", (H, fs))
    out["decoder.final_layernorm.weight"] = take("model.norm.weight", (H,))
    out["output_layer.weight"] = take("lm_head.weight", (cfg["vocab_size"], H))
    take.check_all_used()
    return out


def _ds_to_hf(sd, cfg, fused):
    nh, dn, dr, dv, ql, kl, H, L, kd, E, f, fs, fd = _ds_dims(cfg)
    inv = torch.arange(dr) if cfg.get("rope_interleave", True) else _rope_perm(dr)
    out = {"model.embed_tokens.weight": _take(sd, "embedding.word_embeddings.weight")}
    for l in range(L):
        p, m = f"model.layers.{l}.", f"decoder.layers.{l}."
        a, ma = p + "self_attn.", m + "self_attention."
        out[p + "input_layernorm.weight"] = _take(sd, m + "input_layernorm.weight")
        out[a + "q_a_proj.weight"] = _take(sd, ma + "linear_q_down_proj.weight")
        out[a + "q_a_layernorm.weight"] = _take(sd, ma + "q_layernorm.weight")
        qb = _take(sd, ma + "linear_q_up_proj.weight", (nh * (dn + dr), ql)).reshape(nh, dn + dr, ql)
        out[a + "q_b_proj.weight"] = torch.cat([qb[:, :dn], qb[:, dn:][:, inv]], 1).reshape(-1, ql)
        kva = _take(sd, ma + "linear_kv_down_proj.weight", (kl + dr, H))
        out[a + "kv_a_proj_with_mqa.weight"] = torch.cat([kva[:kl], kva[kl:][inv]])
        out[a + "kv_a_layernorm.weight"] = _take(sd, ma + "kv_layernorm.weight")
        out[a + "kv_b_proj.weight"] = _take(sd, ma + "linear_kv_up_proj.weight")
        out[a + "o_proj.weight"] = _take(sd, ma + "linear_proj.weight")
        out[p + "post_attention_layernorm.weight"] = _take(sd, m + "pre_mlp_layernorm.weight")
        if l < kd:
            g, u = _take(sd, m + "mlp.linear_fc1.weight", (2 * fd, H)).split([fd, fd])
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = g, u
            out[p + "mlp.down_proj.weight"] = _take(sd, m + "mlp.linear_fc2.weight")
            continue
        out[p + "mlp.gate.weight"] = _take(sd, m + "mlp.router.weight")
        out[p + "mlp.gate.e_score_correction_bias"] = _take(sd, m + "mlp.router.expert_bias")
        if m + "mlp.experts.weight1" in sd:
            w1 = _take(sd, m + "mlp.experts.weight1", (H, E * 2 * f)).reshape(E, H, 2 * f)
            w2 = _take(sd, m + "mlp.experts.weight2", (E * f, H)).reshape(E, f, H)
            fc1, fc2 = [w1[e].t() for e in range(E)], [w2[e].t() for e in range(E)]
        else:
            fc1 = [_take(sd, f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight", (2 * f, H)) for e in range(E)]
            fc2 = [_take(sd, f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight", (H, f)) for e in range(E)]
        if fused:
            out[p + "mlp.experts.gate_up_proj"] = torch.stack(fc1)
            out[p + "mlp.experts.down_proj"] = torch.stack(fc2)
        else:
            for e in range(E):
                g, u = fc1[e].split([f, f])
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = g
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = u
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = fc2[e]
        if fs:
            g, u = _take(sd, m + "mlp.shared_experts.linear_fc1.weight", (2 * fs, H)).split([fs, fs])
            out[p + "mlp.shared_experts.gate_proj.weight"], out[p + "mlp.shared_experts.up_proj.weight"] = g, u
            out[p + "mlp.shared_experts.down_proj.weight"] = _take(sd, m + "mlp.shared_experts.linear_fc2.weight")
    out["model.norm.weight"] = _take(sd, "decoder.final_layernorm.weight")
    out["lm_head.weight"] = _take(sd, "output_layer.weight")
    return out


# ---- sharding -------------------------------------------------------------------------------
_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def tp_dim(name: str) -> int | None:
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
        return 0
    if name.endswith("self_attention.linear_proj.weight"):
        return 1
    return None


def shard_for_rank(full: dict, config, *, tp_rank: int = 0, tp: int = 1, ep_rank: int = 0, ep: int = 1) -> dict:
    """This rank's megatron-core state dict from the full one (see the module doc)."""
    cfg = hf_config_dict(config)
    E, f, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    El = E // ep
    out = {}
    for name, t in full.items():
        m = _EXPERT.match(name)
        if m:
            e = int(m.group(2))
            if ep_rank * El <= e < (ep_rank + 1) * El:
                out[f"{m.group(1)}{e - ep_rank * El}{m.group(3)}"] = t
            continue
        if name.endswith("mlp.experts.weight1"):
            out[name] = t.reshape(E, H, 2 * f)[ep_rank * El:(ep_rank + 1) * El].reshape(H, El * 2 * f)
            continue
        if name.endswith("mlp.experts.weight2"):
            out[name] = t.reshape(E, f, H)[ep_rank * El:(ep_rank + 1) * El].reshape(El * f, H)
            continue
        dim = tp_dim(name)
        out[name] = t if dim is None or tp == 1 else t.chunk(tp, dim=dim)[tp_rank]
    return {k: v.contiguous() for k, v in out.items()}


def unshard(parts, config) -> dict:
    """Full state dict from ``parts``: ``(ep_rank, tp_rank, state_dict)`` triples (:func:`shard_for_rank`
    outputs) covering every TP rank and every EP rank (not necessarily every pair)."""
    cfg = hf_config_dict(config)
    E, f, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    by_ep, by_tp = {}, {}
    for er, tr, sd in parts:
        by_ep.setdefault(int(er), sd)
        by_tp.setdefault(int(tr), sd)
    ep, tp = len(by_ep), len(by_tp)
    if sorted(by_ep) != list(range(ep)) or sorted(by_tp) != list(range(tp)):
        raise InputError(f"shards cover EP ranks {sorted(by_ep)} and TP ranks {sorted(by_tp)}", field="shards")
    El = E // ep
    out = {}
    for name, t in by_ep[0].items():
        m = _EXPERT.match(name)
        if m:
            for r in range(ep):
                out[f"{m.group(1)}{r * El + int(m.group(2))}{m.group(3)}"] = by_ep[r][name]
            continue
        if name.endswith("mlp.experts.weight1"):
            out[name] = torch.cat([by_ep[r][name].reshape(El, H, 2 * f) for r in range(ep)]).reshape(H, -1)
            continue
        if name.endswith("mlp.experts.weight2"):
            out[name] = torch.cat([by_ep[r][name].reshape(El, f, H) for r in range(ep)]).reshape(-1, H)
            continue
        dim = tp_dim(name)
        out[name] = t if dim is None or tp == 1 else torch.cat([by_tp[j][name] for j in range(tp)], dim=dim)
    return out


def gather_full(local: dict, config) -> dict:
    """Collective: every rank passes its shard; every rank gets the full megatron-core state dict (CPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = {k: v.detach().cpu() for k, v in local.items() if not k.endswith("_extra_state")}
    if ps.get_tensor_model_parallel_world_size() == 1 and ps.get_expert_model_parallel_world_size() == 1:
        return dict(local)
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (ps.get_expert_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                                        local))
    return unshard(everything, config)
