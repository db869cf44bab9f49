"""Mixtral, batch-invariant: family ``mixtral``.

Per layer (all ops from :mod:`.blocks`, fixed per-row reduction order)::

    x = rms_norm(h);  h = h + gqa_attention(x)      (:mod:`.gqa`: no q/k norm, no biases, RoPE
                                                     rotate-half over the whole head)
    x = rms_norm(h);  p = softmax(x Wg) in fp32 over all experts;  w, ids = top-k(p);
                      w = w / sum(w)                 (always renormalized: HF's MixtralTopKRouter,
                                                     vLLM's FusedMoE ``renormalize=True``)
                      h = h + sum_s w_s expert_{ids_s}(x),  expert(x) = w2(silu(w1 x) * w3 x)

Every layer is an MoE; the router's logits are the bf16 ``x Wg`` (HF and vLLM both compute the
gate in the model dtype before the fp32 softmax). Weights keep the checkpoint's names:
``block_sparse_moe.gate`` and ``block_sparse_moe.experts.<e>.w1`` (gate), ``w3`` (up), ``w2``
(down). Mixtral's ``sliding_window`` (null in Mixtral-8x7B/8x22B) is refused when shorter than
``max_position_embeddings`` (the invariant attention is full causal attention, as for Mistral).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_numerics.hf_config import moe_dims

from .base import InvariantCausalLM
from .blocks import require
from .gqa import AttnDims, GQADecoder

EXPERT_NAMES = ("w1", "w3", "w2")      # gate, up, down


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    experts: int
    top_k: int
    moe_inter: int
    eps: float
    tied: bool

    @classmethod
    def from_config(cls, c) -> "Dims":
        moe = moe_dims(c)
        require(moe.num_experts > 0, "num_local_experts", None, "a routed expert count is needed")
        require(getattr(c, "hidden_act", "silu") == "silu", "hidden_act",
                getattr(c, "hidden_act", None), "only silu experts")
        jitter = getattr(c, "router_jitter_noise", 0.0) or 0.0
        require(jitter == 0.0, "router_jitter_noise", jitter,
                "random router noise (training only in HF) has no reproducible value")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   experts=moe.num_experts, top_k=moe.top_k, moe_inter=c.intermediate_size,
                   eps=c.rms_norm_eps, tied=bool(getattr(c, "tie_word_embeddings", False)))


def attention_dims(c) -> AttnDims:
    window, ctx = getattr(c, "sliding_window", None), getattr(c, "max_position_embeddings", None)
    require(window is None or (ctx is not None and window >= ctx), "sliding_window", window,
            f"a window shorter than the context (max_position_embeddings={ctx}) is not "
            "implemented (the invariant attention is full causal attention)")
    return AttnDims.from_config(c, qk_norm=False, qkv_bias=False, o_bias=False)


class InvariantMixtral(GQADecoder, InvariantCausalLM):
    """Parameters under HF names; ``forward_tokens`` runs the flat token stream."""

    dims_type = Dims
    read_attention = staticmethod(attention_dims)

    def add_ffn_weights(self) -> None:
        d = self.dims
        for i in range(d.layers):
            p = f"model.layers.{i}.block_sparse_moe."
            self.add(p + "gate.weight", d.experts, d.hidden)
            for e in range(d.experts):
                self.add_swiglu(p + f"experts.{e}.", d.moe_inter, EXPERT_NAMES)

    def route_info(self) -> dict:
        return {"layers": self.dims.layers, "k": self.dims.top_k, "num_experts": self.dims.experts}

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.block_sparse_moe."
        return self.softmax_routed(i, x, p, d.experts, d.top_k, True, EXPERT_NAMES)
