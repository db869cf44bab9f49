"""A hybrid invariant family's recurrent state in vLLM's own Mamba state cache (Qwen3-Next's
Gated DeltaNet layers, Nemotron-H's Mamba-2 layers).

vLLM allocates and schedules per-request recurrent state for layers that are
``MambaBase``: each such layer declares its state shapes and dtypes, vLLM gives it a
``MambaSpec`` KV-cache group (one state slot per running request with prefix caching off,
``mamba_cache_mode="none"``; one per block of the request in "align" mode, the prefix cache's)
and binds the slots to ``layer.kv_cache = (conv [slots, K-1, C], S [slots, ...])``.
:class:`RecurrentStateLayer` is such a layer that runs nothing itself. Both families use vLLM's
Gated DeltaNet metadata (``mamba_type`` ``gdn_attention``) as the per-step bookkeeping — it
carries what the keeper needs and nothing kernel-specific: ``non_spec_state_indices_tensor``
(each request's current slot; in "align" mode vLLM copies a request's state into the slot of
its next block itself) and ``non_spec_query_start_loc`` (its tokens). The state shapes are the
family's own. :class:`EngineRecurrentState` is the invariant model's state keeper
(``model.recurrent``, see :mod:`skyrl_numerics.invariant.qwen3_next`): per recurrent layer and
step it reads each request's state from its slot (zero when the request's first token this step
is at position 0: a new or recomputed request), runs the family's own ``scan`` — the trainer's
code — and writes the state back. Requests with the same number of new tokens share one scan
call (every op is per row, so each keeps the bits it has alone: tested in
tests/invariant/test_qwen3_next.py).

The state is stored exactly: the conv inputs in the model dtype, S in float32 (the dtypes the
trainer's recurrence carries), so a prefill, a chunked prefill and decodes give the trainer's
bits. vLLM's own ``mamba_ssm_cache_dtype`` is not consulted: these layers fix it.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum


def state_dtypes(model_dtype: torch.dtype) -> tuple:
    """``(conv, S)`` dtypes: the conv inputs as the model computes them, S in float32."""
    return (model_dtype, torch.float32)


class RecurrentStateLayer(nn.Module, MambaBase):
    """One recurrent layer's state slots in vLLM's Mamba cache (registered under ``prefix`` in
    the compilation config's forward context, like vLLM's own GDN layer)."""

    def __init__(self, shapes: tuple, dtype: torch.dtype, prefix: str, vllm_config):
        super().__init__()
        if vllm_config.speculative_config is not None:
            from skyrl_numerics.errors import InputError

            raise InputError("speculative decoding with a hybrid invariant model: its "
                             "per-draft-token state slots (spec_state_indices_tensor) are not "
                             "kept by the invariant state keeper", field="speculative_config")
        self.shapes, self.dtype, self.prefix = tuple(shapes), dtype, prefix
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return state_dtypes(self.dtype)

    @property
    def mamba_type(self):
        return MambaAttentionBackendEnum.GDN_ATTN


class EngineRecurrentState:
    """The invariant model's state keeper inside vLLM (module doc); ``layers``: decoder layer
    index -> its :class:`RecurrentStateLayer`."""

    def __init__(self, layers: dict):
        self.layers = layers

    def mix(self, model, i: int, qkv: torch.Tensor, beta: torch.Tensor, decay_log: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        from skyrl_numerics.invariant.recurrent import FreshSequences

        layer = self.layers[i]
        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            meta = meta.get(layer.prefix)
        if meta is None:          # profiling / dummy run: no state cache, whole sequences
            return FreshSequences().mix(model, i, qkv, beta, decay_log, positions)
        qsl = meta.non_spec_query_start_loc.cpu().numpy().astype(np.int64)
        n_req = len(qsl) - 1
        slots = meta.non_spec_state_indices_tensor[:n_req].long()
        conv_cache, ssm_cache = layer.kv_cache
        counts = np.diff(qsl)
        live = np.flatnonzero(counts > 0)
        out = None
        for c in dict.fromkeys(counts[live].tolist()):
            reqs = live[counts[live] == c]
            rows = torch.from_numpy(qsl[reqs][:, None] + np.arange(c)[None, :])      # [n, c]
            idx = slots[torch.from_numpy(reqs)]
            fresh = (positions[rows[:, 0]] == 0)[:, None, None]
            conv0 = torch.where(fresh, 0, conv_cache[idx].to(model.dtype))
            S0 = torch.where(fresh[..., None], 0, ssm_cache[idx].float())
            o, conv, S = model.scan(i, qkv[rows], beta[rows], decay_log[rows], conv0, S0)
            conv_cache[idx] = conv.to(conv_cache.dtype)
            ssm_cache[idx] = S.to(ssm_cache.dtype)
            if out is None:
                out = o.new_zeros((qkv.shape[0],) + tuple(o.shape[2:]))
            out[rows.reshape(-1)] = o.reshape(-1, *o.shape[2:])
        return out
