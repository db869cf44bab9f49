"""Grouped-query attention with RoPE, batch-invariant: the attention the Qwen3-MoE family and the
dense decoders (Qwen3, Llama, Qwen2, Mistral) share. Per layer, for ``H`` query heads and ``Hkv``
key/value heads of ``D`` dims::

    q, k, v = x Wq (+ bq), x Wk (+ bk), x Wv (+ bv)     biases: Qwen2 (q/k/v), Llama attention_bias
    q, k = rms_norm per head (q_norm, k_norm)            Qwen3 / Qwen3-MoE only
    q, k = rope_neox(q, k);  cache row r = [k | v]       (through the KV format)
    o = attention(q, rows of the sequence, scale D^-0.5) Wo (+ bo)

A bias is added to the bf16 projection in bf16 (one rounding of ``round(x W) + b``, per
element), on both sides. The family mixes :class:`GQAttention` into its
:class:`~.base.InvariantCausalLM` and sets ``self.attn_dims`` (:class:`AttnDims`) and
``self.kv`` / ``self.rope`` / ``self.scale`` with :meth:`GQAttention.init_attention`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from .base import Attend
from .blocks import (Rope, linear, linear_many, qk_norm_rope_rows, qkv_norm_rope_rows, require,
                     rms_norm_heads)
from .kv_format import KVFormat, parse_kv_spec


@dataclass(frozen=True)
class AttnDims:
    """What the attention needs of a config: ``qk_norm`` (per-head q/k RMSNorm), ``qkv_bias``
    (biases on q/k/v), ``o_bias`` (a bias on o_proj)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool

    @classmethod
    def from_config(cls, c, *, qk_norm: bool, qkv_bias: bool, o_bias: bool) -> "AttnDims":
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        require(getattr(c, "use_sliding_window", False) is not True, "use_sliding_window", True,
                "the invariant attention is full causal attention (no sliding window)")
        types = set(getattr(c, "layer_types", None) or ["full_attention"])
        require(types == {"full_attention"}, "layer_types", sorted(types),
                "only full-attention layers are implemented")
        return cls(hidden=c.hidden_size, layers=c.num_hidden_layers,
                   heads=c.num_attention_heads,
                   kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                   head_dim=head_dim, eps=c.rms_norm_eps, qk_norm=qk_norm, qkv_bias=qkv_bias,
                   o_bias=o_bias)

    def kv_format(self, dtype: torch.dtype, kv_cache) -> KVFormat:
        """The cache row ``[k | v]`` (``2·Hkv·D`` values per token)."""
        w = self.kv_heads * self.head_dim
        return KVFormat("gqa", w, 2 * w, dtype, parse_kv_spec(kv_cache), self.layers)


