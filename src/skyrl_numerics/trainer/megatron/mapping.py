"""HF Qwen3-MoE / DeepSeek-V3 / Mixtral / dense (Qwen3, Llama, Qwen2, Mistral) <-> megatron-core GPTModel
weight mapping (full tensors), and TP/EP sharding.

megatron-bridge does this for real models but needs CUDA Transformer Engine and transformers < 5 (a GPU
extra); this module is the small CPU mapping the issue allows, for the layout of
:func:`~.model.build_gpt_model`. Every conversion is a pure re-layout (views, cat, split, transpose,
reshape, row permutation): no arithmetic, so ``hf -> megatron -> hf`` is bitwise the identity (tested).

One table per family (:data:`FAMILIES`: a list of rules per layer) is read by both directions: each rule
maps a group of HF tensors to a group of megatron-core tensors and back. Per layer ``l`` of Qwen3-MoE
(``ng`` KV groups, ``nh`` heads, ``d`` head dim, ``E`` experts, ``f`` expert FFN width):

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

DeepSeek-V3 (MLA) swaps the attention rows for ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj``
/ ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj`` (``q_a_proj`` … ``kv_b_proj``, rope rows
permuted for ``rope_interleave=False``), adds ``mlp.router.expert_bias`` (``e_score_correction_bias``) and
``mlp.shared_experts.linear_fc1/2``, and has dense ``mlp.linear_fc1/2`` layers before
``first_k_dense_replace``; its experts use the same two layouts (:class:`_Experts`, one unstack / stack).

Mixtral is Qwen3-MoE's table without the q/k norms, its router and experts under its checkpoint names
``block_sparse_moe.gate`` and ``block_sparse_moe.experts.<e>.w1`` (gate) / ``w3`` (up) / ``w2`` (down)
(transformers>=5 memory: ``mlp.gate``, ``mlp.experts.gate_up_proj`` / ``down_proj``). The dense decoders
replace the router and experts with one SwiGLU ``mlp.linear_fc1/2`` (``mlp.{gate,up,down}_proj``); Qwen2's
q/k/v biases become ``linear_qkv.bias`` in the same per-group row order as the weight; Qwen3 keeps the q/k norms.

Sharding (:func:`shard_for_rank`): vocabulary rows of the embedding and lm-head, and ``linear_qkv`` rows
(whole KV groups), split in ``tp`` contiguous blocks; ``linear_proj`` columns likewise; experts by EP rank
(global expert ``ep_rank * E/ep + i`` is local ``i``); norms and router replicated.
:func:`gather_full` is the inverse (collective over the TP and EP groups).
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from skyrl_numerics.errors import InputError

from .model import hf_config_dict

__all__ = ["hf_to_megatron", "megatron_to_hf", "shard_for_rank", "gather_full", "unshard", "FAMILIES"]


class _Taker:
    """``take(name, shape)``: a tensor of ``sd`` (InputError if missing or mis-shaped); remembers what it took."""

    def __init__(self, sd):
        self.sd, self.used = dict(sd), set()

    def __contains__(self, k):
        return k in self.sd

    def __call__(self, k, shape=None):
        self.used.add(k)
        if k not in self.sd:
            raise InputError(f"missing weight {k!r}", field=k)
        t = self.sd[k]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise InputError(f"{k}: shape {tuple(t.shape)}, expected {tuple(shape)}", field=k)
        return t

    def check_all_used(self):
        extra = sorted(k for k in self.sd if k not in self.used and not k.endswith("rotary_emb.inv_freq"))
        if extra:
            raise InputError(f"{len(extra)} HF weights have no megatron-core counterpart, e.g. {extra[0]!r}",
                             field=extra[0])


# ---- rules: one group of HF tensors <-> one group of megatron-core tensors, both directions ---------------
class _Same:
    """One tensor, the same layout on both sides (``fused_hf``: its transformers>=5 in-memory name, where
    that differs from the checkpoint's ``hf``)."""

    def __init__(self, mc: str, hf: str, shape: tuple, fused_hf: str | None = None):
        self.mc, self.hf, self.shape, self.fused_hf = mc, hf, shape, fused_hf or hf

    def to_mc(self, take, m, p, grouped):
        hf = self.hf if p + self.hf in take or p + self.fused_hf not in take else self.fused_hf
        return {m + self.mc: take(p + hf, self.shape)}

    def to_hf(self, take, m, p, fused):
        return {p + (self.fused_hf if fused else self.hf): take(m + self.mc, self.shape)}


class _Interleave:
    """megatron rows per group ``g`` = ``[hf_0 rows of g; hf_1 rows of g; ...]`` (``groups`` = 1: a plain
    ``cat``, e.g. SwiGLU ``linear_fc1 = [gate; up]``; ``linear_qkv``: ``[q; k; v]`` per KV group).
    ``cols=None``: 1-D tensors (biases), the same row order."""

    def __init__(self, mc: str, hfs: tuple, rows: tuple, cols: int | None, groups: int = 1):
        self.mc, self.hfs, self.rows, self.cols, self.groups = mc, hfs, rows, cols, groups

    def _shape(self, rows: int) -> tuple:
        return (rows,) if self.cols is None else (rows, self.cols)

    def to_mc(self, take, m, p, grouped):
        g, c = self.groups, self.cols or 1
        parts = [take(p + h, self._shape(g * r)).reshape(g, r, c) for h, r in zip(self.hfs, self.rows)]
        return {m + self.mc: torch.cat(parts, dim=1).reshape(self._shape(-1))}

    def to_hf(self, take, m, p, fused):
        g, c = self.groups, self.cols or 1
        t = take(m + self.mc, self._shape(g * sum(self.rows))).reshape(g, -1, c)
        return {p + h: x.reshape(self._shape(g * r))
                for h, r, x in zip(self.hfs, self.rows, t.split(self.rows, dim=1))}


def _rope_perm(r: int) -> torch.Tensor:
    """HF's interleaved rope channels (x0, y0, x1, y1, ...) -> de-interleaved (x0, x1, ..., y0, y1, ...)."""
    return torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])


