"""Qwen3-MoE, batch-invariant: the forward the trainer and vLLM both run (family ``qwen3_moe``).

Per layer (all ops from :mod:`.blocks`, fixed per-row reduction order)::

    x = rms_norm(h);  q, k, v = x Wq, x Wk, x Wv;  q, k = rms_norm per head (q_norm, k_norm)
    q, k = rope_neox(q, k);  cache row r = [k | v]  (through the KV format)
    o = attention(q, rows of the sequence) Wo;  h = h + o
    x = rms_norm(h);  w, ids = top-k(softmax(x Wg));  h = h + sum_s w_s expert_{ids_s}(x)

Weights use the HF checkpoint names, so the same ``model.safetensors`` loads into both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_numerics.hf_config import moe_dims
from skyrl_numerics.kernels import attention as inv_attention

from .base import Attend, InvariantCausalLM
from .blocks import (Rope, linear, linear_many, qk_norm_rope_rows, require, rms_norm_heads,
                     routed_experts, softmax_topk)
from .kv_format import KVFormat, parse_kv_spec


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_inter: int
    norm_topk_prob: bool
    eps: float
    rope_theta: float

    @classmethod
    def from_config(cls, c) -> "Dims":
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        moe = moe_dims(c)
        require(moe.num_experts > 0, "num_experts", None, "a routed expert count is needed")
        require(not getattr(c, "mlp_only_layers", None), "mlp_only_layers",
                getattr(c, "mlp_only_layers", None), "dense layers are not in this family")
        require(getattr(c, "decoder_sparse_step", 1) == 1, "decoder_sparse_step",
                getattr(c, "decoder_sparse_step", 1), "every layer must be MoE")
        require(not getattr(c, "attention_bias", False), "attention_bias",
                getattr(c, "attention_bias", False), "q/k/v biases are not implemented")
        require(getattr(c, "hidden_act", "silu") == "silu", "hidden_act",
                getattr(c, "hidden_act", None), "only silu experts")
        require(not getattr(c, "tie_word_embeddings", False), "tie_word_embeddings", True,
                "a tied lm-head is not implemented")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                   head_dim=c.head_dim, experts=moe.num_experts, top_k=moe.top_k,
                   moe_inter=moe.moe_intermediate, norm_topk_prob=c.norm_topk_prob,
                   eps=c.rms_norm_eps, rope_theta=float(theta))


def attend_one_sequence(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Queries ``q [n, H, D]`` at the last ``n`` positions of ``k_all/v_all [S, Hkv, D]``."""
    out = inv_attention(q.transpose(0, 1)[None], k_all.transpose(0, 1)[None],
                        v_all.transpose(0, 1)[None], causal=True, scale=scale)
    return out[0].transpose(0, 1)


