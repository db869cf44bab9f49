"""The batch-invariant Qwen3-MoE as a vLLM out-of-tree model (``SkyrlInvariantQwen3MoeForCausalLM``).

Registered by the ``vllm.general_plugins`` entry point (``skyrl_numerics.trainer.engine.vllm_plugin``)
and selected per engine with ``hf_overrides={"architectures": [ARCH]}``, so the checkpoint stays
a plain HF Qwen3-MoE. vLLM keeps doing what it is good at — scheduling, continuous batching,
prefix caching, the paged KV cache, sampling — while every number of the forward comes from
:mod:`skyrl_numerics.trainer.invariant.qwen3_moe`, the function the trainer runs.

Attention: vLLM's ``Attention`` layers are created only so vLLM allocates and binds a KV cache
per layer and builds the per-step metadata. This model writes K/V into that cache itself
(``slot_mapping``) and reads each request's keys back through its block table, then calls the
same invariant attention as the trainer. The cache tensor is used as a flat
``[2, slots, kv_heads, head_dim]`` store; nothing else reads it.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from skyrl_numerics.kernels import attention as inv_attention

from ..invariant.qwen3_moe import Dims, InvariantQwen3Moe, attend_one_sequence

ARCH = "SkyrlInvariantQwen3MoeForCausalLM"


class SkyrlInvariantQwen3MoeForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        cfg = vllm_config.model_config.hf_config
        self.dims = d = Dims.from_config(cfg)
        self.core = InvariantQwen3Moe(d, dtype=vllm_config.model_config.dtype)
        self.block_size = vllm_config.cache_config.block_size
        self.scale = d.head_dim ** -0.5
        self.attn = nn.ModuleList([
            Attention(d.heads, d.head_dim, self.scale, num_kv_heads=d.kv_heads,
                      cache_config=vllm_config.cache_config,
                      prefix=f"model.layers.{i}.self_attn.attn")
            for i in range(d.layers)])

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.core.embed(input_ids)

    # ---- attention over the paged cache ---------------------------------------------------
    def _cache(self, i: int) -> torch.Tensor:
        kv = self.attn[i].kv_cache
        if isinstance(kv, (list, tuple)):
            from vllm.forward_context import get_forward_context

            kv = kv[get_forward_context().virtual_engine]
        return kv.view(2, -1, self.dims.kv_heads, self.dims.head_dim)

    def _attend(self, i: int, q, k, v):
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            meta = meta.get(self.attn[i].layer_name)
        if meta is None:  # profiling / dummy run: no cache, one causal sequence
            return attend_one_sequence(q, k, v, self.scale)
        n = int(meta.num_actual_tokens)
        cache = self._cache(i)
        slots = meta.slot_mapping[:n].long()
        cache[0, slots] = k[:n].to(cache.dtype)
        cache[1, slots] = v[:n].to(cache.dtype)
        qsl = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        out = torch.zeros_like(q)
        bs = self.block_size
        # Requests with the same number of queries this step (all decodes: 1) share one call over
        # a right-padded batch; kv_lens keeps each request's bits what they are alone (tested).
        # (The padded batch is the CPU path's; on GPU each request runs alone.)
        batched = q.device.type == "cpu"
        by_len: dict[int, list[int]] = {}
        for r in range(len(qsl) - 1):
            if qsl[r + 1] > qsl[r]:
                by_len.setdefault(qsl[r + 1] - qsl[r] if batched else -r, []).append(r)
        for reqs in by_len.values():
            lens = [seq_lens[r] for r in reqs]
            L = max(lens)
            K = q.new_zeros((len(reqs), L, self.dims.kv_heads, self.dims.head_dim))
            V = torch.zeros_like(K)
            for j, r in enumerate(reqs):
                nblk = -(-lens[j] // bs)
                blocks = meta.block_table[r, :nblk].long()
                idx = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)[:lens[j]]
                K[j, :lens[j]] = cache[0, idx].to(q.dtype)
                V[j, :lens[j]] = cache[1, idx].to(q.dtype)
            Q = torch.stack([q[qsl[r]:qsl[r + 1]] for r in reqs])          # (n, sq, H, D)
            o = inv_attention(Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2),
                              causal=True, scale=self.scale,
                              kv_lens=torch.tensor(lens) if len(reqs) > 1 else None)
            for j, r in enumerate(reqs):
                out[qsl[r]:qsl[r + 1]] = o[j].transpose(0, 1)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None, **kwargs) -> torch.Tensor:
        return self.core.forward_tokens(input_ids, positions, self._attend)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.core.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self.core.load_named(weights)
        return {f"core.params.{self.core._names[n]}" for n in loaded}
