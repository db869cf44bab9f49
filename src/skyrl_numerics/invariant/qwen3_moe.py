"""Qwen3-MoE, batch-invariant: the forward the trainer and vLLM both run (family ``qwen3_moe``).

Per layer (all ops from :mod:`.blocks`, fixed per-row reduction order)::

    x = rms_norm(h);  h = h + gqa_attention(x)       (:mod:`.gqa`: q/k RMSNorm per head, RoPE)
    x = rms_norm(h);  MoE layer:   w, ids = top-k(softmax(x Wg));  h = h + sum_s w_s expert_{ids_s}(x)
                      dense layer: h = h + down(silu(gate x) * up x)

A layer is dense when it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``
(HF's rule, :meth:`skyrl_numerics.hf_config.MoEDims.is_moe_layer`); its MLP is
``intermediate_size`` wide. Routes are numbered over the MoE layers only (vLLM's convention).
Weights use the HF checkpoint names, so the same ``model.safetensors`` loads into both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_numerics.hf_config import moe_dims
from skyrl_numerics.kernels import attention as inv_attention

from .base import InvariantCausalLM
from .blocks import require, swiglu_mlp
from .gqa import AttnDims, GQADecoder


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    experts: int
    top_k: int
    moe_inter: int
    inter: int
    moe_layers: tuple          # indices of the routed layers; the others are dense MLPs
    norm_topk_prob: bool
    eps: float

    @classmethod
    def from_config(cls, c) -> "Dims":
        moe = moe_dims(c)
        require(moe.num_experts > 0, "num_experts", None, "a routed expert count is needed")
        require(getattr(c, "hidden_act", "silu") == "silu", "hidden_act",
                getattr(c, "hidden_act", None), "only silu experts")
        require(not getattr(c, "tie_word_embeddings", False), "tie_word_embeddings", True,
                "a tied lm-head is not implemented")
        layers = tuple(moe.moe_layers())
        inter = getattr(c, "intermediate_size", None)
        require(len(layers) == c.num_hidden_layers or bool(inter), "intermediate_size", inter,
                "dense layers (mlp_only_layers / decoder_sparse_step) need their MLP width")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   experts=moe.num_experts, top_k=moe.top_k, moe_inter=moe.moe_intermediate,
                   inter=int(inter or 0), moe_layers=layers, norm_topk_prob=c.norm_topk_prob,
                   eps=c.rms_norm_eps)


def attention_dims(c) -> AttnDims:
    require(not getattr(c, "attention_bias", False), "attention_bias",
            getattr(c, "attention_bias", False), "q/k/v biases are not in Qwen3-MoE checkpoints "
            "(vLLM's Qwen3-MoE has none either)")
    return AttnDims.from_config(c, qk_norm=True, qkv_bias=False, o_bias=False)


def attend_one_sequence(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Queries ``q [n, H, D]`` at the last ``n`` positions of ``k_all/v_all [S, Hkv, D]``."""
    out = inv_attention(q.transpose(0, 1)[None], k_all.transpose(0, 1)[None],
                        v_all.transpose(0, 1)[None], causal=True, scale=scale)
    return out[0].transpose(0, 1)


class InvariantQwen3Moe(GQADecoder, InvariantCausalLM):
    """Parameters under HF names; ``forward_tokens`` runs the flat token stream."""

    dims_type = Dims
    read_attention = staticmethod(attention_dims)

    def add_ffn_weights(self) -> None:
        d = self.dims
        self._moe_index = {layer: j for j, layer in enumerate(d.moe_layers)}
        for i in range(d.layers):
            p = f"model.layers.{i}.mlp."
            if i not in self._moe_index:
                self.add_swiglu(p, d.inter)
                continue
            self.add(p + "gate.weight", d.experts, d.hidden)
            for e in range(d.experts):
                self.add_swiglu(p + f"experts.{e}.", d.moe_inter)

    def route_info(self) -> dict:
        return {"layers": len(self.dims.moe_layers), "k": self.dims.top_k,
                "num_experts": self.dims.experts}

    # ---- forward ------------------------------------------------------------------------
    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.mlp."
        j = self._moe_index.get(i)
        if j is None:
            return swiglu_mlp(x, *self.swiglu_weights(p))
        return self.softmax_routed(j, x, p, d.experts, d.top_k, d.norm_topk_prob)
