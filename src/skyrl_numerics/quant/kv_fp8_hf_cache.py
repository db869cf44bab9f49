"""A transformers ``Cache`` that stores what an FP8 KV cache would hold, so a trainer's forward
attends over the same quantized keys/values the serving engine read.

``FP8KVCache`` subclasses ``DynamicCache``; each ``update`` rounds the new states through the
cache format before storing and returning them, so every position (the current ones too, as in
vLLM decode, which writes the cache before attending) is seen quantized:

* ``mode="fp8"``: ``fp8_kv_roundtrip`` with per-layer ``k_scale`` / ``v_scale`` (vLLM defaults
  both to 1.0 when a checkpoint has no KV scales). For MLA models (DeepSeek-V3) the two cached
  tensors are the latent ``kv_c`` and the post-RoPE ``k_pe``, and vLLM's ``concat_and_cache_mla``
  quantizes both with the single ``k_scale`` — pass ``mla=True``.
* ``mode="fp8_ds_mla"`` (MLA only): ``ds_mla_roundtrip`` — per-128-tile float32 scales on
  ``kv_c``, ``k_pe`` kept in bf16.

Usage: ``model(ids, past_key_values=FP8KVCache(mode="fp8", mla=True), use_cache=True)``.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from skyrl_numerics.errors import InputError

from .kv_fp8_codec import ds_mla_roundtrip, fp8_kv_roundtrip


def _per_layer(v, layer_idx: int, name: str) -> float:
    if isinstance(v, (list, tuple)):
        if layer_idx >= len(v):
            raise InputError(f"{name} has {len(v)} entries, layer {layer_idx} needs one", field=name)
        return float(v[layer_idx])
    return float(v)


class FP8KVCache(DynamicCache):
    """DynamicCache whose contents went through an FP8 KV cache (see module doc)."""

    def __init__(self, mode: str = "fp8", k_scale=1.0, v_scale=1.0, mla: bool = False, **kwargs):
        super().__init__(**kwargs)
        if mode not in ("fp8", "fp8_ds_mla"):
            raise InputError(f"unknown KV cache mode {mode!r}; expected 'fp8' or 'fp8_ds_mla'", field="mode")
        if mode == "fp8_ds_mla" and not mla:
            raise InputError("fp8_ds_mla is an MLA latent-cache layout; pass mla=True", field="mode")
        self.mode, self.k_scale, self.v_scale, self.mla = mode, k_scale, v_scale, mla

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.mode == "fp8_ds_mla":
            key_states, value_states = ds_mla_roundtrip(key_states, value_states)
        else:
            ks = _per_layer(self.k_scale, layer_idx, "k_scale")
            vs = ks if self.mla else _per_layer(self.v_scale, layer_idx, "v_scale")
            key_states, value_states = fp8_kv_roundtrip(key_states, ks), fp8_kv_roundtrip(value_states, vs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def token_logprobs(model, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
    """log p(x_t | x_<t) for t >= 1 from one forward pass (float32), optionally through ``cache``."""
    kw = {"past_key_values": cache, "use_cache": True} if cache is not None else {"use_cache": False}
    logits = model(input_ids, **kw).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1)
    return lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def kv_cache_logprob_effect(model, input_ids: torch.Tensor, **cache_opts) -> dict:
    """How much an FP8 KV cache moves the model's token logprobs: mean / max |delta|."""
    base = token_logprobs(model, input_ids)
    quant = token_logprobs(model, input_ids, FP8KVCache(**cache_opts))
    d = (quant - base).abs()
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()),
            "frac_bitwise_equal": float((quant == base).float().mean())}
