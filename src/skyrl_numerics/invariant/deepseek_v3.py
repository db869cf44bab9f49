"""DeepSeek-V3 (MLA + group-limited sigmoid MoE), batch-invariant: family ``deepseek_v3``.

Stock vLLM computes MLA in two formulations — prefill *expanded* (per-head K/V from the latent,
SDPA) and decode *absorbed* (W_UK folded into the query, attention over the latent cache) — so
the engine is not even consistent with itself between prefill and decode. Here one formulation,
the absorbed one, serves every position on both sides. Per layer, with latent rank R
(``kv_lora_rank``), rope dim Dr, heads H, ``W_kv_b`` viewed as ``[H, Dn + Dv, R]``::

    x = rms_norm(h)
    q = (rms_norm(x Wq_a) Wq_b  or  x Wq)  -> [T, H, Dn + Dr] = [q_nope | q_pe]
    [c | k_pe] = x Wkv_a;  c = rms_norm(c, kv_a_layernorm);  q_pe, k_pe = rope_gptj(., pos)
    cache row r = [c | k_pe]            (R + Dr per token: the latent cache, via the KV format)
    q_lat[h] = q_nope[h] W_UK[h]        (W_UK[h] = W_kv_b[h, :Dn]   [Dn, R])
    o_lat[h] = softmax(scale · [q_lat[h] | q_pe[h]] · r^T) r[:, :R]   (one KV head, MQA)
    o[h]     = o_lat[h] W_UV[h]^T       (W_UV[h] = W_kv_b[h, Dn:]   [Dv, R])
    h = h + concat_h(o[h]) Wo

``scale = (Dn + Dr)^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN.
FFN: layers ``< first_k_dense_replace`` are a dense SwiGLU MLP; the others route with
:func:`~.blocks.sigmoid_group_topk` on fp32 router logits (``noaux_tc``, ``e_score_correction_bias``,
``routed_scaling_factor`` folded into the weights) and add the shared experts::

    h = h + sum_s w_s expert_{ids_s}(x) + shared(x)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_numerics.hf_config import moe_dims
from skyrl_numerics.kernels import matmul as inv_matmul

from .base import Attend, InvariantCausalLM
from .blocks import (Rope, yarn_mscale, head_matmuls, linear, require, rms_norm, routed_experts,
                     softmax_topk, swiglu_mlp)
from .kv_format import KVFormat, parse_kv_spec


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v_dim: int
    inter: int
    experts: int
    top_k: int
    moe_inter: int
    n_shared: int
    n_group: int
    topk_group: int
    first_dense: int
    norm_topk_prob: bool
    routed_scaling: float
    scoring: str
    use_bias: bool
    eps: float

    @classmethod
    def from_config(cls, c) -> "Dims":
        g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
        require(g("hidden_act", "silu") == "silu", "hidden_act", g("hidden_act"), "only silu")
        require(not g("attention_bias", False), "attention_bias", g("attention_bias"),
                "MLA projections with biases are not implemented")
        require(g("index_topk") is None, "index_topk", g("index_topk"),
                "DeepSeek-V3.2 sparse attention (the indexer) is not implemented")
        require(g("rope_interleave", True), "rope_interleave", g("rope_interleave"),
                "vLLM rotates DeepSeek MLA GPT-J style (interleaved) whatever this flag says; "
                "a rotate-half checkpoint has no single reproducible meaning")
        require((g("moe_layer_freq", 1) or 1) == 1, "moe_layer_freq", g("moe_layer_freq"),
                "only every layer from first_k_dense_replace on is MoE")
        method = g("topk_method", "greedy")
        require(method in ("noaux_tc", "greedy", None), "topk_method", method,
                "supported: noaux_tc (group-limited with e_score_correction_bias) and greedy")
        scoring = g("scoring_func", "softmax")
        require(scoring in ("sigmoid", "softmax"), "scoring_func", scoring,
                "supported: sigmoid, softmax")
        require(not (method == "noaux_tc" and scoring != "sigmoid"), "scoring_func", scoring,
                "noaux_tc routing is defined on sigmoid scores")
        require(not g("tie_word_embeddings", False), "tie_word_embeddings", True,
                "a tied lm-head is not implemented")
        n_group = int(g("n_group", 1) or 1)
        require(method == "noaux_tc" or n_group == 1, "n_group", n_group,
                f"group-limited routing without noaux_tc ({method}) is not implemented")
        moe = moe_dims(c)
        experts = moe.num_experts
        require(experts > 0, "n_routed_experts", g("n_routed_experts"), "a routed expert count is needed")
        require(experts % n_group == 0, "n_group", n_group, f"must divide n_routed_experts {experts}")
        require(method != "noaux_tc" or experts // n_group >= 2, "n_group", n_group,
                "group scores sum the top-2 experts of a group: groups need >= 2 experts")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   heads=c.num_attention_heads, q_lora_rank=g("q_lora_rank"),
                   kv_lora_rank=c.kv_lora_rank, nope=c.qk_nope_head_dim, rope=c.qk_rope_head_dim,
                   v_dim=c.v_head_dim, inter=c.intermediate_size, experts=experts,
                   top_k=moe.top_k, moe_inter=moe.moe_intermediate, n_shared=moe.n_shared,
                   n_group=n_group if method == "noaux_tc" else 1,
                   topk_group=int(g("topk_group", 1) or 1) if method == "noaux_tc" else 1,
                   first_dense=moe.first_dense,
                   norm_topk_prob=bool(g("norm_topk_prob", False)),
                   routed_scaling=float(g("routed_scaling_factor", 1.0) or 1.0),
                   scoring=scoring, use_bias=method == "noaux_tc", eps=c.rms_norm_eps)


class InvariantDeepseekV3(InvariantCausalLM):
    """Parameters under HF names; ``forward_tokens`` runs the flat token stream."""

    def __init__(self, dims: Dims, rope: Rope, scale: float, dtype: torch.dtype = torch.bfloat16,
                 kv_cache=None):
        super().__init__(dtype)
        self.dims = d = dims
        self.rope = rope
        self.scale = scale
        self.kv = KVFormat("mla", d.kv_lora_rank, d.kv_lora_rank + d.rope, dtype,
                           parse_kv_spec(kv_cache), d.layers)
        self.add_decoder_weights()
        for i in range(d.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            if d.q_lora_rank:
                self.add(a + "q_a_proj.weight", d.q_lora_rank, d.hidden)
                self.add(a + "q_a_layernorm.weight", d.q_lora_rank)
                self.add(a + "q_b_proj.weight", d.heads * (d.nope + d.rope), d.q_lora_rank)
            else:
                self.add(a + "q_proj.weight", d.heads * (d.nope + d.rope), d.hidden)
            self.add(a + "kv_a_proj_with_mqa.weight", d.kv_lora_rank + d.rope, d.hidden)
            self.add(a + "kv_a_layernorm.weight", d.kv_lora_rank)
            self.add(a + "kv_b_proj.weight", d.heads * (d.nope + d.v_dim), d.kv_lora_rank)
            self.add(a + "o_proj.weight", d.hidden, d.heads * d.v_dim)
            m = p + "mlp."
            if i < d.first_dense:
                self.add_swiglu(m, d.inter)
                continue
            self.add(m + "gate.weight", d.experts, d.hidden)
            if d.use_bias:
                self.add(m + "gate.e_score_correction_bias", d.experts, dtype=torch.float32)
            for e in range(d.experts):
                self.add_swiglu(m + f"experts.{e}.", d.moe_inter)
            if d.n_shared:
                self.add_swiglu(m + "shared_experts.", d.moe_inter * d.n_shared)

    @classmethod
    def config_parts(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None) -> dict:
        """Constructor arguments from an HF config; raises on what the family cannot reproduce
        (without allocating any weights)."""
        d = Dims.from_config(cfg)
        KVFormat("mla", d.kv_lora_rank, d.kv_lora_rank + d.rope, dtype, parse_kv_spec(kv_cache),
                 d.layers)
        rope = Rope.from_config(cfg, d.rope, "gptj")
        scale = (d.nope + d.rope) ** -0.5
        rp = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        if rp.get("rope_type", rp.get("type", "default")) == "yarn":
            m = yarn_mscale(float(rp["factor"]), float(rp.get("mscale_all_dim", 0) or 0))
            scale = scale * m * m
        return dict(dims=d, rope=rope, scale=scale, dtype=dtype, kv_cache=kv_cache)

    def ignored_weight(self, name: str) -> bool:
        # MTP draft layers (num_nextn_predict_layers) sit after the decoder; vLLM skips them too.
        parts = name.split(".")
        return super().ignored_weight(name) or (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isascii()
                and parts[2].isdigit() and int(parts[2]) >= self.dims.layers)

    def route_info(self) -> dict:
        d = self.dims
        return {"layers": d.layers - d.first_dense, "k": d.top_k, "num_experts": d.experts}

    # ---- forward ------------------------------------------------------------------------
    def attn_core(self, layer, q, rows, kv_lens):
        """q ``[n, Sq, H, R + Dr]`` (absorbed), rows ``[n, L, R + Dr]`` -> ``o_lat [n, Sq, H, R]``.

        One KV head; the row serves as key and (its first R values) as value: each output
        column of the attention is its own dot product, so taking ``[..., :R]`` of the
        attention over full rows is exactly the attention over the latent (on CPU the kernel
        is given ``v = rows[..., :R]``, the same columns without computing the rest)."""
        kv = rows[:, None]
        R = self.dims.kv_lora_rank
        if q.device.type == "cpu":      # the CPU kernel takes the latent values as they are
            return self.attention_op(q.transpose(1, 2), kv, kv[..., :R], self.scale,
                                     kv_lens).transpose(1, 2)
        o = self.attention_op(q.transpose(1, 2), kv, kv, self.scale, kv_lens)
        return o[..., :R].transpose(1, 2)

    def _paged_kv(self, pool):
        kv = pool.unsqueeze(1)                       # one KV head: the latent row
        return kv, kv[..., :self.dims.kv_lora_rank]

    def attention(self, i: int, x: torch.Tensor, positions: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.self_attn."
        T, R = x.shape[0], d.kv_lora_rank
        if d.q_lora_rank:
            qa = rms_norm(linear(x, self.proj(p + "q_a_proj.weight")), self.w(p + "q_a_layernorm.weight"),
                          d.eps)
            q = linear(qa, self.proj(p + "q_b_proj.weight"))
        else:
            q = linear(x, self.proj(p + "q_proj.weight"))
        q = q.view(T, d.heads, d.nope + d.rope)
        cs = self.rope_cos_sin(positions)
        q_nope, q_pe = q[..., :d.nope], self.rope(q[..., d.nope:], positions, cs)
        kv_a = linear(x, self.proj(p + "kv_a_proj_with_mqa.weight"))
        c = rms_norm(kv_a[:, :R], self.w(p + "kv_a_layernorm.weight"), d.eps)
        k_pe = self.rope(kv_a[:, None, R:], positions, cs)[:, 0]
        rows = torch.cat([c, k_pe], dim=-1)
        wkv = self.served_weight(p + "kv_b_proj.weight").view(d.heads, d.nope + d.v_dim, R)
        q_lat = head_matmuls(q_nope, [wkv[h, :d.nope] for h in range(d.heads)])   # [T, H, R]
        o_lat = attend(i, torch.cat([q_lat, q_pe], dim=-1), rows)                 # [T, H, R]
        o = head_matmuls(o_lat, [wkv[h, d.nope:].t() for h in range(d.heads)])   # [T, H, Dv]
        return linear(o.reshape(T, d.heads * d.v_dim), self.proj(p + "o_proj.weight"))

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.mlp."
        if i < d.first_dense:
            return swiglu_mlp(x, *self.swiglu_weights(p))
        if d.scoring == "sigmoid":     # (the bias only when d.use_bias: only then is it a weight)
            out = self.sigmoid_routed(i - d.first_dense, x, p, d)
        else:
            logits = inv_matmul(x.float(), self.w(p + "gate.weight").float().t())   # fp32 router
            w, ids = softmax_topk(logits, d.top_k, d.norm_topk_prob)
            self._route(i - d.first_dense, ids)
            out = routed_experts(x, ids, w * d.routed_scaling,
                                 self.expert_weights(p + "experts.", d.experts).__getitem__,
                                 num_experts=d.experts)
        if d.n_shared:
            out = out + swiglu_mlp(x, *self.swiglu_weights(p + "shared_experts."))
        return out
