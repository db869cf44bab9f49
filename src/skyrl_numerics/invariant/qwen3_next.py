"""Qwen3-Next (``Qwen3NextForCausalLM``), batch-invariant: family ``qwen3_next``.

Hybrid decoder: every layer in ``layer_types`` is either Gated DeltaNet linear attention
(``linear_attention``, a recurrent state per sequence) or gated full attention
(``full_attention``, the paged KV rows of :mod:`.gqa`); every MLP is Qwen3-MoE's softmax top-k
experts plus a shared expert behind a sigmoid gate (or a dense MLP in ``mlp_only_layers``).
HF transformers 5.19's ``modeling_qwen3_next.py`` math, ops from :mod:`.blocks`::

    norm(x, w)      = rms_norm(x) * (1 + w)            zero-centred: fp32, rounded once (layer
                                                       norms, final norm, q_norm, k_norm)
    full attention: [q | gate] = x Wq per head;  q, k = norm per head;  RoPE (NeoX) on the
                    first int(head_dim * partial_rotary_factor) dims;  rows [k | v]
                    o = (attention(q, rows) * sigmoid(gate)) Wo
    Gated DeltaNet: q, k, v, z, b, a = x W_qkvz, x W_ba  (grouped per key head, HF's order)
                    c = silu(causal_conv1d([q|k|v], K taps))  beta = sigmoid(b)
                    g = -exp(A_log) * softplus(a + dt_bias)            (fp32)
                    per token t, per value head (fp32, q/k heads repeated):
                        q, k = l2norm(q), l2norm(k);  q = q / sqrt(d_k)
                        S = S * exp(g_t);  S = S + k (beta_t (v_t - S k))^T;  o_t = S q
                    o = rms_norm(o) * w * silu(z)  (HF's gated norm: w applied in the model dtype)
                    out = o W_out
    MoE:            h = sum_s w_s expert_{ids_s}(x) + sigmoid(x W_sg) * shared(x)

Fixed order, so a token's bits do not depend on the batch nor on chunking: the conv sums its K
taps in order (fp32, rounded once); the recurrence runs token by token in fp32, each dot
product over ``d_k`` with :func:`~skyrl_numerics.kernels.fixed_order.dot8`'s fixed fold, every
other op elementwise (transcendentals through :func:`~skyrl_numerics.kernels.cpu.elementwise`),
so a prefill, a chunked prefill and a decode carrying the state between them give the same bits,
and several sequences scanned together give each its own bits. The state of a sequence is
``(conv [K-1, C] model dtype: the last K-1 conv inputs, S [H_v, d_v, d_k] fp32)``.

Who keeps the state: :attr:`InvariantQwen3Next.recurrent` (``None``: the trainer's rule —
each run of positions starting at 0 is one sequence starting from zero state; the vLLM engine
sets an object with ``mix(model, layer, qkv, beta, g, positions)`` that reads and writes vLLM's
Mamba state cache, :mod:`skyrl_numerics.engine.vllm_hybrid_state`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from skyrl_numerics.hf_config import moe_dims
from skyrl_numerics.kernels.fixed_order import dot8

from .base import Attend, InvariantCausalLM
from .blocks import (Rope, linear, linear_many, require, rms_norm, rms_norm_heads, sigmoid, silu,
                     swiglu_mlp)
from .gqa import AttnDims, GQAttention
from .recurrent import FreshSequences, causal_conv, pointwise

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    layer_types: tuple
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    inter: int
    moe_layers: tuple
    norm_topk_prob: bool
    eps: float
    tied: bool = False       # tie_word_embeddings: the lm-head is the embedding matrix (Qwen3.5)

    @classmethod
    def from_config(cls, c) -> "Dims":
        g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
        types = hybrid_layer_types(c)
        moe = moe_dims(c)
        require(moe.num_experts > 0, "num_experts", moe.num_experts, "a routed expert count is needed")
        layers = tuple(moe.moe_layers())
        inter = g("intermediate_size")
        require(len(layers) == c.num_hidden_layers or bool(inter), "intermediate_size", inter,
                "dense layers (mlp_only_layers) need their MLP width")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   layer_types=types, experts=moe.num_experts, top_k=moe.top_k,
                   moe_inter=moe.moe_intermediate,
                   shared_inter=int(g("shared_expert_intermediate_size") or 0),
                   inter=int(inter or 0), moe_layers=layers,
                   norm_topk_prob=bool(g("norm_topk_prob", True)), eps=c.rms_norm_eps)


def hybrid_layer_types(c, tied_ok: bool = False) -> tuple:
    """``layer_types`` of a Qwen3-Next-style config, after the checks every such config passes
    (silu, no attention biases; an untied lm-head unless ``tied_ok``)."""
    g = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    require(g("hidden_act", "silu") == "silu", "hidden_act", g("hidden_act"), "only silu")
    require(tied_ok or not g("tie_word_embeddings", False), "tie_word_embeddings", True,
            "Qwen3-Next checkpoints have an untied lm-head")
    require(not g("attention_bias", False), "attention_bias", True,
            "Qwen3-Next checkpoints have no attention biases")
    types = tuple(g("layer_types") or ())
    require(len(types) == c.num_hidden_layers and set(types) <= {LINEAR, FULL}, "layer_types",
            list(types), "one of 'linear_attention' / 'full_attention' per layer")
    return types


@dataclass(frozen=True)
class GDNDims:
    """Gated DeltaNet sizes: ``k_heads`` / ``v_heads`` heads of ``k_dim`` / ``v_dim``, a causal
    conv of ``kernel`` taps over ``conv_dim = 2 k_heads k_dim + v_heads v_dim`` channels."""
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int

    @classmethod
    def from_config(cls, c) -> "GDNDims":
        d = cls(int(c.linear_num_key_heads), int(c.linear_num_value_heads),
                int(c.linear_key_head_dim), int(c.linear_value_head_dim),
                int(c.linear_conv_kernel_dim))
        require(d.v_heads % d.k_heads == 0, "linear_num_value_heads", d.v_heads,
                f"must be a multiple of linear_num_key_heads {d.k_heads}")
        require(d.kernel >= 2, "linear_conv_kernel_dim", d.kernel, "at least 2 taps")
        return d

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def state_shapes(self) -> tuple:
        """``(conv [K-1, conv_dim], S [v_heads, v_dim, k_dim])`` of one sequence."""
        return (self.kernel - 1, self.conv_dim), (self.v_heads, self.v_dim, self.k_dim)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum x^2 + eps)`` over the last dim (fp32, :func:`dot8`'s order)."""
    ss = dot8(x, x) + eps
    return x * pointwise(torch.rsqrt, ss)[..., None]


