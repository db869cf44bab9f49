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
    nh, ng, d, E, f, H, L = _dims(cfg)
    sd = {k: v for k, v in mc_sd.items() if not k.endswith("_extra_state")}
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


# ---- sharding -------------------------------------------------------------------------------
_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def _tp_dim(name: str) -> int | None:
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
        dim = _tp_dim(name)
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
        dim = _tp_dim(name)
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
