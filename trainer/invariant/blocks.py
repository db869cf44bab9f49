"""Shared blocks of the batch-invariant forward: every family module is assembled from these.

Each block computes a token's result from that token's own inputs (and, for attention, the
cached rows of its own sequence) with a reduction order fixed per row, so the bits of a token do
not depend on which other tokens share the call, nor on prefill vs decode:

- :func:`linear`: ``x @ w.T`` through :func:`skyrl_numerics.kernels.matmul` (fp32 accumulation,
  per-row order independent of the number of rows; bf16 rounded once at the end);
- :func:`rms_norm`: per-row fp32 (:func:`skyrl_numerics.kernels.rms_norm`);
- :class:`Rope`: elementwise, ``cos/sin`` of the token's own position, in fp32. Two layouts:

      neox  (rotate-half, Qwen/Llama):  x' = x * cos + [-x[d/2:], x[:d/2]] * sin
      gptj  (interleaved, DeepSeek):    (x'[2i], x'[2i+1]) = (x[2i] c_i - x[2i+1] s_i,
                                                              x[2i+1] c_i + x[2i] s_i)

  with ``c_i = cos(p * f_i) * m``, ``s_i = sin(p * f_i) * m``; default RoPE has
  ``f_i = theta^(-2i/d)`` and ``m = 1``. DeepSeek YaRN (``rope_type="yarn"``) blends the
  extrapolated ``f_i`` with the interpolated ``f_i / factor`` by a linear ramp over the dims
  between the correction bounds ``floor/ceil(d * ln(L0 / (2 pi beta)) / (2 ln theta))`` for
  ``beta = beta_fast, beta_slow``: ``f_i = f_i/factor * (1 - mask_i) + f_i * mask_i``,
  ``mask_i = 1 - clamp((i - low) / (high - low), 0, 1)``, and scales cos/sin by
  ``m = mscale(factor, mscale) / mscale(factor, mscale_all_dim) * attention_factor``
  where ``mscale(s, a) = 0.1 a ln s + 1`` (1 for s <= 1);
- routers: :func:`softmax_topk` (Qwen/Mixtral) and :func:`sigmoid_group_topk` (DeepSeek
  ``noaux_tc``), both per token with ``torch.topk`` over one row;
- :func:`routed_experts`: each expert runs its tokens through invariant matmuls; a token's k
  expert outputs are summed in top-k slot order (never by an index_add over tokens);
- :func:`swiglu_mlp`: ``down(silu(gate x) * up x)`` (dense layers and shared experts).

A config a block cannot reproduce raises :class:`UnsupportedConfig` naming the config field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.kernels import matmul as inv_matmul
from skyrl_numerics.kernels import rms_norm as _inv_rms_norm


class UnsupportedConfig(InputError):
    """The invariant family cannot reproduce this config field (never a silently non-bitwise run)."""


def require(cond: bool, field: str, value, why: str) -> None:
    if not cond:
        raise UnsupportedConfig(f"config field {field!r} = {value!r}: {why}", field=field)


def _fp32_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` as fp32, kept on the tensor with its ``_version`` (converted once per change)."""
    hit = getattr(w, "_skyrl_fp32", None)
    if hit is None or hit[0] != w._version:
        hit = (w._version, w.detach().float())
        w._skyrl_fp32 = hit
    return hit[1]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with a per-row result independent of the number of rows.

    Without autograd on CPU the weight's fp32 copy is made once (and again only after the weight
    changes in place) instead of on every call; the GEMM sees the same fp32 values in the same
    layout as :func:`skyrl_numerics.kernels.matmul` would make of it, so the bits are the same
    (tested against it)."""
    if (x.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        from skyrl_numerics.kernels import cpu

        out = cpu.matmul_2d(x.reshape(-1, x.shape[-1]), _fp32_weight(w).t())
        return out.reshape(*x.shape[:-1], w.shape[0])
    return inv_matmul(x, w.t())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, per row in fp32, any leading shape."""
    lead = x.shape[:-1]
    return _inv_rms_norm(x.reshape(-1, x.shape[-1]), w, eps).reshape(*lead, x.shape[-1])