def delta_scan(q, k, v, decay, beta, S):
    """The gated delta rule, token by token in fp32: ``q, k [B, n, H, dk]`` (normalized),
    ``v [B, n, H, dv]``, ``decay = exp(g)`` and ``beta`` ``[B, n, H]``, state ``S [B, H, dv, dk]``
    -> ``(o [B, n, H, dv], S)``; each dot product over ``dk`` in :func:`dot8`'s order."""
    outs = []
    for t in range(q.shape[1]):
        kt = k[:, t, :, None, :]
        S = S * decay[:, t, :, None, None]
        delta = (v[:, t] - dot8(S, kt)) * beta[:, t, :, None]
        S = S + delta[..., None] * kt
        outs.append(dot8(S, q[:, t, :, None, :]))
    return torch.stack(outs, dim=1), S


def partial_rope(c, head_dim: int) -> Rope:
    """NeoX RoPE over the first ``int(head_dim * partial_rotary_factor)`` dims (Qwen3-Next's
    default factor 0.25)."""
    rp = dict(getattr(c, "rope_parameters", None) or {})
    factor = rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
    factor = 0.25 if factor is None else float(factor)
    dim = int(head_dim * factor)
    require(0 < dim <= head_dim and dim % 2 == 0, "partial_rotary_factor", factor,
            f"the rotated dims int({head_dim} * factor) must be even and in (0, head_dim]")
    return Rope.from_config(c, dim, "neox")


