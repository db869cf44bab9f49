"""Make the HF DeepSeek-V3 trainer forward compute one piece the way vLLM computes it.

Attribution of the DeepSeek-V3 trainer–engine gap (docs/mla.md, "Where the DeepSeek-V3 gap comes
from"): each context manager below swaps *one* piece of the transformers ``DeepseekV3`` forward for
the formulation and rounding points vLLM (0.32, CPU) uses, so a doctor row with that piece switched
on measures how much of the gap it explains. Every patch of transformers lives in this module; each
one is an instance-level ``forward`` override on the modules of *one* model, removed on exit (the
class and other models are untouched, and the restored forward is the original bound method).

Pieces (``T`` = the model dtype, bf16 here; ``fp32(·)`` = computed with fp32 accumulation and
rounded once to ``T``), largest first as measured (docs/mla.md):

- :func:`vllm_cpu_rope` — vLLM 0.32 CPU's rotary kernel on MLA's 3-D q/k *views*: it rotates
  query head ``r % H`` of token ``r // H`` by the position of token ``r`` and leaves the rest
  unrotated, keys likewise, so what the engine computes depends on its batch layout. The trainer
  emulates it from the layout the engine recorded (``MLAScheduleExtension``, ``worker.py``;
  :func:`recorded_steps`, :func:`cpu_rope_positions`, ``schedule.py``). ``MLARopeFixExtension``
  fixes the engine instead.
- :func:`vllm_style_mla` — the attention formulation. HF runs the *expanded* form for every
  position: ``k_nope = W_UK c``, ``v = W_UV c`` (both rounded to ``T``), per-head attention over
  ``[k_nope, k_pe]``. vLLM runs the *absorbed* form over the latent cache ``[c, k_pe]``
  (``kv_lora_rank + qk_rope_head_dim`` per token)::

      q_lat  = fp32(q_nope · W_UK)                       [H, kv_lora_rank]
      scores = (q_lat · c + q_pe · k_pe) · scale          (fp32)
      o_lat  = fp32(softmax(scores) · c)                 [H, kv_lora_rank]
      out    = fp32(o_lat · W_UV)                        [H, v_head_dim]

  for decoded positions always, and for prompt positions with the AMX_MLA CPU backend (its
  ``forward_mha`` also attends in latent space, ``cpu_mla_extend``); the reference CPU_MLA
  backend and the GPU backends compute prompt positions *expanded* instead (``prefill="expanded"``:
  ``k_nope``, ``v`` in ``T``, attention in fp32 as ``cpu_sdpa.py`` does, output rounded to ``T``).
  ``rope="vllm"`` also applies the interleaved (GPT-J) rotation the way vLLM's fused rotary kernel
  does: one rounding of ``x1·cos − x2·sin`` instead of three.
- :func:`vllm_style_router` — vLLM's gate is a ``T`` GEMM (``GateLinear``, no fp32 out dtype on
  CPU): router logits are rounded to ``T`` before the fp32 sigmoid, where HF computes them in fp32
  (``F.linear(h.float(), W.float())``). Selection (sigmoid + ``e_score_correction_bias``,
  group-limited ``noaux_tc``) is otherwise the same; vLLM renormalizes without HF's ``+1e-20``.
- :func:`vllm_style_moe` — how routed and shared experts are combined. HF multiplies each routed
  expert's ``T`` output by its fp32 weight *already scaled* by ``routed_scaling_factor``, rounds
  each product to ``T`` and accumulates them in ``T`` (``index_add_``). vLLM's fused CPU MoE keeps
  the unscaled, renormalized weights, sums ``w_k · y_k`` (modelled here in fp32, rounded once:
  the C++ kernel's internal order is not reproduced), then scales the
  routed output by ``routed_scaling_factor`` in ``T`` and adds the shared expert
  (``MoERunner._maybe_apply_routed_scale_to_output``; ``result = shared + routed``). The experts'
  ``silu(g)·u`` is formed in fp32 and rounded once (vLLM's ``silu_and_mul``); the shared expert
  and the dense MLP go through :func:`vllm_style_mlp`.
- :func:`vllm_style_mlp` — dense first layer(s) and shared expert: ``gate_up`` GEMM, then
  ``silu(g)·u`` in fp32 rounded once (vLLM's CPU ``silu_and_mul``) instead of HF's three roundings.

All of them compose with each other and with R3 (:func:`skyrl_numerics.replay.route_replay`,
whose hook on the router replaces the chosen experts; :func:`vllm_style_moe` then recomputes the
weights at those experts vLLM's way from the router logits). :func:`vllm_style` enters any subset.
"""
from __future__ import annotations