class _RopeRows:
    """Per head ``[nope rows; rope rows]``, the rope rows permuted by ``perm`` into megatron (MLA)."""

    def __init__(self, mc: str, hf: str, heads: int, nope: int, rope: int, cols: int, perm: torch.Tensor):
        self.mc, self.hf, self.heads, self.nope, self.cols = mc, hf, heads, nope, cols
        self.shape, self.perm, self.inv = (heads * (nope + rope), cols), perm, torch.argsort(perm)

    def _permute(self, t, perm):
        t = t.reshape(self.heads, -1, self.cols)
        return torch.cat([t[:, :self.nope], t[:, self.nope:][:, perm]], 1).reshape(-1, self.cols)

    def to_mc(self, take, m, p, grouped):
        return {m + self.mc: self._permute(take(p + self.hf, self.shape), self.perm)}

    def to_hf(self, take, m, p, fused):
        return {p + self.hf: self._permute(take(m + self.mc, self.shape), self.inv)}


def grouped_shapes(E: int, f: int, H: int) -> tuple[tuple, tuple]:
    """``GroupedMLP`` ``weight1`` / ``weight2`` memory as 3-D: ``[E, H, 2f]`` (``fc1_e^T`` stacked) and
    ``[E, f, H]`` (``fc2_e^T`` stacked)."""
    return (E, H, 2 * f), (E, f, H)