class InvariantQwen3Next(GQAttention, InvariantCausalLM):
    """Parameters under HF names; ``forward_tokens`` runs the flat token stream."""

    def __init__(self, dims: Dims, attn: AttnDims, gdn: GDNDims, dtype: torch.dtype = torch.bfloat16,
                 kv_cache=None, rope=None):
        super().__init__(dtype)
        self.dims = d = dims
        self.gdn = gdn
        self.recurrent = None          # the engine's state keeper; None: the trainer's rule
        self._moe_index = {layer: j for j, layer in enumerate(d.moe_layers)}
        self.add_decoder_weights(tied=d.tied)
        self.attn_dims = a = attn
        self.rope, self.scale = rope, a.head_dim ** -0.5
        self.kv = a.kv_format(dtype, kv_cache)
        for i, kind in enumerate(d.layer_types):
            p = f"model.layers.{i}."
            if kind == FULL:
                q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
                for n, rows in (("q_proj", 2 * q), ("k_proj", kv), ("v_proj", kv)):
                    self.add(p + f"self_attn.{n}.weight", rows, a.hidden)
                self.add(p + "self_attn.o_proj.weight", a.hidden, q)
                self.add(p + "self_attn.q_norm.weight", a.head_dim)
                self.add(p + "self_attn.k_norm.weight", a.head_dim)
            else:
                g, la = gdn, p + "linear_attn."
                self.add_gdn_projections(la)
                self.add(la + "conv1d.weight", g.conv_dim, 1, g.kernel)
                self.add(la + "A_log", g.v_heads)
                self.add(la + "dt_bias", g.v_heads)
                self.add(la + "norm.weight", g.v_dim)
                self.add(la + "out_proj.weight", d.hidden, g.v_heads * g.v_dim)
            self._add_ffn(i)

    def add_gdn_projections(self, la: str) -> None:
        """The Gated DeltaNet input projections under ``la`` (Qwen3-Next: fused ``in_proj_qkvz``
        and ``in_proj_ba``, grouped per key head)."""
        g = self.gdn
        self.add(la + "in_proj_qkvz.weight", 2 * g.k_heads * g.k_dim + 2 * g.v_heads * g.v_dim,
                 self.dims.hidden)
        self.add(la + "in_proj_ba.weight", 2 * g.v_heads, self.dims.hidden)

    def _add_ffn(self, i: int) -> None:
        d, p = self.dims, f"model.layers.{i}.mlp."
        if i not in self._moe_index:
            return self.add_swiglu(p, d.inter)
        self.add(p + "gate.weight", d.experts, d.hidden)
        for e in range(d.experts):
            self.add_swiglu(p + f"experts.{e}.", d.moe_inter)
        if d.shared_inter:
            self.add_swiglu(p + "shared_expert.", d.shared_inter)
            self.add(p + "shared_expert_gate.weight", 1, d.hidden)

    @classmethod
    def config_parts(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None) -> dict:
        """Constructor arguments from an HF config; raises on what the family cannot reproduce
        (without allocating any weights)."""
        dims = cls.dims_of_config(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attn = AttnDims(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                        heads=cfg.num_attention_heads,
                        kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                        head_dim=head_dim, eps=cfg.rms_norm_eps, qk_norm=True, qkv_bias=False,
                        o_bias=False)
        attn.kv_format(dtype, kv_cache)
        return dict(dims=dims, attn=attn, gdn=GDNDims.from_config(cfg), dtype=dtype,
                    kv_cache=kv_cache, rope=partial_rope(cfg, head_dim))

    @staticmethod
    def dims_of_config(cfg) -> Dims:
        return Dims.from_config(cfg)

    @staticmethod
    def state_shapes_of_config(cfg) -> tuple:
        """:meth:`state_shapes` from an HF config (what vLLM sizes its state pages with)."""
        return GDNDims.from_config(cfg).state_shapes()

    def route_info(self) -> dict:
        return {"layers": len(self.dims.moe_layers), "k": self.dims.top_k,
                "num_experts": self.dims.experts}

    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.dims.layer_types) if t == LINEAR]

    # ---- forward ------------------------------------------------------------------------
    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Zero-centred RMSNorm: ``rms_norm(x) * (1 + w)`` in fp32, rounded once."""
        return rms_norm(x, 1.0 + self.w(name).float(), self.dims.eps)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attend: Attend) -> torch.Tensor:
        self._cos_sin = None
        h = self.embed(input_ids)
        for i in range(self.dims.layers):
            p = f"model.layers.{i}."
            h = h + self.attention(i, self.norm(h, p + "input_layernorm.weight"), positions, attend)
            h = h + self.ffn(i, self.norm(h, p + "post_attention_layernorm.weight"))
        return self.norm(h, "model.norm.weight")

    def attention(self, i: int, x: torch.Tensor, positions: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
        if self.dims.layer_types[i] == LINEAR:
            return self.gated_delta_net(i, x, positions)
        a, p = self.attn_dims, f"model.layers.{i}.self_attn."
        T, H, D = x.shape[0], a.heads, a.head_dim
        qg, k, v = linear_many(x, [self.proj(p + f"{n}.weight") for n in ("q_proj", "k_proj", "v_proj")])
        qg = qg.view(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        qk = rms_norm_heads([(q, 1.0 + self.w(p + "q_norm.weight").float()),
                             (k.view(T, a.kv_heads, D), 1.0 + self.w(p + "k_norm.weight").float())],
                            a.eps)
        qk = self.rope(qk, positions, self.rope_cos_sin(positions))
        q, k = qk[:, :H], qk[:, H:]
        rows = torch.cat([k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        o = attend(i, q, rows).reshape(T, H * D) * sigmoid(gate)
        return linear(o, self.proj(p + "o_proj.weight"))

    def gdn_projections(self, i: int, x: torch.Tensor) -> tuple:
        """Linear layer ``i``'s inputs ``(qkv [T, conv_dim], z [T, Hv dv], b, a [T, Hv])``, each
        in vLLM's flat order (``qkv`` = all q heads, all k heads, all v heads; value head ``h``
        = key head ``h // r``, ``r = Hv / Hk``): Qwen3-Next's fused projections are grouped per
        key head (HF's ``fix_query_key_value_ordering``) and regrouped here."""
        g, p, T = self.gdn, f"model.layers.{i}.linear_attn.", x.shape[0]
        r = g.v_heads // g.k_heads
        qkvz, ba = linear_many(x, [self.proj(p + "in_proj_qkvz.weight"), self.proj(p + "in_proj_ba.weight")])
        qkvz = qkvz.view(T, g.k_heads, 2 * g.k_dim + 2 * r * g.v_dim)
        q, k, v, z = torch.split(qkvz, [g.k_dim, g.k_dim, r * g.v_dim, r * g.v_dim], dim=-1)
        b, a = torch.split(ba.view(T, g.k_heads, 2 * r), [r, r], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, -1), b.reshape(T, g.v_heads), a.reshape(T, g.v_heads)

    def gated_delta_net(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        g, p, T = self.gdn, f"model.layers.{i}.linear_attn.", x.shape[0]
        qkv, z, b, a = self.gdn_projections(i, x)
        beta = sigmoid(b)
        softplus = pointwise(torch.nn.functional.softplus, a.float() + self.w(p + "dt_bias").float())
        decay_log = -pointwise(torch.exp, self.w(p + "A_log").float()) * softplus
        keeper = self.recurrent if self.recurrent is not None else FreshSequences()
        o = keeper.mix(self, i, qkv, beta, decay_log, positions)         # [T, Hv, dv] model dtype
        y = rms_norm(o, torch.ones(g.v_dim), self.dims.eps) * self.w(p + "norm.weight")
        y = (y.float() * silu(z.reshape(T, g.v_heads, g.v_dim).float())).to(x.dtype)
        return linear(y.reshape(T, -1), self.proj(p + "out_proj.weight"))

    def scan(self, i: int, qkv: torch.Tensor, beta: torch.Tensor, decay_log: torch.Tensor,
             conv0: torch.Tensor, S0: torch.Tensor):
        """The stateful part of linear layer ``i`` for ``B`` sequences of ``n`` new tokens each:
        ``qkv [B, n, conv_dim]`` (conv inputs), ``beta, decay_log [B, n, Hv]``, states ``conv0
        [B, K-1, conv_dim]``, ``S0 [B, Hv, dv, dk]`` -> ``(o [B, n, Hv, dv] model dtype, conv,
        S)``. Each sequence's bits are its own (every op per row, fixed order)."""
        g = self.gdn
        B, n = qkv.shape[:2]
        w = self.w(f"model.layers.{i}.linear_attn.conv1d.weight")[:, 0]
        c, conv = causal_conv(qkv, w, conv0)
        kd = g.k_heads * g.k_dim
        r = g.v_heads // g.k_heads
        q = c[..., :kd].reshape(B, n, g.k_heads, g.k_dim).float().repeat_interleave(r, dim=2)
        k = c[..., kd:2 * kd].reshape(B, n, g.k_heads, g.k_dim).float().repeat_interleave(r, dim=2)
        v = c[..., 2 * kd:].reshape(B, n, g.v_heads, g.v_dim).float()
        q = l2norm(q) / torch.full((), math.sqrt(g.k_dim), dtype=torch.float32)
        o, S = delta_scan(q, l2norm(k), v, pointwise(torch.exp, decay_log.float()),
                          beta.float(), S0.float())
        return o.to(qkv.dtype), conv, S

    def state_shapes(self) -> tuple:
        """One sequence's recurrent state shapes (what the engine allocates per request)."""
        return self.gdn.state_shapes()

    def zero_state(self, B: int):
        (ck, cc), (h, dv, dk) = self.gdn.state_shapes()
        return torch.zeros(B, ck, cc, dtype=self.dtype), torch.zeros(B, h, dv, dk)

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.mlp."
        j = self._moe_index.get(i)
        if j is None:
            return swiglu_mlp(x, *self.swiglu_weights(p))
        out = self.softmax_routed(j, x, p, d.experts, d.top_k, d.norm_topk_prob)
        if d.shared_inter:
            gate = sigmoid(linear(x, self.w(p + "shared_expert_gate.weight")))
            out = out + gate * swiglu_mlp(x, *self.swiglu_weights(p + "shared_expert."))
        return out
