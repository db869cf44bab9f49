"""GPT-OSS, batch-invariant: the forward the trainer and vLLM both run (family ``gpt_oss``).

Per layer (all ops from :mod:`.blocks` / the CPU kernels, fixed per-row reduction order)::

    x = rms_norm(h);  h = h + attention(x)
        q, k, v = x Wq + bq, x Wk + bk, x Wv + bv      (bf16 projection, bias added in bf16)
        q, k = rope_neox(q, k)                          YaRN (``truncate`` as the config says)
        o = attention(q, k, v, scale D^-0.5, sink s_h per head, window W on sliding layers) Wo + bo
    x = rms_norm(h);  h = h + moe(x)
        z = x Wr + br;  ids = top-k(z);  w = softmax(float32(z[ids]))    (HF ``GptOssTopKRouter``)
        per slot:  gu = x We + be  (bf16; gate = gu[::2], up = gu[1::2]: HF's interleaved layout)
                   a  = bf16( (clamp(up, -L, L) + 1) · g · sigmoid(alpha · g) ),  g = min(gate, L)
                   y  = a Wd + bd  (bf16)
        moe(x) = Σ_s w_s · y_s   in slot order (weights in bf16, as :func:`.blocks.routed_experts`)

The attention sink joins each row's softmax denominator as a key with a zero value
(:mod:`skyrl_numerics.kernels.cpu_attention`); ``layer_types[i] == "sliding_attention"`` keeps
the last ``sliding_window`` keys of each query. The clamped SwiGLU is computed in float32 from
the bf16 projections and rounded once. Weights stay under the HF names and layouts
(``experts.gate_up_proj [E, H, 2I]``, ``experts.down_proj [E, I, H]``); the GEMMs read each
expert's ``[N, K]`` matrices, de-interleaved and transposed once per weight change (no-grad CPU;
a copy of the experts) or as views (autograd): the same products, so the same bits (tested).

Refused (``UnsupportedConfig`` naming the field): MXFP4 / other quantized checkpoints
(``quantization_config``: dequantize to bf16 first), a tied lm-head, layer types other than
``sliding_attention`` / ``full_attention`` or a ``sliding_window`` without ``layer_types``
(HF's saved configs always list them; vLLM would window every layer's cache without them: it
keeps whole sequences only when some layer is full), and a device other than CPU (the sink and window
are in the CPU attention kernel only).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import InvariantCausalLM
from .blocks import UnsupportedConfig, linear, require, sigmoid
from .gqa import AttnDims, GQADecoder

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    experts: int
    top_k: int
    inter: int
    eps: float
    alpha: float               # swiglu_alpha: the sigmoid's gain
    limit: float               # swiglu_limit: the clamp
    windows: tuple             # per layer: the sliding window, or None (full attention)

    @classmethod
    def from_config(cls, c) -> "Dims":
        require(getattr(c, "quantization_config", None) is None, "quantization_config",
                (getattr(c, "quantization_config", None) or {}).get("quant_method"),
                "quantized (MXFP4) experts are not implemented: serve a bf16 checkpoint")
        require(not getattr(c, "tie_word_embeddings", False), "tie_word_embeddings", True,
                "a tied lm-head is not implemented")
        n = c.num_hidden_layers
        types = list(getattr(c, "layer_types", None) or [])
        # (without layer_types vLLM would window every layer's cache, the full ones included)
        require(bool(types) or not getattr(c, "sliding_window", None), "layer_types", None,
                "a sliding_window needs the layer_types that say which layers it applies to")
        types = types or ["full_attention"] * n
        require(len(types) == n and set(types) <= set(LAYER_TYPES), "layer_types", types,
                f"one of {LAYER_TYPES} per layer")
        window = getattr(c, "sliding_window", None)
        require("sliding_attention" not in types or (window or 0) > 0, "sliding_window", window,
                "sliding_attention layers need a positive window")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=n,
                   experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                   inter=c.intermediate_size, eps=c.rms_norm_eps,
                   alpha=float(getattr(c, "swiglu_alpha", 1.702)),
                   limit=float(getattr(c, "swiglu_limit", 7.0)),
                   windows=tuple(int(window) if t == "sliding_attention" else None for t in types))


def attention_dims(c) -> AttnDims:
    biased = bool(getattr(c, "attention_bias", True))
    return AttnDims(hidden=c.hidden_size, layers=c.num_hidden_layers,
                    heads=c.num_attention_heads,
                    kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                    head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                    eps=c.rms_norm_eps, qk_norm=False, qkv_bias=biased, o_bias=biased)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``(clamp(up, -L, L) + 1) · g · sigmoid(alpha · g)`` with ``g = min(gate, L)``, float32
    per element, rounded once to ``gate.dtype`` (HF ``GptOssExperts._apply_gate``)."""
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    return ((u + 1) * (g * sigmoid(g * alpha))).to(gate.dtype)


