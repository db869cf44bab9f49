"""Shared blocks of the batch-invariant forward: every family module is assembled from these.

Each block computes a token's result from that token's own inputs (and, for attention, the
cached rows of its own sequence) with a reduction order fixed per row, so the bits of a token do
not depend on which other tokens share the call, nor on prefill vs decode:

- :func:`linear`: ``x @ w.T`` through :func:`skyrl_numerics.kernels.matmul` (fp32 accumulation,
  per-row order independent of the number of rows; bf16 rounded once at the end);
- :func:`rms_norm`: per-row fp32 (:func:`skyrl_numerics.kernels.rms_norm`); :func:`add_rms_norm`
  with the residual add before it;
- :class:`Rope`: elementwise, ``cos/sin`` of the token's own position, in fp32. Two layouts:

      neox  (rotate-half, Qwen/Llama):  x' = x * cos + [-x[d/2:], x[:d/2]] * sin
      gptj  (interleaved, DeepSeek):    (x'[2i], x'[2i+1]) = (x[2i] c_i - x[2i+1] s_i,
                                                              x[2i+1] c_i + x[2i] s_i)

  with ``c_i = cos(p * f_i) * m``, ``s_i = sin(p * f_i) * m``; default RoPE has
  ``f_i = theta^(-2i/d)`` and ``m = 1``; Llama 3.1 (``rope_type="llama3"``) rescales the low
  frequencies (:func:`llama3_inv_freq`). DeepSeek YaRN (``rope_type="yarn"``) blends the
  extrapolated ``f_i`` with the interpolated ``f_i / factor`` by a linear ramp over the dims
  between the correction bounds ``floor/ceil(d * ln(L0 / (2 pi beta)) / (2 ln theta))`` for
  ``beta = beta_fast, beta_slow`` (without floor/ceil under ``truncate=False``, GPT-OSS):
  ``f_i = f_i/factor * (1 - mask_i) + f_i * mask_i``,
  ``mask_i = 1 - clamp((i - low) / (high - low), 0, 1)``, and scales cos/sin by
  ``m = mscale(factor, mscale) / mscale(factor, mscale_all_dim) * attention_factor``
  where ``mscale(s, a) = 0.1 a ln s + 1`` (1 for s <= 1);
- routers: :func:`softmax_topk` (Qwen/Mixtral) and :func:`sigmoid_group_topk` (DeepSeek
  ``noaux_tc``, GLM-4-MoE), both per token with ``torch.topk`` over one row;
- :func:`routed_experts`: each expert runs its tokens through invariant matmuls; a token's k
  expert outputs are summed in top-k slot order (never by an index_add over tokens);
- :func:`swiglu_mlp`: ``down(silu(gate x) * up x)`` (dense layers and shared experts);
  :func:`relu2_mlp`: ``down(relu(up x)^2)`` (Nemotron-H's non-gated MLPs and experts).

A config a block cannot reproduce raises :class:`UnsupportedConfig` naming the config field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.kernels import cpu, cpu_gemm_bf16, cpu_moe, cpu_norm
from skyrl_numerics.kernels import matmul as inv_matmul
from skyrl_numerics.kernels import rms_norm as _inv_rms_norm
from skyrl_numerics.kernels.cpu_moe import weighted_slot_sum


class UnsupportedConfig(InputError):
    """The invariant family cannot reproduce this config field (never a silently non-bitwise run)."""


def require(cond: bool, field: str, value, why: str) -> None:
    if not cond:
        raise UnsupportedConfig(f"config field {field!r} = {value!r}: {why}", field=field)


def _no_grad_bf16(x: torch.Tensor, ws) -> bool:
    """The CPU path that calls the bf16 GEMM directly: bfloat16 operands, no autograd."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and all(w.dtype == x.dtype for w in ws)
            and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws))))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with a per-row result independent of the number of rows.

    bfloat16 on CPU: :func:`skyrl_numerics.kernels.cpu_gemm_bf16.linear`, which reads ``w`` as
    stored (no float32 copy of any weight); :func:`skyrl_numerics.kernels.matmul` (the autograd
    path) computes the same thing, so the bits are the same with and without autograd (tested).
    ``w`` may be a :class:`.numerics.Projection` (a planned linear: quantized formats, LoRA),
    which computes ``x`` through its own numerics."""
    if not isinstance(w, torch.Tensor):
        return w(x)
    if _no_grad_bf16(x, (w,)):
        return cpu_gemm_bf16.linear(x, w)
    return inv_matmul(x, w.t())


def linear_many(x: torch.Tensor, ws) -> list[torch.Tensor]:
    """``[linear(x, w) for w in ws]`` bit for bit (planned linears: their numerics, the input's
    activation format once for all of them)."""
    if not all(isinstance(w, torch.Tensor) for w in ws):     # planned linears (numerics.py)
        from .numerics import project_many

        return project_many(x, ws)
    return [linear(x, w) for w in ws]


def head_matmuls(x: torch.Tensor, mats) -> torch.Tensor:
    """``stack([x[:, h] @ mats[h] for h in heads], 1)`` — one matmul per head (MLA's absorbed
    ``W_UK`` / ``W_UV``), ``x [T, H, K]``, ``mats`` a list of ``[K, N]`` -> ``[T, H, N]`` in
    ``x.dtype``. Each product is :func:`skyrl_numerics.kernels.matmul`'s; on the no-grad CPU
    path each head's ``mats[h].T`` is made K-contiguous once per weight change
    (:func:`_head_weights`, bfloat16: the bf16 GEMM's operand) — the same products, so the
    same bits (tested against the per-head loop)."""
    T, H, K = x.shape
    if not _no_grad_bf16(x, mats):
        return torch.stack([inv_matmul(x[:, h].contiguous(), mats[h]) for h in range(H)], dim=1)
    wt = _head_weights(mats)                                          # H x [N, K]
    out = torch.stack([cpu_gemm_bf16.linear_f32(x[:, h], wt[h]) for h in range(H)], dim=1)
    return out.to(x.dtype)


def _head_weights(mats):
    """``[m.T for m in mats]`` with unit stride along K: the views themselves when they have it
    (MLA's ``W_UV``), else a bfloat16 ``[H, N, K]`` copy (``W_UK``, a few MB), cached on the
    first matrix's base tensor (the per-head matrices are usually views of one weight) and
    rebuilt when any of their tensors' versions changes (an in-place update)."""
    if all(m.t().stride(1) == 1 for m in mats):
        return [m.t() for m in mats]
    bases = [m._base if m._base is not None else m for m in mats]
    if any(b.is_inference() for b in bases):   # a weight decoded per call (a packed kv_b_proj)
        return list(torch.stack([m.t() for m in mats]).contiguous())
    base = bases[0]
    key = (tuple(b._version for b in bases),
           tuple((m.data_ptr(), tuple(m.shape), tuple(m.stride())) for m in mats))
    cache = getattr(base, "_skyrl_head_weights", None)
    if cache is None:
        cache = base._skyrl_head_weights = {}
    hit = cache.get(key[1])
    if hit is None or hit[0] != key[0]:
        hit = cache[key[1]] = (key[0], torch.stack([m.detach().t() for m in mats]).contiguous())
    return hit[1]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, per row in fp32, any leading shape (no-grad CPU: the kernel
    itself, without the autograd wrapper; the same function computes it)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return cpu.rms_norm(x2, w, eps)[0].reshape(*lead, x.shape[-1])
    return _inv_rms_norm(x2, w, eps).reshape(*lead, x.shape[-1])


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float):
    """``(h + a, rms_norm(h + a, w, eps))``: the residual add and the next norm of a pre-norm
    decoder (no-grad CPU: one C pass, :func:`skyrl_numerics.kernels.cpu_norm.add_rms_norm`; the
    same bits as the two calls)."""
    if h.device.type == "cpu" and not (torch.is_grad_enabled() and (
            h.requires_grad or a.requires_grad or w.requires_grad)):
        return cpu_norm.add_rms_norm(h, a, w, eps)
    s = h + a
    return s, rms_norm(s, w, eps)


def rms_norm_heads(parts, eps: float) -> torch.Tensor:
    """``cat([rms_norm(x, w, eps) for x, w in parts], dim=1)`` bit for bit, for ``x [T, H_i, D]``
    with a ``[D]`` weight each (Qwen3's q_norm / k_norm): on the no-grad CPU path one call with
    each head's weight row laid out beside it (the same products per element)."""
    xs = [x for x, _ in parts]
    if not (all(x.device.type == "cpu" for x in xs)
            and not (torch.is_grad_enabled() and any(x.requires_grad or w.requires_grad for x, w in parts))):
        return torch.cat([rms_norm(x, w, eps) for x, w in parts], dim=1)
    x = torch.cat(xs, dim=1)
    T, H, D = x.shape
    # each head's weight row in fp32 (cpu.rms_norm's own w.float()), laid out beside its row
    w = torch.cat([w.float().expand(xi.shape[1], D) for xi, w in parts]).expand(T, H, D).reshape(T * H, D)
    return cpu.rms_norm(x.reshape(T * H, D), w, eps)[0].view(T, H, D)


def qk_norm_rope_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor,
                      k_w: torch.Tensor, eps: float, rope: "Rope", cos_sin):
    """Qwen3's attention inputs in one call where it can: per-head RMSNorm of ``q [T, Hq, D]``
    (weight ``q_w``) and ``k [T, Hk, D]`` (``k_w``), both rotated (``rope`` at ``cos_sin``), and
    the cache rows ``[k | v]`` -> ``(q [T, Hq, D], rows [T, 2·Hk·D])``. Bit for bit
    :func:`rms_norm_heads` then ``rope`` then ``cat`` (tested): on the no-grad CPU path with
    bf16 tensors :func:`skyrl_numerics.kernels.cpu_norm.qk_norm_rope` (the fused kernel
    ``kernels/csrc/qk_norm_rope.c``, or its torch specification) performs exactly those
    operations; otherwise those functions run. ``None`` when the fused path does not apply."""
    D = q.shape[-1]
    bf = torch.bfloat16
    if (q.device.type != "cpu" or D % 2 or rope.dim != D
            or any(t.dtype != bf for t in (q, k, v, q_w, k_w))
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, q_w, k_w)))):
        return None
    cos, sin = cos_sin
    return cpu_norm.qk_norm_rope(q, k, v, q_w, k_w, cos, sin, eps, rope.style == "gptj")