class _Experts:
    """``E`` SwiGLU experts: HF per-expert ``experts.<e>.{gate,up,down}_proj.weight`` (``proj``: the
    checkpoint's names of gate, up, down — Mixtral's ``w1``, ``w3``, ``w2`` under ``hf`` =
    ``block_sparse_moe.experts.``) or fused ``experts.gate_up_proj [E, 2f, H]`` / ``experts.down_proj
    [E, H, f]`` under ``fused_hf``; megatron sequential ``experts.local_experts.<e>.linear_fc{1,2}.weight``
    or grouped ``experts.weight1`` / ``weight2``. Every form is read into (unstacked to) per-expert
    ``fc1_e = [gate_e; up_e]`` ``[2f, H]``, ``fc2_e`` ``[H, f]`` lists and written (stacked) from them."""

    def __init__(self, E: int, f: int, H: int, hf: str = "mlp.experts.", mc: str = "mlp.experts.",
                 proj: tuple = ("gate_proj", "up_proj", "down_proj"), fused_hf: str = "mlp.experts."):
        self.E, self.f, self.H, self.hf, self.mc = E, f, H, hf, mc
        self.proj, self.fused_hf = proj, fused_hf

    def _from_hf(self, take, p):
        E, f, H, x = self.E, self.f, self.H, p + self.hf
        xf = p + self.fused_hf
        if xf + "gate_up_proj" in take:
            gu, dn = take(xf + "gate_up_proj", (E, 2 * f, H)), take(xf + "down_proj", (E, H, f))
            return list(gu.unbind(0)), list(dn.unbind(0))
        g, u, d = self.proj
        fc1 = [torch.cat([take(f"{x}{e}.{g}.weight", (f, H)), take(f"{x}{e}.{u}.weight", (f, H))])
               for e in range(E)]
        return fc1, [take(f"{x}{e}.{d}.weight", (H, f)) for e in range(E)]

    def _from_mc(self, take, m):
        E, f, H, x = self.E, self.f, self.H, m + self.mc
        if x + "weight1" in take:
            s1, s2 = grouped_shapes(E, f, H)
            w1, w2 = take(x + "weight1", (H, E * 2 * f)).reshape(s1), take(x + "weight2", (E * f, H)).reshape(s2)
            return [w.t() for w in w1.unbind(0)], [w.t() for w in w2.unbind(0)]
        fc1 = [take(f"{x}local_experts.{e}.linear_fc1.weight", (2 * f, H)) for e in range(E)]
        return fc1, [take(f"{x}local_experts.{e}.linear_fc2.weight", (H, f)) for e in range(E)]

    def to_mc(self, take, m, p, grouped):
        fc1, fc2, x = *self._from_hf(take, p), m + self.mc
        if grouped:
            return {x + "weight1": torch.stack([w.t() for w in fc1]).contiguous().reshape(self.H, -1),
                    x + "weight2": torch.stack([w.t() for w in fc2]).contiguous().reshape(-1, self.H)}
        out = {}
        for e, (w1, w2) in enumerate(zip(fc1, fc2)):
            out[f"{x}local_experts.{e}.linear_fc1.weight"], out[f"{x}local_experts.{e}.linear_fc2.weight"] = w1, w2
        return out

    def to_hf(self, take, m, p, fused):
        fc1, fc2, x = *self._from_mc(take, m), p + self.hf
        if fused:
            xf = p + self.fused_hf
            return {xf + "gate_up_proj": torch.stack(fc1), xf + "down_proj": torch.stack(fc2)}
        out, (g, u, d) = {}, self.proj
        for e, (w1, w2) in enumerate(zip(fc1, fc2)):
            out[f"{x}{e}.{g}.weight"], out[f"{x}{e}.{u}.weight"] = w1.split([self.f, self.f])
            out[f"{x}{e}.{d}.weight"] = w2
        return out


# ---- the tables ------------------------------------------------------------------------------------
def _swiglu(mc: str, hf: str, f: int, H: int) -> list:
    """A dense SwiGLU MLP: ``<mc>linear_fc1 = [<hf>gate_proj; <hf>up_proj]``, ``<mc>linear_fc2 = <hf>down_proj``."""
    return [_Interleave(mc + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), (f, f), H),
            _Same(mc + "linear_fc2.weight", hf + "down_proj.weight", (H, f))]


