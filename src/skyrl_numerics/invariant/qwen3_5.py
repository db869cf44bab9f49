"""Qwen3.5 text models, batch-invariant: families ``qwen3_5`` (``Qwen3_5ForCausalLM``, a dense
SwiGLU MLP in every layer) and ``qwen3_5_moe`` (``Qwen3_5MoeForCausalLM``, every MLP routed).

Qwen3.5 is Qwen3-Next's decoder (:mod:`.qwen3_next`: the same gated full attention, Gated DeltaNet
conv + delta rule + gated norm, zero-centred RMSNorms, MoE block) with three differences, read
from transformers 5.19's ``modular_qwen3_5.py`` / ``modular_qwen3_5_moe.py`` and vLLM 0.32's
``model_executor/models/qwen3_5.py``:

- **GDN input projections stored separately and flat**: ``in_proj_qkv`` (rows: all q heads, all
  k heads, all v heads — already the conv's channel order), ``in_proj_z`` (value heads in order),
  ``in_proj_b`` and ``in_proj_a`` (one row per value head) instead of Qwen3-Next's fused
  ``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head. vLLM fuses them back on load
  (``in_proj_qkv`` -> shards 0-2 of ``in_proj_qkvz``, ``in_proj_z`` -> shard 3); here each is
  its own linear (:meth:`InvariantQwen3_5.gdn_projections`), the rest of the layer is Qwen3-Next's.
- **MLP**: the dense model has one SwiGLU of ``intermediate_size`` per layer (no ``num_experts``,
  ``mlp_only_layers``); the MoE model routes every layer (HF drops ``mlp_only_layers`` and
  ``decoder_sparse_step``), always renormalizes the top-k softmax weights (``norm_topk_prob`` is
  not a field: HF's router divides by their sum) and always has the sigmoid-gated shared expert.
- **RoPE**: Qwen3-VL's interleaved M-RoPE (``rope_parameters.mrope_section``) over the first
  ``int(head_dim * partial_rotary_factor)`` dims. A text token's temporal, height and width
  positions are all its position, so every frequency sees that one position: plain NeoX RoPE
  (as Qwen3-Next's; a checkpoint's ``mrope_section`` is accepted for text).

``tie_word_embeddings`` (the small Qwen3.5 models): the lm-head is the embedding parameter itself
(:meth:`~.base.InvariantCausalLM.add_decoder_weights`), which Qwen3-Next's family refuses.
Anything else is Qwen3-Next's and refused by the same fields (``hidden_act``,
``attention_bias``, ``layer_types``). The hub's multimodal ``Qwen3_5(Moe)ForConditionalGeneration``
checkpoints run text only through these families (:mod:`.multimodal`).
"""
from __future__ import annotations

import torch

from skyrl_numerics.errors import InputError

from .blocks import linear_many, require
from .qwen3_next import Dims, InvariantQwen3Next, hybrid_layer_types


# M-RoPE fields of a Qwen3.5 rope_parameters (text positions: plain RoPE, module docstring)
MROPE_KEYS = {"mrope_section", "mrope_interleaved"}


def qwen3_5_dims(c, moe: bool) -> Dims:
    """:class:`~.qwen3_next.Dims` of a Qwen3.5 text config: every layer dense (``moe=False``)
    or every layer routed with a shared expert (``moe=True``)."""
    g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    types = hybrid_layer_types(c, tied_ok=True)
    n = int(c.num_hidden_layers)
    common = dict(vocab=c.vocab_size, hidden=c.hidden_size, layers=n, layer_types=types,
                  norm_topk_prob=True, eps=c.rms_norm_eps,
                  tied=bool(g("tie_word_embeddings", False)))
    if not moe:
        inter = int(g("intermediate_size") or 0)
        require(inter > 0, "intermediate_size", g("intermediate_size"), "the dense MLP width")
        return Dims(experts=0, top_k=0, moe_inter=0, shared_inter=0, inter=inter, moe_layers=(),
                    **common)
    experts, top_k = int(g("num_experts") or 0), int(g("num_experts_per_tok") or 0)
    require(experts > 0, "num_experts", g("num_experts"), "a routed expert count is needed")
    require(0 < top_k <= experts, "num_experts_per_tok", g("num_experts_per_tok"),
            f"in 1..num_experts ({experts})")
    moe_inter = int(g("moe_intermediate_size") or 0)
    require(moe_inter > 0, "moe_intermediate_size", g("moe_intermediate_size"), "the expert width")
    shared = int(g("shared_expert_intermediate_size") or 0)
    require(shared > 0, "shared_expert_intermediate_size", g("shared_expert_intermediate_size"),
            "Qwen3.5-MoE always has a shared expert")
    return Dims(experts=experts, top_k=top_k, moe_inter=moe_inter, shared_inter=shared, inter=0,
                moe_layers=tuple(range(n)), **common)


class InvariantQwen3_5(InvariantQwen3Next):
    """``Qwen3_5ForCausalLM``: Qwen3-Next with flat GDN projections and dense MLPs."""
    moe = False

    @classmethod
    def dims_of_config(cls, cfg) -> Dims:
        return qwen3_5_dims(cfg, cls.moe)

    @staticmethod
    def engine_config_overrides(hf_config: dict) -> dict:
        """A text checkpoint's M-RoPE fields dropped for vLLM: with ``mrope_section`` vLLM would
        hand the model 3-row M-RoPE positions (and ask it for ``get_mrope_input_positions``);
        for text they are the token positions, which is what the family's RoPE takes."""
        rp = hf_config.get("rope_parameters")
        if not isinstance(rp, dict) or not MROPE_KEYS & set(rp):
            return {}
        return {"rope_parameters": {k: v for k, v in rp.items() if k not in MROPE_KEYS}}

    def add_gdn_projections(self, la: str) -> None:
        g, h = self.gdn, self.dims.hidden
        self.add(la + "in_proj_qkv.weight", g.conv_dim, h)
        self.add(la + "in_proj_z.weight", g.v_heads * g.v_dim, h)
        self.add(la + "in_proj_b.weight", g.v_heads, h)
        self.add(la + "in_proj_a.weight", g.v_heads, h)

    def gdn_projections(self, i: int, x: torch.Tensor) -> tuple:
        """``(qkv, z, b, a)``: the four stored projections, already in the flat order."""
        p = f"model.layers.{i}.linear_attn."
        return tuple(linear_many(x, [self.proj(p + f"in_proj_{n}.weight")
                                     for n in ("qkv", "z", "b", "a")]))

    def route_info(self) -> dict:
        if not self.dims.moe_layers:
            raise InputError(f"{type(self).__name__}: a dense model has no routed experts (no "
                             "routes to capture or replay)", field="capture_routes")
        return super().route_info()

    def moe_layer_ids(self) -> list[int] | None:
        return list(self.dims.moe_layers) or None


class InvariantQwen3_5Moe(InvariantQwen3_5):
    """``Qwen3_5MoeForCausalLM``: every MLP Qwen3-Next's routed experts + gated shared expert."""
    moe = True
