"""One Qwen3-MoE forward, written once with batch-invariant ops, run by the trainer *and* by vLLM.

Why: the trainer and the engine disagree because they run different kernels in different batch
shapes (a padded full-sequence forward vs continuous-batched prefill + one-token decode over a
paged KV cache). Here both sides call the same function, built only from ops whose result for a
token does not depend on which other tokens share the call:

- linear layers, router, experts, lm-head: ``skyrl_numerics.kernels.matmul`` (fixed reduction
  order per row, whatever the number of rows);
- RMSNorm: ``skyrl_numerics.kernels.rms_norm`` (per-row fp32);
- RoPE: elementwise, cos/sin from the token's own position;
- attention: ``skyrl_numerics.kernels.attention`` (fixed KV split: a full-sequence prefill and a
  token-by-token decode give the same bits for every query);
- MoE: softmax top-k per token; each expert runs its tokens through invariant matmuls; the k
  expert outputs are summed in top-k slot order.

The only thing that differs between the two callers is where keys/values come from
(``attend``): the trainer passes each sequence's own K/V, vLLM reads them back from its paged KV
cache (``vllm_invariant_model``). Same inputs, same ops, same bits.

Weights use the HF checkpoint names, so the same ``model.safetensors`` loads into both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from skyrl_numerics.kernels import attention as inv_attention
from skyrl_numerics.kernels import matmul as inv_matmul
from skyrl_numerics.kernels import rms_norm as inv_rms_norm


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_inter: int
    norm_topk_prob: bool
    eps: float
    rope_theta: float

    @classmethod
    def from_config(cls, c) -> "Dims":
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts")
        return cls(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
                   heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                   head_dim=c.head_dim, experts=experts, top_k=c.num_experts_per_tok,
                   moe_inter=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                   eps=c.rms_norm_eps, rope_theta=float(theta))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with a per-row result independent of the number of rows."""
    return inv_matmul(x, w.t())


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (HF Qwen3 layout) on ``x [T, H, D]``, in fp32, per token."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    xf = x.float()
    rot = torch.cat([-xf[..., d // 2:], xf[..., : d // 2]], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


# attend(layer, q [T,H,D], k [T,Hkv,D], v [T,Hkv,D]) -> out [T,H,D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attend_one_sequence(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Queries ``q [n, H, D]`` at the last ``n`` positions of ``k_all/v_all [S, Hkv, D]``."""
    out = inv_attention(q.transpose(0, 1)[None], k_all.transpose(0, 1)[None],
                        v_all.transpose(0, 1)[None], causal=True, scale=scale)
    return out[0].transpose(0, 1)


class InvariantQwen3Moe(nn.Module):
    """Parameters under HF names; ``forward_tokens`` runs the flat token stream."""

    def __init__(self, dims: Dims, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dims = d = dims
        self.dtype = dtype
        P = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        self.params = nn.ParameterDict()
        self._names: dict[str, str] = {}

        def add(name, *shape):
            key = name.replace(".", "__")
            self.params[key] = P(*shape)
            self._names[name] = key

        add("model.embed_tokens.weight", d.vocab, d.hidden)
        add("model.norm.weight", d.hidden)
        add("lm_head.weight", d.vocab, d.hidden)
        for i in range(d.layers):
            p = f"model.layers.{i}."
            add(p + "input_layernorm.weight", d.hidden)
            add(p + "post_attention_layernorm.weight", d.hidden)
            add(p + "self_attn.q_proj.weight", d.heads * d.head_dim, d.hidden)
            add(p + "self_attn.k_proj.weight", d.kv_heads * d.head_dim, d.hidden)
            add(p + "self_attn.v_proj.weight", d.kv_heads * d.head_dim, d.hidden)
            add(p + "self_attn.o_proj.weight", d.hidden, d.heads * d.head_dim)
            add(p + "self_attn.q_norm.weight", d.head_dim)
            add(p + "self_attn.k_norm.weight", d.head_dim)
            add(p + "mlp.gate.weight", d.experts, d.hidden)
            for e in range(d.experts):
                add(p + f"mlp.experts.{e}.gate_proj.weight", d.moe_inter, d.hidden)
                add(p + f"mlp.experts.{e}.up_proj.weight", d.moe_inter, d.hidden)
                add(p + f"mlp.experts.{e}.down_proj.weight", d.hidden, d.moe_inter)

    # ---- weights ------------------------------------------------------------------------
    def w(self, name: str) -> torch.Tensor:
        return self.params[self._names[name]]

    def hf_names(self) -> list[str]:
        return list(self._names)

    def load_named(self, named) -> set[str]:
        """Copy ``(hf_name, tensor)`` pairs in; unknown names are an error."""
        loaded = set()
        with torch.no_grad():
            for name, t in named:
                if name not in self._names:
                    raise KeyError(f"unexpected weight {name!r}")
                dst = self.w(name)
                if tuple(t.shape) != tuple(dst.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(t.to(dst.dtype))
                loaded.add(name)
        return loaded

    @classmethod
    def from_checkpoint(cls, model_dir) -> "InvariantQwen3Moe":
        """Build from an HF checkpoint directory (config.json + model.safetensors)."""
        from pathlib import Path

        from safetensors.torch import load_file
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(model_dir))
        model = cls(Dims.from_config(cfg))
        tensors = load_file(str(Path(model_dir) / "model.safetensors"))
        missing = set(model.hf_names()) - set(tensors)
        if missing:
            raise KeyError(f"checkpoint lacks {sorted(missing)[:3]} ...")
        model.load_named(tensors.items())
        return model.eval()

    # ---- forward ------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.w("model.embed_tokens.weight")[input_ids]

    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.mlp."
        logits = linear(x, self.w(p + "gate.weight"))
        probs = torch.softmax(logits.float(), dim=-1)
        topw, topi = torch.topk(probs, d.top_k, dim=-1)
        if d.norm_topk_prob:
            topw = topw / topw.sum(dim=-1, keepdim=True)
        topw = topw.to(x.dtype)
        out = torch.zeros(x.shape[0], d.top_k, d.hidden, dtype=x.dtype)
        for e in torch.unique(topi).tolist():
            tok, slot = (topi == e).nonzero(as_tuple=True)
            xe = x[tok]
            h = torch.nn.functional.silu(linear(xe, self.w(p + f"experts.{e}.gate_proj.weight")))
            h = h * linear(xe, self.w(p + f"experts.{e}.up_proj.weight"))
            out[tok, slot] = linear(h, self.w(p + f"experts.{e}.down_proj.weight"))
        acc = out[:, 0] * topw[:, 0:1]
        for s in range(1, d.top_k):   # fixed slot order
            acc = acc + out[:, s] * topw[:, s:s + 1]
        return acc

    def attention(self, i: int, x: torch.Tensor, positions: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
        d, p = self.dims, f"model.layers.{i}.self_attn."
        T = x.shape[0]
        q = linear(x, self.w(p + "q_proj.weight")).view(T, d.heads, d.head_dim)
        k = linear(x, self.w(p + "k_proj.weight")).view(T, d.kv_heads, d.head_dim)
        v = linear(x, self.w(p + "v_proj.weight")).view(T, d.kv_heads, d.head_dim)
        q = inv_rms_norm(q.reshape(-1, d.head_dim), self.w(p + "q_norm.weight"),
                         d.eps).view(T, d.heads, d.head_dim)
        k = inv_rms_norm(k.reshape(-1, d.head_dim), self.w(p + "k_norm.weight"),
                         d.eps).view(T, d.kv_heads, d.head_dim)
        q, k = rope(q, positions, d.rope_theta), rope(k, positions, d.rope_theta)
        o = attend(i, q, k, v)
        return linear(o.reshape(T, d.heads * d.head_dim), self.w(p + "o_proj.weight"))

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attend: Attend) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` of a flat token stream."""
        d = self.dims
        h = self.embed(input_ids)
        for i in range(d.layers):
            p = f"model.layers.{i}."
            a = self.attention(i, inv_rms_norm(h, self.w(p + "input_layernorm.weight"), d.eps),
                               positions, attend)
            h = h + a
            m = self.moe(i, inv_rms_norm(h, self.w(p + "post_attention_layernorm.weight"), d.eps))
            h = h + m
        return inv_rms_norm(h, self.w("model.norm.weight"), d.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm-head in the model dtype, as vLLM computes logits."""
        return linear(hidden, self.w("lm_head.weight"))

    # ---- trainer side -------------------------------------------------------------------
    def sequence_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of one whole sequence (prefill over itself)."""
        scale = self.dims.head_dim ** -0.5
        positions = torch.arange(ids.shape[0])
        return self.forward_tokens(ids, positions,
                                   lambda i, q, k, v: attend_one_sequence(q, k, v, scale))

    def packed_hidden(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states of several whole sequences packed back to back into one forward
        (attention stays within each sequence). Row for row equal to ``sequence_hidden``."""
        scale = self.dims.head_dim ** -0.5
        lens = [len(s) for s in seqs]
        ids = torch.cat(seqs)
        positions = torch.cat([torch.arange(n) for n in lens])
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)

        def attend(i, q, k, v):
            return torch.cat([attend_one_sequence(q[a:b], k[a:b], v[a:b], scale)
                              for a, b in zip(bounds[:-1], bounds[1:])])
        return self.forward_tokens(ids, positions, attend)


def invariant_trainer_logprobs(model: InvariantQwen3Moe, rollout, *, batch_size: int = 4,
                               temperature: float | None = None):
    """Response-token logprobs with the invariant forward (packed batches, no padding), fp32
    log-softmax of the model-dtype logits at the rollout's temperature — vLLM's processed
    logprobs, computed the same way."""
    import numpy as np

    from skyrl_numerics.trainer.logprobs import TrainerLogprobs

    if temperature is None:
        temperature = float(rollout.sampling.get("temperature", 1.0) or 1.0)
    lp_out = np.empty(rollout.num_response_tokens, dtype=np.float32)
    ent_out = np.empty(rollout.num_response_tokens, dtype=np.float32)
    with torch.no_grad():
        for start in range(0, len(rollout), batch_size):
            rows = list(range(start, min(start + batch_size, len(rollout))))
            seqs = [torch.from_numpy(np.concatenate([rollout.prompt(i), rollout.response(i)])
                                     .astype(np.int64)) for i in rows]
            h = model.packed_hidden(seqs)
            off = 0
            for i, s in zip(rows, seqs):
                p, r = int(rollout.prompt_lens[i]), int(rollout.response_lens[i])
                z = model.logits(h[off + p - 1: off + p + r - 1]).float()
                if temperature != 1.0:
                    z = z / temperature
                logp = torch.log_softmax(z, dim=-1)
                tg = torch.from_numpy(rollout.response(i).astype(np.int64))
                a, b = rollout.response_cu[i], rollout.response_cu[i + 1]
                lp_out[a:b] = logp.gather(-1, tg[:, None]).squeeze(-1).numpy()
                ent_out[a:b] = (-(logp.exp() * logp).sum(-1)).numpy()
                off += len(s)
    return TrainerLogprobs(logprobs=lp_out, entropy=ent_out)