def _gqa_attention(cfg: dict, *, qk_norm: bool, qkv_bias: bool) -> list:
    """Norms and GQA attention of one layer (``linear_qkv`` rows ``[q; k; v]`` per KV group)."""
    nh, ng, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    d = cfg.get("head_dim") or H // nh
    rows = (nh // ng * d, d, d)
    rules = [_Same("input_layernorm.weight", "input_layernorm.weight", (H,)),
             _Interleave("self_attention.linear_qkv.weight", tuple(f"self_attn.{x}_proj.weight" for x in "qkv"),
                         rows, H, groups=ng),
             _Same("self_attention.linear_proj.weight", "self_attn.o_proj.weight", (H, nh * d)),
             _Same("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", (H,))]
    if qkv_bias:
        rules.append(_Interleave("self_attention.linear_qkv.bias", tuple(f"self_attn.{x}_proj.bias" for x in "qkv"),
                                 rows, None, groups=ng))
    if qk_norm:
        rules += [_Same("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", (d,)),
                  _Same("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", (d,))]
    return rules


def _qwen3_moe_layer(cfg: dict, l: int) -> list:
    E, f, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    return _gqa_attention(cfg, qk_norm=True, qkv_bias=False) + [
        _Same("mlp.router.weight", "mlp.gate.weight", (E, H)), _Experts(E, f, H)]


def _mixtral_layer(cfg: dict, l: int) -> list:
    E, f, H = cfg["num_experts"], cfg["intermediate_size"], cfg["hidden_size"]
    return _gqa_attention(cfg, qk_norm=False, qkv_bias=False) + [
        _Same("mlp.router.weight", "block_sparse_moe.gate.weight", (E, H), fused_hf="mlp.gate.weight"),
        _Experts(E, f, H, hf="block_sparse_moe.experts.", proj=("w1", "w3", "w2"))]


def _dense_layer(cfg: dict, l: int) -> list:
    mt = cfg["model_type"]
    return (_gqa_attention(cfg, qk_norm=mt == "qwen3", qkv_bias=mt == "qwen2")
            + _swiglu("mlp.", "mlp.", cfg["intermediate_size"], cfg["hidden_size"]))


def _deepseek_v3_layer(cfg: dict, l: int) -> list:
    nh, dn, dr, dv = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    ql, kl, H = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["hidden_size"]
    if ql is None:
        raise InputError("DeepSeek-V3 without q_lora_rank is not mapped", field="q_lora_rank")
    # megatron's MLA always de-interleaves the rope channels (DeepSeek's convention, = HF rope_interleave=True);
    # for rope_interleave=False the rows are pre-permuted so that its de-interleave restores HF's order
    perm = torch.arange(dr) if cfg.get("rope_interleave", True) else torch.argsort(_rope_perm(dr))
    a = "self_attn."
    rules = [_Same("input_layernorm.weight", "input_layernorm.weight", (H,)),
             _Same("self_attention.linear_q_down_proj.weight", a + "q_a_proj.weight", (ql, H)),
             _Same("self_attention.q_layernorm.weight", a + "q_a_layernorm.weight", (ql,)),
             _RopeRows("self_attention.linear_q_up_proj.weight", a + "q_b_proj.weight", nh, dn, dr, ql, perm),
             _RopeRows("self_attention.linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight",
                       1, kl, dr, H, perm),
             _Same("self_attention.kv_layernorm.weight", a + "kv_a_layernorm.weight", (kl,)),
             _Same("self_attention.linear_kv_up_proj.weight", a + "kv_b_proj.weight", (nh * (dn + dv), kl)),
             _Same("self_attention.linear_proj.weight", a + "o_proj.weight", (H, nh * dv)),
             _Same("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", (H,))]
    if l < int(cfg.get("first_k_dense_replace", 0) or 0):  # dense layer
        return rules + _swiglu("mlp.", "mlp.", cfg["intermediate_size"], H)
    E, f = cfg["num_experts"], cfg["moe_intermediate_size"]
    fs = (cfg.get("n_shared_experts") or 0) * f
    rules += [_Same("mlp.router.weight", "mlp.gate.weight", (E, H)),
              _Same("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", (E,)),
              _Experts(E, f, H)]
    return rules + (_swiglu("mlp.shared_experts.", "mlp.shared_experts.", fs, H) if fs else [])


#: model_type -> the rules of layer ``l`` (``(cfg, l) -> [rule]``); both directions read them
FAMILIES = {"qwen3_moe": _qwen3_moe_layer, "deepseek_v3": _deepseek_v3_layer, "mixtral": _mixtral_layer,
            "qwen3": _dense_layer, "llama": _dense_layer, "qwen2": _dense_layer, "mistral": _dense_layer}


def _table(cfg: dict) -> list:
    """``[(megatron prefix, HF prefix, rules)]`` of the whole model, in state-dict order."""
    V, H, layer = cfg["vocab_size"], cfg["hidden_size"], FAMILIES.get(cfg.get("model_type"), _qwen3_moe_layer)
    out = [("", "", [_Same("embedding.word_embeddings.weight", "model.embed_tokens.weight", (V, H))])]
    out += [(f"decoder.layers.{l}.", f"model.layers.{l}.", layer(cfg, l)) for l in range(cfg["num_hidden_layers"])]
    return out + [("", "", [_Same("decoder.final_layernorm.weight", "model.norm.weight", (H,)),
                            _Same("output_layer.weight", "lm_head.weight", (V, H))])]


def hf_to_megatron(hf_sd: dict, config, *, grouped_experts: bool = False) -> dict:
    """Full megatron-core state dict (tp = ep = 1 names) from an HF state dict of a :data:`FAMILIES` model.

    ``hf_sd``: checkpoint names (``experts.<e>.gate_proj.weight`` …) or transformers>=5 in-memory fused
    experts (``experts.gate_up_proj`` / ``experts.down_proj``). Unknown, missing or mis-shaped weights raise
    InputError naming the tensor. ``grouped_experts``: the legacy ``GroupedMLP`` ``weight1`` / ``weight2``.
    """
    table, take, out = _table(hf_config_dict(config)), _Taker(hf_sd), {}
    for m, p, rules in table:
        for rule in rules:
            out.update(rule.to_mc(take, m, p, grouped_experts))
    take.check_all_used()
    return out


def megatron_to_hf(mc_sd: dict, config, *, fused: bool = False) -> dict:
    """HF state dict (checkpoint names; ``fused``: transformers>=5 in-memory experts) from a full
    megatron-core state dict (sequential or grouped experts), every tensor contiguous."""
    table, out = _table(hf_config_dict(config)), {}
    take = _Taker({k: v for k, v in mc_sd.items() if not k.endswith("_extra_state")})
    for m, p, rules in table:
        for rule in rules:
            out.update(rule.to_hf(take, m, p, fused))
    return {k: v.contiguous() for k, v in out.items()}


# ---- sharding -------------------------------------------------------------------------------
_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def _expert_width(cfg: dict) -> int:
    """An expert's FFN width (Mixtral's is its ``intermediate_size``; a dense model's: unused)."""
    return cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 1


def tp_dim(name: str) -> int | None:
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        return 0
    if name.endswith("self_attention.linear_proj.weight"):
        return 1
    return None


def shard_for_rank(full: dict, config, *, tp_rank: int = 0, tp: int = 1, ep_rank: int = 0, ep: int = 1) -> dict:
    """This rank's megatron-core state dict from the full one (see the module doc)."""
    cfg = hf_config_dict(config)
    E, H = cfg.get("num_experts") or 1, cfg["hidden_size"]
    s1, s2 = grouped_shapes(E, _expert_width(cfg), H)
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
            out[name] = t.reshape(s1)[ep_rank * El:(ep_rank + 1) * El].reshape(H, -1)
            continue
        if name.endswith("mlp.experts.weight2"):
            out[name] = t.reshape(s2)[ep_rank * El:(ep_rank + 1) * El].reshape(-1, H)
            continue
        dim = tp_dim(name)
        out[name] = t if dim is None or tp == 1 else t.chunk(tp, dim=dim)[tp_rank]
    return {k: v.contiguous() for k, v in out.items()}


def unshard(parts, config) -> dict:
    """Full state dict from ``parts``: ``(ep_rank, tp_rank, state_dict)`` triples (:func:`shard_for_rank`
    outputs) covering every TP rank and every EP rank (not necessarily every pair)."""
    cfg = hf_config_dict(config)
    E, H = cfg.get("num_experts") or 1, cfg["hidden_size"]
    by_ep, by_tp = {}, {}
    for er, tr, sd in parts:
        by_ep.setdefault(int(er), sd)
        by_tp.setdefault(int(tr), sd)
    ep, tp = len(by_ep), len(by_tp)
    if sorted(by_ep) != list(range(ep)) or sorted(by_tp) != list(range(tp)):
        raise InputError(f"shards cover EP ranks {sorted(by_ep)} and TP ranks {sorted(by_tp)}", field="shards")
    El = E // ep
    s1, s2 = grouped_shapes(El, _expert_width(cfg), H)
    out = {}
    for name, t in by_ep[0].items():
        m = _EXPERT.match(name)
        if m:
            for r in range(ep):
                out[f"{m.group(1)}{r * El + int(m.group(2))}{m.group(3)}"] = by_ep[r][name]
            continue
        if name.endswith("mlp.experts.weight1"):
            out[name] = torch.cat([by_ep[r][name].reshape(s1) for r in range(ep)]).reshape(H, -1)
            continue
        if name.endswith("mlp.experts.weight2"):
            out[name] = torch.cat([by_ep[r][name].reshape(s2) for r in range(ep)]).reshape(-1, H)
            continue
        dim = tp_dim(name)
        out[name] = t if dim is None or tp == 1 else torch.cat([by_tp[j][name] for j in range(tp)], dim=dim)
    return out


def gather_full(local: dict, config) -> dict:
    """Collective: every rank passes its shard; every rank gets the full megatron-core state dict (CPU)."""
    from megatron.core import parallel_state as ps  # megatron-core is imported lazily (package doc)

    local = {k: v.detach().cpu() for k, v in local.items() if not k.endswith("_extra_state")}
    if ps.get_tensor_model_parallel_world_size() == 1 and ps.get_expert_model_parallel_world_size() == 1:
        return dict(local)
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (ps.get_expert_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                                        local))
    return unshard(everything, config)