class InvariantQwen3Moe(InvariantCausalLM):
    """Parameters under HF names; ``forward_tokens`` runs the flat token stream."""

    def __init__(self, dims: Dims, dtype: torch.dtype = torch.bfloat16, kv_cache=None, rope=None):
        super().__init__(dtype)
        self.dims = d = dims
        self.rope = rope or Rope(d.head_dim, 1.0 / (d.rope_theta ** (
            torch.arange(0, d.head_dim, 2, dtype=torch.float32) / d.head_dim)), 1.0, "neox")
        self.scale = d.head_dim ** -0.5
        self.kv = KVFormat("gqa", d.kv_heads * d.head_dim, 2 * d.kv_heads * d.head_dim, dtype,
                           parse_kv_spec(kv_cache), d.layers)
        self.add_decoder_weights()
        for i in range(d.layers):
            p = f"model.layers.{i}."
            self.add(p + "self_attn.q_proj.weight", d.heads * d.head_dim, d.hidden)
            self.add(p + "self_attn.k_proj.weight", d.kv_heads * d.head_dim, d.hidden)
            self.add(p + "self_attn.v_proj.weight", d.kv_heads * d.head_dim, d.hidden)
            self.add(p + "self_attn.o_proj.weight", d.hidden, d.heads * d.head_dim)
            self.add(p + "self_attn.q_norm.weight", d.head_dim)
            self.add(p + "self_attn.k_norm.weight", d.head_dim)
            self.add(p + "mlp.gate.weight", d.experts, d.hidden)
            for e in range(d.experts):
                self.add(p + f"mlp.experts.{e}.gate_proj.weight", d.moe_inter, d.hidden)
                self.add(p + f"mlp.experts.{e}.up_proj.weight", d.moe_inter, d.hidden)
                self.add(p + f"mlp.experts.{e}.down_proj.weight", d.hidden, d.moe_inter)

    @classmethod
    def config_parts(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None) -> dict:
        """Constructor arguments from an HF config; raises on what the family cannot reproduce
        (without allocating any weights)."""
        dims = Dims.from_config(cfg)
        KVFormat("gqa", dims.kv_heads * dims.head_dim, 2 * dims.kv_heads * dims.head_dim, dtype,
                 parse_kv_spec(kv_cache), dims.layers)
        return dict(dims=dims, dtype=dtype, kv_cache=kv_cache,
                    rope=Rope.from_config(cfg, dims.head_dim, "neox"))

    def route_info(self) -> dict:
        return {"layers": self.dims.layers, "k": self.dims.top_k, "num_experts": self.dims.experts}

    # ---- forward ------------------------------------------------------------------------
    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.mlp."
        w, ids = softmax_topk(linear(x, self.w(p + "gate.weight")), d.top_k, d.norm_topk_prob)
        self._route(i, ids)
        return routed_experts(x, ids, w, self.expert_weights(p + "experts.", d.experts).__getitem__,
                              num_experts=d.experts)

    def attn_core(self, layer, q, rows, kv_lens):
        """q ``[n, Sq, H, D]``, rows ``[n, L, 2·Hkv·D]`` -> ``[n, Sq, H, D]``."""
        d = self.dims
        n, L = rows.shape[:2]
        k = rows[..., :d.kv_heads * d.head_dim].reshape(n, L, d.kv_heads, d.head_dim)
        v = rows[..., d.kv_heads * d.head_dim:].reshape(n, L, d.kv_heads, d.head_dim)
        o = self.attention_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale,
                              kv_lens)
        return o.transpose(1, 2)

    def _paged_kv(self, pool):
        d = self.dims
        s = d.kv_heads * d.head_dim
        return (pool[:, :s].unflatten(1, (d.kv_heads, d.head_dim)),
                pool[:, s:2 * s].unflatten(1, (d.kv_heads, d.head_dim)))

    def attention(self, i: int, x: torch.Tensor, positions: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.self_attn."
        T = x.shape[0]
        q, k, v = linear_many(x, [self.proj(p + "q_proj.weight"), self.proj(p + "k_proj.weight"),
                                  self.proj(p + "v_proj.weight")])
        qh, kh = q.view(T, d.heads, d.head_dim), k.view(T, d.kv_heads, d.head_dim)
        qw, kw = self.w(p + "q_norm.weight"), self.w(p + "k_norm.weight")
        fused = qk_norm_rope_rows(qh, kh, v, qw, kw, d.eps, self.rope, self.rope_cos_sin(positions))
        if fused is not None:                 # (no-grad CPU: one kernel, the same bits)
            q, rows = fused
        else:
            # q and k normalized per head and rotated together (per element: the same bits)
            qk = rms_norm_heads([(qh, qw), (kh, kw)], d.eps)
            qk = self.rope(qk, positions, self.rope_cos_sin(positions))
            q, k = qk[:, :d.heads], qk[:, d.heads:]
            v = v.view(T, d.kv_heads, d.head_dim)
            rows = torch.cat([k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        o = attend(i, q, rows)
        return linear(o.reshape(T, d.heads * d.head_dim), self.proj(p + "o_proj.weight"))