# ---- RoPE -----------------------------------------------------------------------------------
def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of ``dim`` dims: ``inv_freq`` (fp32, ``dim/2``), cos/sin multiplier
    ``mscale`` and the pair layout ``style`` ("neox" or "gptj")."""
    dim: int
    inv_freq: torch.Tensor
    mscale: float = 1.0
    style: str = "neox"

    @classmethod
    def from_config(cls, c, dim: int, style: str) -> "Rope":
        rp = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
        theta = float(rp.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        kind = rp.get("rope_type", rp.get("type", "default")) or "default"
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        if kind == "default":
            return cls(dim, 1.0 / base, 1.0, style)
        require(kind == "yarn", "rope_parameters.rope_type", kind,
                "the invariant forward implements 'default' and DeepSeek 'yarn' RoPE only")
        factor = float(rp["factor"])
        l0 = float(rp.get("original_max_position_embeddings",
                          getattr(c, "max_position_embeddings", 4096)))
        bf, bs = float(rp.get("beta_fast", 32)), float(rp.get("beta_slow", 1))
        attn_factor = float(rp.get("attention_factor", 1.0) or 1.0)

        def corr_dim(rot):
            return dim * math.log(l0 / (rot * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(corr_dim(bf)), 0)
        high = min(math.ceil(corr_dim(bs)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        mask = 1 - ramp
        inv = (1.0 / (factor * base)) * (1 - mask) + (1.0 / base) * mask
        m = (_yarn_mscale(factor, float(rp.get("mscale", 1)))
             / _yarn_mscale(factor, float(rp.get("mscale_all_dim", 0)))) * attn_factor
        return cls(dim, inv, float(m), style)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, dim]`` at ``positions [T]``, fp32 math, back to ``x.dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]        # [T, dim/2]
        cos = (freqs.cos() * self.mscale)[:, None, :]
        sin = (freqs.sin() * self.mscale)[:, None, :]
        xf = x.float()
        if self.style == "neox":
            h = self.dim // 2
            x1, x2 = xf[..., :h], xf[..., h:]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return out.to(x.dtype)


# ---- routers --------------------------------------------------------------------------------
def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool):
    """Softmax over experts in fp32, top-k per token; ``(weights fp32, ids)``."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor | None, k: int, n_group: int,
                       topk_group: int, renormalize: bool, scaling: float):
    """DeepSeek-V3 ``noaux_tc`` routing, per token, fp32::

        s = sigmoid(logits);  c = s + bias                       (bias = e_score_correction_bias)
        group score = sum of the top-2 c in each of n_group groups; keep the topk_group best groups
        ids = top-k of c over the kept groups (others -inf);  w = s[ids]
        w = w / (sum w + 1e-20) if renormalize;  w = w * routed_scaling_factor
    """
    s = torch.sigmoid(logits.float())
    c = s if bias is None else s + bias.float()
    T, E = c.shape
    if n_group > 1:
        g = c.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.topk(g, topk_group, dim=-1)[1]
        gmask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, keep, True)
        emask = gmask[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
        c = c.masked_fill(~emask, float("-inf"))
    ids = torch.topk(c, k, dim=-1)[1]
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, ids


# ---- MLPs -----------------------------------------------------------------------------------
def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
               w_down: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.silu(linear(x, w_gate)) * linear(x, w_up)
    return linear(h, w_down)


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert) -> torch.Tensor:
    """``sum_s weights[:, s] * expert(ids[:, s])(x)`` summed in slot order ``s = 0 .. k-1``.

    ``expert(e) -> (w_gate, w_up, w_down)``. Weights are cast to ``x.dtype`` before the products
    (as the fused MoE kernels do); each token's result uses only its own rows."""
    T, k = ids.shape
    out = torch.zeros(T, k, x.shape[-1], dtype=x.dtype)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out[tok, slot] = swiglu_mlp(x[tok], *expert(e))
    w = weights.to(x.dtype)
    acc = out[:, 0] * w[:, 0:1]
    for s in range(1, k):
        acc = acc + out[:, s] * w[:, s:s + 1]
    return acc