import contextlib
import types
from typing import Callable, Iterable, Sequence

import torch

from .schedule import cpu_rope_positions

__all__ = ["vllm_style_mla", "vllm_cpu_rope", "vllm_style_router", "vllm_style_moe",
           "vllm_style_mlp", "vllm_style", "vllm_style_hook", "absorbed_attention",
           "expanded_attention", "PIECES"]


# ----------------------------------------------------------------------------------------------
# helpers

def _modules(model, cls_name: str) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == cls_name]


@contextlib.contextmanager
def _override_forward(modules: Iterable[torch.nn.Module], make: Callable):
    """Set ``m.forward = make(m)`` on each module (an instance attribute shadowing the class
    method); on exit remove it again, so ``m.forward`` is the class's bound method once more."""
    mods = list(modules)
    prev = []
    for m in mods:
        prev.append(m.__dict__.get("forward", None))
        m.forward = types.MethodType(make(m), m)
    try:
        yield mods
    finally:
        for m, p in zip(mods, prev):
            if p is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = p


def _require(model, cls_name: str, what: str) -> list[torch.nn.Module]:
    mods = _modules(model, cls_name)
    if not mods:
        raise ValueError(f"{what}: the model has no {cls_name} modules "
                         f"(expected a transformers DeepseekV3 model, got {type(model).__name__})")
    return mods


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for 16-bit models, the model's own dtype otherwise (fp64 stays
    fp64, so the formulations can be compared exactly)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


# ----------------------------------------------------------------------------------------------
# MLA: the two formulations

def _causal_bias(attention_mask, B: int, S: int, T: int, device, dtype) -> torch.Tensor:
    """Additive [B|1, 1|H, S, T] bias from HF's 4-D mask (bool: True = attend; float: additive),
    or a causal one when the mask is None."""
    if attention_mask is None:
        keep = torch.ones(S, T, dtype=torch.bool, device=device).tril(T - S)
        return torch.zeros(S, T, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))
    m = attention_mask[..., :S, :T]
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, float("-inf"))
    return m.to(dtype)


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(p, nan=0.0)  # fully masked (padding) rows


def absorbed_attention(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, bias, out_dtype):
    """vLLM's absorbed MLA (decode, and AMX prefill): attention over the latent ``[c, k_pe]``.

    ``q_nope`` [B,H,S,P], ``q_pe`` [B,H,S,R] (rotated), ``c`` [B,S,L] (normalized latent),
    ``k_pe`` [B,S,R] (rotated), ``w_uk`` [H,P,L], ``w_uv`` [H,V,L]. Rounding points as vLLM:
    ``q_lat`` (bmm out), ``o_lat`` (kernel out) and ``out`` (bmm out) in ``out_dtype``; scores,
    softmax and the P·c sum in the accumulation dtype. Returns [B,H,S,V] in ``out_dtype``.
    """
    acc = _acc(out_dtype)
    q_lat = _round(torch.einsum("bhsp,hpl->bhsl", q_nope.to(acc), w_uk.to(acc)), out_dtype)
    scores = (torch.einsum("bhsl,btl->bhst", q_lat.to(acc), c.to(acc))
              + torch.einsum("bhsr,btr->bhst", q_pe.to(acc), k_pe.to(acc))) * scale
    p = _softmax(scores + bias.to(acc))
    o_lat = _round(torch.einsum("bhst,btl->bhsl", p, c.to(acc)), out_dtype)
    return _round(torch.einsum("bhsl,hvl->bhsv", o_lat.to(acc), w_uv.to(acc)), out_dtype)


