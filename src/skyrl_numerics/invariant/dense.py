"""Dense decoders, batch-invariant: Qwen3, Llama, Qwen2 and Mistral (family ``dense``).

Per layer (all ops from :mod:`.blocks`, fixed per-row reduction order)::

    x = rms_norm(h);  h = h + gqa_attention(x)        (:mod:`.gqa`)
    x = rms_norm(h);  h = h + down(silu(gate x) * up x)

What differs between the architectures is in the attention only (:class:`Variant`):

=====================  ===========  =====================  ===================================
architecture           q/k RMSNorm  biases                 refused
=====================  ===========  =====================  ===================================
Qwen3ForCausalLM       yes          ``attention_bias``     sliding-window layers
LlamaForCausalLM       no           ``attention_bias``     ``mlp_bias``
                                    (q/k/v and o)
Qwen2ForCausalLM       no           q/k/v always           sliding-window layers
MistralForCausalLM     no           none                   ``sliding_window`` shorter than
                                                           ``max_position_embeddings``
=====================  ===========  =====================  ===================================

``tie_word_embeddings`` (Qwen3-0.6B..4B, Qwen2.5 up to 3B, Llama-3.2): the lm-head is the
embedding parameter itself (:meth:`~.base.InvariantCausalLM.add_decoder_weights`).

Mistral's sliding window: the invariant attention is full causal attention, which equals the
windowed one as long as no sequence is longer than the window; a window shorter than the
context the checkpoint declares (``max_position_embeddings``) is refused naming
``sliding_window`` (Mistral-7B-v0.1: 4096 < 32768) rather than computing something else past it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_numerics.errors import InputError

from .base import InvariantCausalLM
from .blocks import require, swiglu_mlp
from .gqa import AttnDims, GQADecoder


@dataclass(frozen=True)
class Variant:
    """What an architecture's attention has: ``qk_norm``; ``bias`` — "config" (q/k/v and o_proj
    biases when ``attention_bias``), "qkv" (always on q/k/v, none on o_proj) or "none"."""
    qk_norm: bool
    bias: str


VARIANTS = {"Qwen3ForCausalLM": Variant(qk_norm=True, bias="config"),
            "LlamaForCausalLM": Variant(qk_norm=False, bias="config"),
            "Qwen2ForCausalLM": Variant(qk_norm=False, bias="qkv"),
            "MistralForCausalLM": Variant(qk_norm=False, bias="none")}


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    inter: int
    eps: float
    tied: bool               # tie_word_embeddings: the lm-head is the embedding matrix

    @classmethod
    def from_config(cls, c) -> "Dims":
        require(getattr(c, "hidden_act", "silu") == "silu", "hidden_act",
                getattr(c, "hidden_act", None), "only a SwiGLU (silu) MLP")
        require(not getattr(c, "mlp_bias", False), "mlp_bias", True,
                "MLP biases are not implemented")
        require(not getattr(c, "num_experts", None), "num_experts", getattr(c, "num_experts", None),
                "a dense family has no routed experts")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   inter=c.intermediate_size, eps=c.rms_norm_eps,
                   tied=bool(getattr(c, "tie_word_embeddings", False)))


def variant_of(c) -> Variant:
    archs = list(getattr(c, "architectures", None) or [])
    arch = getattr(c, "skyrl_base_arch", None) or (archs[0] if len(archs) == 1 else None)
    require(arch in VARIANTS, "architectures", archs,
            f"the dense family covers {sorted(VARIANTS)}")
    return VARIANTS[arch]


def attention_dims(c) -> AttnDims:
    v = variant_of(c)
    window = getattr(c, "sliding_window", None)
    ctx = getattr(c, "max_position_embeddings", None)
    if v.bias == "none" and window is not None:     # Mistral: the window applies to every layer
        require(ctx is not None and window >= ctx, "sliding_window", window,
                f"a window shorter than the context (max_position_embeddings={ctx}) is not "
                "implemented (the invariant attention is full causal attention)")
    biased = bool(getattr(c, "attention_bias", False))
    return AttnDims.from_config(c, qk_norm=v.qk_norm,
                                qkv_bias=v.bias == "qkv" or (v.bias == "config" and biased),
                                o_bias=v.bias == "config" and biased)


class InvariantDense(GQADecoder, InvariantCausalLM):
    """Parameters under HF names; ``forward_tokens`` runs the flat token stream."""

    dims_type = Dims
    read_attention = staticmethod(attention_dims)

    def add_ffn_weights(self) -> None:
        d = self.dims
        for i in range(d.layers):
            self.add_swiglu(f"model.layers.{i}.mlp.", d.inter)

    def route_info(self) -> dict:
        """A dense model has no routers: no routes to capture."""
        raise InputError(f"{type(self).__name__}: a dense model has no routed experts (no "
                         "routes to capture or replay)", field="capture_routes")

    def moe_layer_ids(self) -> None:
        return None

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, *self.swiglu_weights(f"model.layers.{i}.mlp."))