class GQAttention:
    """The attention half of a GQA family (a mixin over :class:`~.base.InvariantCausalLM`)."""

    attn_dims: AttnDims

    @staticmethod
    def gqa_parts(cfg, dims, attn: AttnDims, dtype: torch.dtype, kv_cache) -> dict:
        """A GQA family's constructor arguments: ``dims`` and ``attn`` as the family reads them,
        the KV format checked against ``dtype``, NeoX-style RoPE from the config."""
        attn.kv_format(dtype, kv_cache)
        return dict(dims=dims, attn=attn, dtype=dtype, kv_cache=kv_cache,
                    rope=Rope.from_config(cfg, attn.head_dim, "neox"))

    def init_attention(self, a: AttnDims, dtype: torch.dtype, kv_cache, rope: Rope | None,
                       rope_theta: float = 10000.0) -> None:
        """Sets ``attn_dims``, ``rope``, ``scale``, ``kv`` and adds every layer's attention
        weights under their HF names."""
        self.attn_dims = a
        self.rope = rope or Rope(a.head_dim, 1.0 / (rope_theta ** (
            torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim)), 1.0, "neox")
        self.scale = a.head_dim ** -0.5
        self.kv = a.kv_format(dtype, kv_cache)
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        for i in range(a.layers):
            p = f"model.layers.{i}.self_attn."
            for n, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                self.add(p + f"{n}.weight", rows, a.hidden)
                if a.qkv_bias:
                    self.add(p + f"{n}.bias", rows)
            self.add(p + "o_proj.weight", a.hidden, q)
            if a.o_bias:
                self.add(p + "o_proj.bias", a.hidden)
            if a.qk_norm:
                self.add(p + "q_norm.weight", a.head_dim)
                self.add(p + "k_norm.weight", a.head_dim)

    def attn_core(self, layer, q, rows, kv_lens):
        """q ``[n, Sq, H, D]``, rows ``[n, L, 2·Hkv·D]`` -> ``[n, Sq, H, D]``."""
        a = self.attn_dims
        n, L = rows.shape[:2]
        k = rows[..., :a.kv_heads * a.head_dim].reshape(n, L, a.kv_heads, a.head_dim)
        v = rows[..., a.kv_heads * a.head_dim:].reshape(n, L, a.kv_heads, a.head_dim)
        o = self.attention_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale,
                              kv_lens)
        return o.transpose(1, 2)

    def _paged_kv(self, pool):
        a = self.attn_dims
        s = a.kv_heads * a.head_dim
        return (pool[:, :s].unflatten(1, (a.kv_heads, a.head_dim)),
                pool[:, s:2 * s].unflatten(1, (a.kv_heads, a.head_dim)))

    def attention(self, i: int, x: torch.Tensor, positions: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
        a, p = self.attn_dims, f"model.layers.{i}.self_attn."
        q, rows = self.queries_and_rows(i, x, positions)
        o = linear(attend(i, q, rows).reshape(x.shape[0], a.heads * a.head_dim),
                   self.proj(p + "o_proj.weight"))
        return o + self.w(p + "o_proj.bias") if a.o_bias else o

    def queries_and_rows(self, i: int, x: torch.Tensor, positions: torch.Tensor):
        """Layer ``i``'s queries ``[T, H, D]`` and cache rows ``[k | v]`` ``[T, 2·Hkv·D]`` of
        ``x`` (module doc: projections, biases, q/k norms, RoPE)."""
        a, p = self.attn_dims, f"model.layers.{i}.self_attn."
        T = x.shape[0]
        ws = [self.proj(p + "q_proj.weight"), self.proj(p + "k_proj.weight"),
              self.proj(p + "v_proj.weight")]
        qw = kw = biases = None
        if a.qk_norm:
            qw, kw = self.w(p + "q_norm.weight"), self.w(p + "k_norm.weight")
        if a.qkv_bias:
            biases = [self.w(p + f"{n}.bias") for n in ("q_proj", "k_proj", "v_proj")]
        # (no-grad CPU, a small step: one C call, the same bits)
        fused = qkv_norm_rope_rows(x, ws, qw, kw, a.eps, self.rope, self.rope_cos_sin(positions),
                                   a.head_dim, biases)
        if fused is not None:
            return fused
        q, k, v = linear_many(x, ws)
        if a.qkv_bias:
            q, k, v = (t + b for t, b in zip((q, k, v), biases))
        qh, kh = q.view(T, a.heads, a.head_dim), k.view(T, a.kv_heads, a.head_dim)
        fused = None
        if a.qk_norm:
            fused = qk_norm_rope_rows(qh, kh, v, qw, kw, a.eps, self.rope,
                                      self.rope_cos_sin(positions))
        if fused is not None:                 # (no-grad CPU: one kernel, the same bits)
            return fused
        # q and k (normalized per head) rotated together (per element: the same bits)
        qk = (rms_norm_heads([(qh, qw), (kh, kw)], a.eps) if a.qk_norm
              else torch.cat([qh, kh], dim=1))
        qk = self.rope(qk, positions, self.rope_cos_sin(positions))
        q, k = qk[:, :a.heads], qk[:, a.heads:]
        return q, torch.cat([k.reshape(T, -1), v.reshape(T, -1)], dim=-1)


class GQADecoder(GQAttention):
    """The skeleton of a family whose every layer is GQA attention + an MLP / MoE (dense,
    Qwen3-MoE, Mixtral, GLM-4-MoE, GPT-OSS; mixed before :class:`~.base.InvariantCausalLM`): the
    family sets ``dims_type`` (its ``Dims``, read by ``from_config``) and ``read_attention``
    (config -> :class:`AttnDims`), and adds its MLP / expert weights in :meth:`add_ffn_weights`;
    the decoder and attention weights are added here, in that order. (Hybrid families, whose
    layers differ, mix in :class:`GQAttention` alone.)"""

    dims_type: ClassVar[type]
    read_attention: ClassVar[Callable]

    def __init__(self, dims, attn: AttnDims, dtype: torch.dtype = torch.bfloat16, kv_cache=None,
                 rope: Rope | None = None):
        super().__init__(dtype)
        self.dims = dims
        self.add_decoder_weights(tied=getattr(dims, "tied", False))
        self.init_attention(attn, dtype, kv_cache, rope)
        self.add_ffn_weights()

    def add_ffn_weights(self) -> None:
        raise NotImplementedError

    @classmethod
    def config_parts(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None) -> dict:
        """Constructor arguments from an HF config; raises on what the family cannot reproduce
        (without allocating any weights)."""
        return cls.gqa_parts(cfg, cls.dims_type.from_config(cfg), cls.read_attention(cfg), dtype,
                             kv_cache)
