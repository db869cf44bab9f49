"""GLM-4.5 / GLM-4.7 (``Glm4MoeForCausalLM``), batch-invariant: family ``glm4_moe``.

Per layer (all ops from :mod:`.blocks`, fixed per-row reduction order)::

    x = rms_norm(h);  h = h + gqa_attention(x)
        q, k, v = x Wq + bq, x Wk + bk, x Wv + bv     (biases when ``attention_bias``; o_proj none)
        q, k = rms_norm per head                      (when ``use_qk_norm``)
        q, k = rope_neox on the first r = int(head_dim · partial_rotary_factor) dims of each
               head, the other head_dim - r dims unchanged      (HF's and vLLM's layout; r = D/2
               by default: both default ``partial_rotary_factor`` to 0.5)
    x = rms_norm(h);  layer < first_k_dense_replace:  h = h + down(silu(gate x) * up x)
                      else:  s = sigmoid(x Wg in fp32);  ids = group-limited top-k of
                             s + e_score_correction_bias (n_group groups, topk_group kept);
                             w = s[ids] / (sum + 1e-20) (norm_topk_prob) · routed_scaling_factor
                             h = h + sum_s w_s expert_{ids_s}(x) + shared(x)

The router is DeepSeek-V3's ``noaux_tc`` (:func:`~.blocks.sigmoid_group_topk`, the same function
the ``deepseek_v3`` family runs); the attention is the GQA one the Qwen and Llama families share
(:mod:`.gqa`). Routes are numbered over the MoE layers (vLLM's ``num_moe_layers``). MTP draft
layers (``num_nextn_predict_layers``, stored after the decoder) are skipped, as vLLM skips them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_numerics.hf_config import moe_dims

from .base import InvariantCausalLM
from .blocks import Rope, require, swiglu_mlp
from .gqa import AttnDims, GQADecoder


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
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
    eps: float
    tied: bool

    @classmethod
    def from_config(cls, c) -> "Dims":
        g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
        require(g("hidden_act", "silu") == "silu", "hidden_act", g("hidden_act"), "only silu")
        moe = moe_dims(c)
        experts = moe.num_experts
        require(experts > 0, "n_routed_experts", g("n_routed_experts"), "a routed expert count is needed")
        n_group = int(g("n_group", 1) or 1)
        require(experts % n_group == 0, "n_group", n_group, f"must divide n_routed_experts {experts}")
        require(experts // n_group >= 2, "n_group", n_group,
                "group scores sum the top-2 experts of a group: groups need >= 2 experts")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   inter=c.intermediate_size, experts=experts, top_k=moe.top_k,
                   moe_inter=moe.moe_intermediate, n_shared=moe.n_shared, n_group=n_group,
                   topk_group=int(g("topk_group", 1) or 1),
                   first_dense=int(g("first_k_dense_replace", 1) or 0),
                   norm_topk_prob=bool(g("norm_topk_prob", True)),
                   routed_scaling=float(g("routed_scaling_factor", 1.0) or 1.0),
                   eps=c.rms_norm_eps, tied=bool(g("tie_word_embeddings", False)))


def attention_dims(c) -> AttnDims:
    return AttnDims.from_config(c, qk_norm=bool(getattr(c, "use_qk_norm", False)),
                                qkv_bias=bool(getattr(c, "attention_bias", False)), o_bias=False)


def partial_rope(c, head_dim: int) -> Rope:
    """NeoX RoPE over the first ``int(head_dim · partial_rotary_factor)`` dims of a head (the
    factor from ``rope_parameters``, else the config's own field, else 0.5 as HF and vLLM)."""
    rp = dict(getattr(c, "rope_parameters", None) or {})
    factor = rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
    factor = 0.5 if factor is None else float(factor)
    dim = int(head_dim * factor)
    require(0 < dim <= head_dim and dim % 2 == 0, "partial_rotary_factor", factor,
            f"the rotated dims int({head_dim} * factor) must be even and in (0, head_dim]")
    return Rope.from_config(c, dim, "neox")


class InvariantGlm4Moe(GQADecoder, InvariantCausalLM):
    """Parameters under HF names; ``forward_tokens`` runs the flat token stream."""

    dims_type = Dims
    read_attention = staticmethod(attention_dims)

    def add_ffn_weights(self) -> None:
        d = self.dims
        for i in range(d.layers):
            p = f"model.layers.{i}.mlp."
            if i < d.first_dense:
                self.add_swiglu(p, d.inter)
                continue
            self.add(p + "gate.weight", d.experts, d.hidden)
            self.add(p + "gate.e_score_correction_bias", d.experts, dtype=torch.float32)
            for e in range(d.experts):
                self.add_swiglu(p + f"experts.{e}.", d.moe_inter)
            if d.n_shared:
                self.add_swiglu(p + "shared_experts.", d.moe_inter * d.n_shared)

    @classmethod
    def config_parts(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None) -> dict:
        """As every GQA family's, with GLM's partial RoPE."""
        parts = super().config_parts(cfg, dtype, kv_cache)
        return {**parts, "rope": partial_rope(cfg, parts["attn"].head_dim)}

    def ignored_weight(self, name: str) -> bool:
        parts = name.split(".")        # MTP draft layers: model.layers.<n >= num_hidden_layers>
        return super().ignored_weight(name) or (
            len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isascii()
            and parts[2].isdigit() and int(parts[2]) >= self.dims.layers)

    def route_info(self) -> dict:
        d = self.dims
        return {"layers": d.layers - d.first_dense, "k": d.top_k, "num_experts": d.experts}

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.mlp."
        if i < d.first_dense:
            return swiglu_mlp(x, *self.swiglu_weights(p))
        out = self.sigmoid_routed(i - d.first_dense, x, p, d)
        if d.n_shared:
            out = out + swiglu_mlp(x, *self.swiglu_weights(p + "shared_experts."))
        return out