class InvariantGptOss(GQADecoder, InvariantCausalLM):
    """Parameters under HF names; ``forward_tokens`` runs the flat token stream."""

    dims_type = Dims
    read_attention = staticmethod(attention_dims)

    def add_ffn_weights(self) -> None:
        d = self.dims
        self._mats: dict[int, tuple] = {}      # layer -> (weights' identity, per-expert [N, K])
        for i in range(d.layers):
            self.add(f"model.layers.{i}.self_attn.sinks", self.attn_dims.heads)
            p = f"model.layers.{i}.mlp."
            self.add(p + "router.weight", d.experts, d.hidden)
            self.add(p + "router.bias", d.experts)
            self.add(p + "experts.gate_up_proj", d.experts, d.hidden, 2 * d.inter)
            self.add(p + "experts.gate_up_proj_bias", d.experts, 2 * d.inter)
            self.add(p + "experts.down_proj", d.experts, d.inter, d.hidden)
            self.add(p + "experts.down_proj_bias", d.experts, d.hidden)

    def route_info(self) -> dict:
        return {"layers": self.dims.layers, "k": self.dims.top_k, "num_experts": self.dims.experts}

    # ---- attention: sinks and sliding windows ---------------------------------------------
    def _sink_window(self, layer: int, device: torch.device):
        if device.type != "cpu":
            raise UnsupportedConfig("GPT-OSS attention sinks / sliding windows run in the CPU "
                                    f"attention kernel only, not on {device.type}", field="device")
        return self.w(f"model.layers.{layer}.self_attn.sinks"), self.dims.windows[layer]

    def attn_core(self, layer, q, rows, kv_lens):
        """q ``[n, Sq, H, D]``, rows ``[n, L, 2·Hkv·D]`` -> ``[n, Sq, H, D]``."""
        from skyrl_numerics.kernels import cpu

        a = self.attn_dims
        n, L = rows.shape[:2]
        s = a.kv_heads * a.head_dim
        k = rows[..., :s].reshape(n, L, a.kv_heads, a.head_dim)
        v = rows[..., s:].reshape(n, L, a.kv_heads, a.head_dim)
        sinks, window = self._sink_window(layer, q.device)
        o = cpu.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True,
                          self.scale, 64, kv_lens, sinks, window)
        return o.transpose(1, 2)

    def attn_core_paged(self, layer, q, pool, slots, kv_lens):
        """:meth:`attn_core` reading the rows in the paged cache (the same bits)."""
        from skyrl_numerics.kernels.cpu_attention import paged_attention

        k_pool, v_pool = self._paged_kv(pool)
        sinks, window = self._sink_window(layer, q.device)
        lens = kv_lens if kv_lens is not None else torch.full((slots.shape[0],), slots.shape[1])
        return paged_attention(q.transpose(1, 2), k_pool, v_pool, slots, lens, self.scale,
                               sinks=sinks, window=window).transpose(1, 2)

    # ---- the MoE ---------------------------------------------------------------------------
    def expert_mats(self, layer: int) -> list:
        """``[(w_gate [I, H], w_up [I, H], w_down [H, I])]`` per expert: views of the HF tensors
        under autograd; on the no-grad path bf16 copies with unit stride along K (the GEMM's
        operand), made once per weight change (an in-place update bumps the versions)."""
        p = f"model.layers.{layer}.mlp.experts."
        gu, dn = self.w(p + "gate_up_proj"), self.w(p + "down_proj")
        if torch.is_grad_enabled() and (gu.requires_grad or dn.requires_grad):
            return [(gu[e, :, 0::2].t(), gu[e, :, 1::2].t(), dn[e].t()) for e in range(gu.shape[0])]
        key = (id(gu), gu._version, id(dn), dn._version)
        hit = self._mats.get(layer)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                g = gu[:, :, 0::2].transpose(1, 2).contiguous()
                u = gu[:, :, 1::2].transpose(1, 2).contiguous()
                w = dn.transpose(1, 2).contiguous()
            hit = self._mats[layer] = (key, [(g[e], u[e], w[e]) for e in range(gu.shape[0])])
        return hit[1]

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.mlp."
        z = linear(x, self.w(p + "router.weight")) + self.w(p + "router.bias")
        top, ids = torch.topk(z, d.top_k, dim=-1)
        w = torch.softmax(top.float(), dim=-1)
        self._route(i, ids)
        gu_b, dn_b = self.w(p + "experts.gate_up_proj_bias"), self.w(p + "experts.down_proj_bias")
        biases = (gu_b[:, 0::2], gu_b[:, 1::2], dn_b)
        mats = self.expert_mats(i)
        grad = torch.is_grad_enabled() and (x.requires_grad or mats[0][0].requires_grad)
        if x.device.type == "cpu" and x.dtype == torch.bfloat16 and not grad:
            return self.grouped_experts(x, ids, w, mats, biases)
        return self.looped_experts(x, ids, w, mats, biases)

    def _expert_rows(self, xe, mats, biases, e):
        """One expert's output rows (the bf16 ``y`` of the module doc)."""
        (wg, wu, wd), (bg, bu, bd) = mats[e], biases
        a = clamped_swiglu(linear(xe, wg) + bg[e], linear(xe, wu) + bu[e], self.dims.alpha,
                           self.dims.limit)
        return linear(a, wd) + bd[e]

    def looped_experts(self, x, ids, w, mats, biases) -> torch.Tensor:
        from skyrl_numerics.kernels.cpu_moe import weighted_slot_sum

        T, k = ids.shape
        out = torch.zeros(T, k, x.shape[-1], dtype=x.dtype)
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            out[tok, slot] = self._expert_rows(x[tok], mats, biases, e)
        return weighted_slot_sum(out, w, x.dtype)

    def grouped_experts(self, x, ids, w, mats, biases) -> torch.Tensor:
        """:meth:`looped_experts` with every projection one grouped bf16 GEMM call (the pairs sorted by
        expert, as :func:`.blocks._grouped_expert_rows`): each row is its expert's GEMM row, so
        the same bits (tested)."""
        from skyrl_numerics.kernels import cpu_gemm_bf16, cpu_moe

        T, k = ids.shape
        H, E = x.shape[-1], len(mats)
        if T == 0:
            return torch.zeros(0, H, dtype=x.dtype)
        off, src, rowmap = cpu_moe.sort_pairs(ids, E)
        groups = cpu_gemm_bf16.Groups.of(off)        # checked once for the three projections
        used = [None] * E
        for e in groups.used:
            used[e] = mats[e]
        es = torch.from_numpy(np.repeat(np.arange(E), np.diff(off)))     # each sorted row's expert
        (bg, bu, bd) = biases

        def proj(a, j, b):     # bf16(a W_j) + b[expert of the row]
            return cpu_gemm_bf16.grouped(a, [t and t[j] for t in used], groups, x.dtype) + b[es]
        a = cpu_moe.expert_operand(x, src)
        h = clamped_swiglu(proj(a, 0, bg), proj(a, 1, bu), self.dims.alpha, self.dims.limit)
        y = proj(h, 2, bd)
        return cpu_moe.combine(y.float(), rowmap, w, H, x.dtype)