def qkv_norm_rope_rows(x: torch.Tensor, ws, q_w, k_w, eps: float, rope: "Rope", cos_sin,
                       head_dim: int, biases=None):
    """:func:`linear_many` of ``x`` by ``ws = (wq, wk, wv)`` (plus ``biases``, each added in
    the model dtype), then :func:`qk_norm_rope_rows` (``q_w``, ``k_w`` None: no q/k norms, RoPE
    and the cache rows only), in one C call on the no-grad CPU path of a small step
    (:func:`skyrl_numerics.kernels.cpu_norm.qkv_norm_rope`: the same bits, tested); ``None``
    where that does not apply (then the caller runs those ops)."""
    extra = [t for t in (q_w, k_w, *(biases or ())) if t is not None]
    if (x.device.type != "cpu" or x.dim() != 2 or rope is None or rope.dim != head_dim
            or not all(isinstance(w, torch.Tensor) for w in ws)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *extra, *ws)))):
        return None
    cos, sin = cos_sin
    return cpu_norm.qkv_norm_rope(x, ws, q_w, k_w, cos, sin, eps, rope.style == "gptj", head_dim,
                                  biases)


# ---- RoPE -----------------------------------------------------------------------------------
def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def llama3_inv_freq(inv: torch.Tensor, rp: dict) -> torch.Tensor:
    """Llama 3.1's frequency scaling (``rope_type="llama3"``): with wavelength
    ``w_i = 2 pi / f_i``, ``L0 = original_max_position_embeddings``, ``lo = L0 / low_freq_factor``,
    ``hi = L0 / high_freq_factor``: ``f_i`` kept where ``w_i < hi``, ``f_i / factor`` where
    ``w_i > lo``, and between them ``(1 - s) f_i / factor + s f_i`` with
    ``s = (L0 / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)``."""
    factor, lo_f, hi_f = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
    l0 = float(rp["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > l0 / lo_f, inv / factor, inv)
    smooth = (l0 / wavelen - lo_f) / (hi_f - lo_f)
    medium = ~(wavelen < l0 / hi_f) & ~(wavelen > l0 / lo_f)
    return torch.where(medium, (1 - smooth) * out / factor + smooth * out, out)


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
        if kind == "llama3":
            return cls(dim, llama3_inv_freq(1.0 / base, rp), 1.0, style)
        require(kind == "yarn", "rope_parameters.rope_type", kind,
                "the invariant forward implements 'default', 'llama3' and DeepSeek 'yarn' RoPE only")
        factor = float(rp["factor"])
        l0 = float(rp.get("original_max_position_embeddings",
                          getattr(c, "max_position_embeddings", 4096)))
        bf, bs = float(rp.get("beta_fast", 32)), float(rp.get("beta_slow", 1))
        attn_factor = float(rp.get("attention_factor", 1.0) or 1.0)

        def corr_dim(rot):
            return dim * math.log(l0 / (rot * 2 * math.pi)) / (2 * math.log(theta))
        low, high = corr_dim(bf), corr_dim(bs)
        if rp.get("truncate", True):     # GPT-OSS: truncate=False keeps the bounds fractional
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        mask = 1 - ramp
        inv = (1.0 / (factor * base)) * (1 - mask) + (1.0 / base) * mask
        m = (yarn_mscale(factor, float(rp.get("mscale", 1)))
             / yarn_mscale(factor, float(rp.get("mscale_all_dim", 0)))) * attn_factor
        return cls(dim, inv, float(m), style)

    def cos_sin(self, positions: torch.Tensor):
        """``(cos, sin)`` ``[T, 1, dim/2]`` fp32 (times ``mscale``) at ``positions``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]        # [T, dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.mscale != 1.0:          # (x * 1.0 is x: the same bits without the two ops)
            cos, sin = cos * self.mscale, sin * self.mscale
        return cos[:, None, :], sin[:, None, :]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cos_sin=None) -> torch.Tensor:
        """Rotate ``x [T, H, dim]`` at ``positions [T]``, fp32 math, back to ``x.dtype``
        (``cos_sin``: :meth:`cos_sin` of the same positions, to share it between q and k). A
        wider ``x`` (partial rotary, ``partial_rotary_factor``): its first ``dim`` dims rotated,
        the rest unchanged — HF's and vLLM's layout."""
        if x.shape[-1] > self.dim:     # partial rotary (GLM): the dims past ``dim`` pass as they are
            return torch.cat([self(x[..., :self.dim], positions, cos_sin), x[..., self.dim:]], dim=-1)
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions)
        xf = x.float()
        if self.style == "neox":
            h = self.dim // 2
            x1, x2 = xf[..., :h], xf[..., h:]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return out.to(x.dtype)


# ---- shape-independent elementwise ops ------------------------------------------------------
def _elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` with every element's bits independent of ``x``'s size and the thread count
    (:func:`skyrl_numerics.kernels.cpu.elementwise`: torch's CPU sigmoid/silu round their
    tail elements differently); on GPU the op as it is."""
    if x.device.type != "cpu":
        return fn(x)
    return cpu.elementwise(fn, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(torch.nn.functional.silu, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(torch.sigmoid, x)


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
    s = _elementwise(torch.sigmoid, logits.float())
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
    if isinstance(w_gate, torch.Tensor) and isinstance(w_up, torch.Tensor):
        g, u = linear(x, w_gate), linear(x, w_up)
    else:                       # planned linears: the input's activation format once for both
        g, u = linear_many(x, [w_gate, w_up])
    h = silu(g) * u
    return linear(h, w_down)


def relu2_mlp(x: torch.Tensor, w_up, w_down) -> torch.Tensor:
    """``down(relu(up x)^2)``, the square of the model-dtype ``relu`` rounded once (HF's
    ``relu2``): Nemotron-H's MLP blocks, shared and routed experts."""
    u = torch.relu(linear(x, w_up))
    return linear(u * u, w_down)


def expert_mlp(x: torch.Tensor, mats: tuple) -> torch.Tensor:
    """One expert: :func:`swiglu_mlp` for ``(w_gate, w_up, w_down)``, :func:`relu2_mlp` for
    ``(w_up, w_down)`` (a non-gated expert)."""
    return swiglu_mlp(x, *mats) if len(mats) == 3 else relu2_mlp(x, *mats)


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert,
                   num_experts: int | None = None) -> torch.Tensor:
    """``sum_s weights[:, s] * expert(ids[:, s])(x)`` summed in slot order ``s = 0 .. k-1``.

    ``expert(e) -> (w_gate, w_up, w_down)`` (SwiGLU) or ``(w_up, w_down)`` (non-gated ReLU²,
    :func:`expert_mlp`). Weights are cast to ``x.dtype`` before the products
    (as the fused MoE kernels do); each token's result uses only its own rows.

    On CPU without autograd (the engine, and the trainer's no-grad logprobs) in bfloat16 with
    ``num_experts`` given, the experts run grouped (:func:`_grouped_expert_rows`): three GEMM
    calls per layer instead of three per active expert. The bits are the per-expert loop's: a
    bf16 GEMM output depends only on its row and its weight, so which rows share a call does
    not change any result (tested against the loop)."""
    T, k = ids.shape
    if (num_experts is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16
            and not (torch.is_grad_enabled() and x.requires_grad)):
        first = expert(0)[0]
        if isinstance(first, torch.Tensor) and not (torch.is_grad_enabled() and first.requires_grad):
            return _grouped_expert_rows(x, ids, expert, num_experts, weights=weights)
        out = _looped_expert_rows(x, ids, expert)
    else:
        out = _looped_expert_rows(x, ids, expert)
    return weighted_slot_sum(out, weights, x.dtype)


def _looped_expert_rows(x, ids, expert) -> torch.Tensor:
    """``out[t, s] = expert(ids[t, s])(x[t])`` ([T, k, hidden]), one expert at a time."""
    T, k = ids.shape
    out = torch.zeros(T, k, x.shape[-1], dtype=x.dtype)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out[tok, slot] = expert_mlp(x[tok], expert(e))
    return out


def _grouped_expert_rows(x, ids, expert, E: int, weights=None) -> torch.Tensor:
    """The rows of :func:`_looped_expert_rows`, all experts at once: the (token, slot) pairs are
    sorted by expert (stable) and each projection (gate, up, down) is one grouped call of the
    bf16 GEMM (:func:`skyrl_numerics.kernels.cpu_gemm_bf16.grouped`), every expert's rows
    against its own weight as stored. Each output row is the per-expert loop's (the GEMM's bits
    depend only on the row and the weight: tested against the loop).

    With ``weights``: :func:`routed_experts`' weighted sum ``[T, H]`` instead of the rows. The
    rows' gather and the slot-order sum are :mod:`skyrl_numerics.kernels.cpu_moe`'s (C,
    ``kernels/csrc/moe_rows.c``, for bf16 when built, else their torch specification: the same
    bits, tested)."""
    T, k = ids.shape
    H = x.shape[-1]
    if T == 0:
        return torch.zeros(0, k, H, dtype=x.dtype) if weights is None else torch.zeros(0, H, dtype=x.dtype)
    # (stable by expert: the order torch's stable sort gives; one C call for the bookkeeping)
    off, src, rowmap = cpu_moe.sort_pairs(ids, E)
    groups = cpu_gemm_bf16.Groups.of(off)        # checked once for the three projections
    trios = [None] * E
    for e in groups.used:
        trios[e] = expert(e)
    a = cpu_moe.expert_operand(x, src)                                  # sorted by expert
    gated = len(next(t for t in trios if t is not None)) == 3
    u = cpu_gemm_bf16.grouped(a, [t and t[-2] for t in trios], groups, x.dtype)
    if gated:
        h = silu(cpu_gemm_bf16.grouped(a, [t and t[0] for t in trios], groups, x.dtype)) * u
    else:                                                  # relu2_mlp's activation
        h = torch.relu(u)
        h = h * h
    y = cpu_gemm_bf16.grouped(h, [t and t[-1] for t in trios], groups)
    if weights is None:
        return cpu_moe.slot_rows(y, rowmap, T, k, H, x.dtype)
    return cpu_moe.combine(y, rowmap, weights, H, x.dtype)