def expanded_attention(q_nope, q_pe, c, k_pe, kv_b_proj, nope: int, scale, bias, out_dtype):
    """The expanded form as vLLM's CPU prefill computes it (``cpu_sdpa.py``): ``k_nope, v =
    kv_b_proj(c)`` in the model dtype, then attention with fp32 scores, softmax and P·V, output
    rounded to ``out_dtype``. Returns [B,H,S,V]."""
    acc = _acc(out_dtype)
    B, H, S, _ = q_nope.shape
    kv = kv_b_proj(c).view(B, c.shape[1], H, -1).transpose(1, 2)   # [B,H,T,P+V], model dtype
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scores = (torch.einsum("bhsp,bhtp->bhst", q_nope.to(acc), k_nope.to(acc))
              + torch.einsum("bhsr,btr->bhst", q_pe.to(acc), k_pe.to(acc))) * scale
    p = _softmax(scores + bias.to(acc))
    return _round(torch.einsum("bhst,bhtv->bhsv", p, v.to(acc)), out_dtype)


def _rotate_at(x, positions, rotary, interleave: bool):
    """Rotate ``x`` [B,H,S,R] with *per-element* positions [B,H,S] (HF's cos/sin for those
    positions, from the model's ``rotary_emb``), one rounding as vLLM's rotary kernel; output in
    HF's layout (de-interleaved for interleaved weights)."""
    B, H, S, R = x.shape
    cos, sin = rotary(x, positions.reshape(B * H, S))            # [B*H, S, R], x.dtype
    cos, sin = cos.view(B, H, S, R), sin.view(B, H, S, R)
    acc = _acc(x.dtype)
    xf = x.to(acc)
    if interleave:
        c, s_ = cos[..., : R // 2].to(acc), sin[..., : R // 2].to(acc)
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)
    else:
        rot = torch.cat((-xf[..., R // 2:], xf[..., : R // 2]), dim=-1)
        out = xf * cos.to(acc) + rot * sin.to(acc)
    return out.to(x.dtype)


def _mla_forward(opts: dict):
    """Build the patched ``DeepseekV3Attention.forward``. ``opts``: formulation ("hf" | "vllm"),
    prefill ("absorbed" | "expanded"), rope ("hf" | "vllm"), prefill_mask(B, S, offset, device),
    rope_positions(B, S, offset, device) -> [B,H+1,S] long or None (rotation position of each
    query head, then of the key), rotary (the model's rotary_emb)."""
    def make(attn):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        cfg = attn.config
        H, P, R, V, L = (attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
                         attn.v_head_dim, attn.kv_lora_rank)

        def forward(self, hidden_states, position_embeddings, attention_mask,
                    past_key_values=None, **kwargs):
            B, S = hidden_states.shape[:-1]
            dtype = hidden_states.dtype
            dev = hidden_states.device
            offset = 0 if past_key_values is None else past_key_values.get_seq_length(
                self.layer_idx)
            if self.q_lora_rank is None:
                q = self.q_proj(hidden_states)
            else:
                q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
            q = q.view(B, S, -1, P + R).transpose(1, 2)
            q_nope, q_rot = torch.split(q, [P, R], dim=-1)
            ckv = self.kv_a_proj_with_mqa(hidden_states)
            c, k_rot = torch.split(ckv, [L, R], dim=-1)
            c = self.kv_a_layernorm(c).view(B, 1, S, L)
            k_rot = k_rot.view(B, 1, S, R)
            cos, sin = position_embeddings
            rpos = opts["rope_positions"](B, S, offset, dev) if opts["rope_positions"] else None
            rotary, inter = opts["rotary"], cfg.rope_interleave
            if rpos is not None:       # vLLM CPU's rotary kernel on MLA's views (vllm_cpu_rope)
                q_rot = _rotate_at(q_rot, rpos[:, :-1], rotary, inter)
                k_rot = _rotate_at(k_rot, rpos[:, -1:], rotary, inter)
            elif opts["rope"] == "vllm":  # right positions, one rounding
                pos = torch.arange(offset, offset + S, device=dev)
                q_rot = _rotate_at(q_rot, pos.expand(B, q.shape[1], S), rotary, inter)
                k_rot = _rotate_at(k_rot, pos.expand(B, 1, S), rotary, inter)
            elif inter:
                q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
            else:
                q_rot, k_rot = hf.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
            if past_key_values is not None:  # the cache holds the latents, as vLLM's does
                c, k_rot = past_key_values.update(c, k_rot, self.layer_idx)
            if opts["formulation"] == "hf":   # HF's own expanded attention, unchanged
                query_states = torch.cat((q_nope, q_rot), dim=-1)
                key_states, value_states = self.expand_kv(c, k_rot)
                interface = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
                    self.config._attn_implementation, hf.eager_attention_forward)
                out, _ = interface(self, query_states, key_states, value_states, attention_mask,
                                   dropout=0.0 if not self.training else self.attention_dropout,
                                   scaling=self.scaling, **kwargs)
                out = out.reshape(B, S, -1).contiguous()
                return self.o_proj(out), None
            c, k_rot = c[:, 0], k_rot[:, 0]                          # [B,T,L], [B,T,R]
            T = c.shape[1]
            acc = _acc(dtype)
            bias = _causal_bias(attention_mask, B, S, T, dev, acc)
            w = self.kv_b_proj.weight.view(H, P + V, L)
            out = absorbed_attention(q_nope, q_rot, c, k_rot, w[:, :P], w[:, P:], self.scaling,
                                     bias, dtype)
            if opts["prefill"] == "expanded":
                pm = opts["prefill_mask"](B, S, T - S, dev)          # [B,S] True: prompt
                if pm is not None and bool(pm.any()):
                    ex = expanded_attention(q_nope, q_rot, c, k_rot, self.kv_b_proj, P,
                                            self.scaling, bias, dtype)
                    out = torch.where(pm[:, None, :, None], ex, out)
            out = out.transpose(1, 2).reshape(B, S, H * V)
            return self.o_proj(out), None
        return forward
    return make


def _row_positions(per_row, what: str):
    """``per_row``: one [H, S_b] array per batch row -> callable giving a [B,H,S] long tensor
    (positions beyond a row's array: the true positions)."""
    if per_row is None:
        return None
    arrs = [torch.as_tensor(a, dtype=torch.long) for a in per_row]

    def get(B, S, offset, device):
        if len(arrs) != B:
            raise ValueError(f"{what} has {len(arrs)} rows, the forward has {B}")
        H = arrs[0].shape[0]
        out = torch.arange(offset, offset + S).expand(B, H, S).clone()
        for b, a in enumerate(arrs):
            n = min(S, a.shape[1] - offset)
            if n > 0:
                out[b, :, :n] = a[:, offset:offset + n]
        return out.to(device)
    return get


def _rotary_of(model):
    rot = [m for m in model.modules() if type(m).__name__ == "DeepseekV3RotaryEmbedding"]
    if not rot:
        raise ValueError("the model has no DeepseekV3RotaryEmbedding")
    return rot[0]


@contextlib.contextmanager
def _mla_patch(model, *, formulation, prompt_lens, prefill, rope, rope_positions, what):
    if prefill not in ("absorbed", "expanded"):
        raise ValueError(f"prefill must be 'absorbed' or 'expanded', got {prefill!r}")
    if rope not in ("hf", "vllm"):
        raise ValueError(f"rope must be 'hf' or 'vllm', got {rope!r}")
    if formulation == "vllm" and prefill == "expanded" and prompt_lens is None:
        raise ValueError("prefill='expanded' needs prompt_lens (prompt length of each batch row)")
    lens = None if prompt_lens is None else [int(x) for x in prompt_lens]

    def prefill_mask(B, S, offset, device):
        if lens is None:
            return None
        if len(lens) != B:
            raise ValueError(f"prompt_lens has {len(lens)} entries, the forward has {B} rows")
        pos = torch.arange(offset, offset + S, device=device)
        return pos[None, :] < torch.tensor(lens, device=device)[:, None]

    mods = _require(model, "DeepseekV3Attention", what)
    opts = dict(formulation=formulation, prefill=prefill, rope=rope, prefill_mask=prefill_mask,
                rope_positions=_row_positions(rope_positions, "rope_positions"),
                rotary=_rotary_of(model))
    with _override_forward(mods, _mla_forward(opts)):
        yield model


@contextlib.contextmanager
def vllm_style_mla(model, prompt_lens: Sequence[int] | None = None, *, prefill: str = "absorbed",
                   rope: str = "hf", rope_positions=None):
    """Every ``DeepseekV3Attention`` of ``model`` computes MLA the way vLLM does.

    ``prefill="absorbed"`` (default; vLLM's AMX_MLA CPU backend, the one these machines run):
    every position in the absorbed form. ``prefill="expanded"`` (vLLM's reference CPU_MLA backend
    and the GPU MLA backends): positions ``< prompt_lens[b]`` of batch row ``b`` expanded, the
    decoded ones absorbed; ``prompt_lens`` is then required, one entry per row of each forward
    inside the block (use :func:`mla_forward_hook` with ``trainer_logprobs``). ``rope="vllm"``:
    the rotation rounded once, as vLLM's rotary kernel. ``rope_positions``: see
    :func:`vllm_cpu_rope`. Restores the original forwards on exit.
    """
    with _mla_patch(model, formulation="vllm", prompt_lens=prompt_lens, prefill=prefill,
                    rope=rope, rope_positions=rope_positions, what="vllm_style_mla"):
        yield model


@contextlib.contextmanager
def vllm_cpu_rope(model, rope_positions, *, rope: str = "hf"):
    """HF's attention, but each query head and key rotated by the position vLLM CPU's rotary
    kernel rotated it by in the engine.

    vLLM 0.32's CPU ``rotary_embedding`` kernel (``torch.ops._C.rotary_embedding``) treats its
    query/key as ``num_tokens = positions.numel()`` rows of ``head_size`` values, ``stride(-2)``
    apart (heads per row = ``size(-1) / head_size`` = 1 here), and rotates row ``r`` by
    ``positions[r]``. MLA passes it 3-D views (``DeepseekV2MLAAttention`` ->
    ``MultiHeadLatentAttentionWrapper``): the query ``q[..., qk_nope:]`` of shape
    ``[tokens, heads, rope]`` (row stride ``qk_nope + rope``), so row ``r`` is head ``r % heads``
    of token ``r // heads``, rotated by the position of *token r*, and the query heads in rows
    ``r >= tokens`` are not rotated; and the key ``k_pe.unsqueeze(1)``, a ``[tokens, 1, rope]``
    view into the fused ``q_a``/``kv_a`` projection output whose row stride is ``rope`` while the
    token stride is ``q_lora_rank + kv_lora_rank + rope``, so only the keys of tokens ``t`` with
    ``t · stride0 / rope < tokens`` are rotated (token 0 by its own position, others by a wrong
    one) and the rest stay unrotated, in the latent cache, for every later step. Which rows get
    which position therefore depends on how the engine batched the tokens.

    ``rope_positions``: one ``[heads + 1, seq]`` integer array per batch row of each forward
    inside the block: the position each query head (rows ``0..heads-1``) and the key (last row)
    was rotated by, 0 = not rotated; build them with :func:`cpu_rope_positions`.
    """
    with _mla_patch(model, formulation="hf", prompt_lens=None, prefill="absorbed", rope=rope,
                    rope_positions=rope_positions, what="vllm_cpu_rope"):
        yield model


# ----------------------------------------------------------------------------------------------
# router, experts, MLP

def _router_forward(router):
    def forward(self, hidden_states):
        h = hidden_states.view(-1, self.hidden_dim)
        # vLLM: bf16 GateLinear (rounded to the model dtype), then fp32 scoring
        logits = torch.nn.functional.linear(h, self.weight.to(h.dtype)).float()
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        E, G = self.num_experts, self.num_group
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return logits, w * self.routed_scaling_factor, idx
    return forward


@contextlib.contextmanager
def vllm_style_router(model):
    """Every ``DeepseekV3TopkRouter`` computes its logits in the model dtype (vLLM's CPU gate),
    then scores/selects in fp32 as before. Restored on exit."""
    mods = _require(model, "DeepseekV3TopkRouter", "vllm_style_router")
    with _override_forward(mods, _router_forward):
        yield model


def _silu_mul(gate_up: torch.Tensor, dtype) -> torch.Tensor:
    """vLLM's ``silu_and_mul``: ``silu(g)·u`` in fp32, rounded once."""
    acc = _acc(dtype)
    g, u = gate_up.to(acc).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(dtype)


def _mlp_forward(mlp):
    def forward(self, x):
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj(_silu_mul(gate_up, x.dtype))
    return forward


@contextlib.contextmanager
def vllm_style_mlp(model):
    """Dense MLPs and shared experts (``DeepseekV3MLP``): ``silu(g)·u`` rounded once."""
    mods = _require(model, "DeepseekV3MLP", "vllm_style_mlp")
    with _override_forward(mods, _mlp_forward):
        yield model


def _vllm_weights(router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """vLLM CPU router weights at ``idx``: renormalized sigmoid scores, *unscaled*."""
    w = logits.float().sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w


def _moe_forward(moe):
    def forward(self, hidden_states):
        shape = hidden_states.shape
        dtype = hidden_states.dtype
        acc = _acc(dtype)
        logits, _, idx = self.gate(hidden_states)     # idx: chosen (or replayed, under R3)
        w = _vllm_weights(self.gate, logits, idx)     # [N, k] fp32, unscaled
        x = hidden_states.reshape(-1, shape[-1])
        ex = self.experts
        routed = torch.zeros(x.shape, dtype=acc, device=x.device)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            gu = torch.nn.functional.linear(x[tok], ex.gate_up_proj[e])
            y = torch.nn.functional.linear(_silu_mul(gu, dtype), ex.down_proj[e])
            routed.index_add_(0, tok, y.to(acc) * w[tok, slot, None].to(acc))
        routed = routed.to(dtype) * self.gate.routed_scaling_factor     # scaled in T
        out = self.shared_experts(hidden_states).reshape(-1, shape[-1]) + routed.to(dtype)
        return out.view(shape)
    return forward


@contextlib.contextmanager
def vllm_style_moe(model):
    """Every ``DeepseekV3MoE`` combines experts as vLLM's CPU fused MoE: unscaled renormalized
    weights, ``Σ_k w_k·y_k`` in fp32 rounded once, ``× routed_scaling_factor`` in the model
    dtype, ``+ shared``. Expert indices come from the router (so R3 replay still applies)."""
    mods = _require(model, "DeepseekV3MoE", "vllm_style_moe")
    with _override_forward(mods, _moe_forward):
        yield model


# ----------------------------------------------------------------------------------------------
# composition

PIECES = ("cpu_rope", "mla", "router", "moe", "mlp")


@contextlib.contextmanager
def vllm_style(model, pieces: Iterable[str] = PIECES, *, prompt_lens=None, rope_positions=None,
               prefill: str = "absorbed", rope: str = "hf"):
    """Enter several pieces at once (names from :data:`PIECES`; ``"cpu_rope"`` needs
    ``rope_positions``, ``prefill="expanded"`` needs ``prompt_lens``)."""
    pieces = list(pieces)
    unknown = set(pieces) - set(PIECES)
    if unknown:
        raise ValueError(f"unknown pieces {sorted(unknown)}; known: {list(PIECES)}")
    if "cpu_rope" in pieces and rope_positions is None:
        raise ValueError("the 'cpu_rope' piece needs rope_positions (see cpu_rope_positions)")
    qpos = rope_positions if "cpu_rope" in pieces else None
    with contextlib.ExitStack() as st:
        if "mla" in pieces:
            st.enter_context(vllm_style_mla(model, prompt_lens, prefill=prefill, rope=rope,
                                            rope_positions=qpos))
        elif qpos is not None or rope != "hf":
            st.enter_context(_mla_patch(model, formulation="hf", prompt_lens=None,
                                        prefill="absorbed", rope=rope, rope_positions=qpos,
                                        what="vllm_style"))
        if "router" in pieces:
            st.enter_context(vllm_style_router(model))
        if "moe" in pieces:
            st.enter_context(vllm_style_moe(model))
        if "mlp" in pieces:
            st.enter_context(vllm_style_mlp(model))
        yield model


def vllm_style_hook(model, rollout, pieces: Iterable[str] = PIECES, *, prefill: str = "absorbed",
                    rope: str = "hf", steps=None):
    """A ``forward_hook`` for :func:`skyrl_numerics.trainer.logprobs.trainer_logprobs`: each batch
    of rows runs under :func:`vllm_style` with those rows' prompt lengths and, for
    ``"cpu_rope"``, the query rotations vLLM CPU's rotary kernel applied in the engine ``steps``
    that produced ``rollout`` (default :func:`lockstep_schedule`)."""
    pieces = list(pieces)
    qpos = None
    if "cpu_rope" in pieces:
        qpos = cpu_rope_positions(rollout.prompt_lens, rollout.response_lens,
                                  _require(model, "DeepseekV3Attention", "vllm_style_hook")[0]
                                  .config, steps)

    def hook(rows):
        return vllm_style(model, pieces, prompt_lens=[int(rollout.prompt_lens[i]) for i in rows],
                          rope_positions=None if qpos is None else [qpos[i] for i in rows],
                          prefill=prefill, rope=rope)
    return hook
