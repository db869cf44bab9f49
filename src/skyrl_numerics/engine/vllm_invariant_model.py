"""The batch-invariant families as vLLM out-of-tree models (``SkyrlInvariant<Family>ForCausalLM``).

Registered by the ``vllm.general_plugins`` entry point (``skyrl_numerics.engine.vllm_plugin``)
and selected per engine with ``hf_overrides`` (:func:`engine_overrides`), so the checkpoint stays
a plain HF checkpoint. vLLM keeps doing what it is good at — scheduling, continuous batching,
chunked prefill, prefix caching, the paged KV cache, sampling — while every number of the
forward comes from :mod:`skyrl_numerics.invariant`, the code the trainer runs.

KV cache: vLLM's ``Attention`` layers are created only so vLLM allocates and binds a cache per
layer and builds the per-step metadata; nothing of vLLM reads it. Each layer's cache is used as
raw bytes, one slot (``block * block_size + offset``) per token holding that token's row in the
family's :class:`~skyrl_numerics.invariant.kv_format.KVFormat` (K/V for GQA, the
``kv_lora_rank + rope`` latent for MLA; bf16, FP8 or ``fp8_ds_mla``). The layers are sized as
``num_kv_heads = ceil(row_bytes / (2 · 64 · itemsize))`` heads of 64 so a slot holds a row. Per
step this model writes the new rows at ``slot_mapping`` (``encode``), reads each request's rows
back through its block table (``decode``), and calls the family's ``attn_core`` — the trainer
calls the same ``attn_core`` on the same decoded rows. On CPU with the ``auto`` format (rows
stored as they are) the family's ``attn_core_paged`` instead hands the cache's slots and each
request's slot list to the attention kernel, which reads the rows in place (the same values,
so the same bits: tested).

Hybrid families (Qwen3-Next's Gated DeltaNet, Nemotron-H's Mamba-2): only their attention layers
get an ``Attention``; each recurrent layer gets a ``MambaBase`` layer instead, so vLLM keeps the
layer's per-request state in its Mamba state cache, and the family's ``recurrent`` keeper reads
and writes it (:mod:`.vllm_hybrid_state`). vLLM enlarges the block size of such an engine after
the model is built (an attention page must hold a state page), so the block size is read per step.

MLA checkpoints are handed to vLLM with ``model_type`` overridden (``skyrl_invariant_<type>``):
for a DeepSeek ``model_type`` vLLM would switch to its own MLA cache handling, and on CPU without
AMX it also turns chunked prefill and prefix caching off. This model manages its latent cache
itself, so vLLM must treat it as an ordinary decoder.
"""
from __future__ import annotations

import json
from typing import Iterable

import torch
from torch import nn

from skyrl_numerics.invariant import FAMILIES, family_class, unsupported_message
from skyrl_numerics.invariant.multimodal import (TEXT_ARCHITECTURE, nested_overrides, text_config,
                                                 text_fields, text_weight_name)

SLOT_HEAD = 64
# HF architecture -> the architecture name vLLM knows our invariant model by
ARCHS = {hf: f"SkyrlInvariant{hf}" for hf in FAMILIES}
ARCH = ARCHS["Qwen3MoeForCausalLM"]     # kept for callers of the Qwen3-MoE-only API


def engine_overrides(hf_config: dict, kv_cache=None, numerics=None, model_dir=None) -> dict:
    """``hf_overrides`` that make vLLM run the invariant model for this checkpoint config
    (``config.json`` as a dict). Errors name the config field the family cannot reproduce.
    ``numerics``: a :class:`~skyrl_numerics.invariant.numerics.NumericsPlan` (or its
    JSON) — the quantized serving formats and LoRA adapters the engine computes with, checked
    against the model's linears here, before any engine starts. A checkpoint a vendor quantized
    (its ``quantization_config``, or ``model_dir``'s ``hf_quant_config.json``) is served from its
    stored codes + scales with the plan its config describes
    (:mod:`skyrl_numerics.invariant.vendor_plan`; ``numerics`` may add LoRA); a config
    it cannot serve is refused naming the field."""
    from types import SimpleNamespace

    from skyrl_numerics.errors import InputError
    from skyrl_numerics.invariant.kv_format import parse_kv_spec

    archs = hf_config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHS:
        raise InputError(unsupported_message(archs[0] if len(archs) == 1 else archs),
                         field="architectures")
    from skyrl_numerics.invariant import vendor_plan

    quant = vendor_plan.vendor_quant_config(model_dir, hf_config)
    spec = parse_kv_spec(kv_cache)
    multimodal = archs[0] in TEXT_ARCHITECTURE    # its language model, text only (.multimodal)
    if multimodal and (not isinstance(hf_config.get("text_config"), dict) or quant is not None):
        raise InputError(f"{archs[0]}: " + ("a vendor-quantized multimodal checkpoint is not "
                                            "served by the batch-invariant path" if quant else
                                            "no text_config"),
                         field="quantization_config" if quant else "text_config")
    text = text_fields(hf_config)
    # build the family's dims now: an unsupported field fails here, before any engine starts
    cfg = SimpleNamespace(**text)
    family = family_class(archs[0])
    family.config_parts(cfg, kv_cache=spec)
    text_over = family.engine_config_overrides(text)
    over = {"architectures": [ARCHS[archs[0]]], "skyrl_base_arch": archs[0],
            "skyrl_kv_cache": json.dumps(spec),
            **(nested_overrides(text_over, hf_config["text_config"]) if multimodal else text_over)}
    if quant is not None:
        numerics = vendor_plan.vendor_numerics(hf_config, quant, numerics, kv_cache=spec)
        over.update(vendor_plan.vendor_overrides(quant))
    if numerics is not None:
        from skyrl_numerics.invariant.numerics import NumericsPlan, check_plan_for_config

        plan = NumericsPlan.from_json(numerics)
        check_plan_for_config(plan, hf_config, kv_cache=spec)
        over["skyrl_numerics"] = plan.to_json()
    if hf_config.get("kv_lora_rank") is not None:
        over["model_type"] = f"skyrl_invariant_{hf_config.get('model_type', 'mla')}"
    return over


class RouteTap(nn.Module):
    """One MoE layer of our model as vLLM's ``RoutedExpertsCaptureSource`` (a protocol: a module
    with ``layer_id`` and ``capture_fn``). vLLM 0.30's V1 runner serves
    ``--enable-return-routed-experts`` by binding its capturer to such modules and to its own
    ``MoERunner`` routers (``bind_routed_experts_capturer``), and refuses to start when it finds
    neither ("No supported MoE router found for routed-experts capture"): our routers are not its
    ``MoERunner``, so each MoE layer gets a tap its capturer binds to. (vLLM 0.31 and later fill
    ``routed_experts`` on CPU through ``aux_outputs.AuxOutputs``, which sets the model's
    ``route_hook`` itself.)"""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn = None


class _SkyrlInvariantForCausalLM(nn.Module):
    skyrl_invariant = True   # in-place weight updates go through load_weights (sync/vllm.py)
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        cfg = vllm_config.model_config.hf_config
        if vllm_config.device_config.device_type == "cpu":
            from .heap import keep_heap

            keep_heap()          # per-step buffers stay mapped (heap.py: ~1 ms a decode step)
        base = getattr(cfg, "skyrl_base_arch", None) or self.hf_arch
        spec = json.loads(getattr(cfg, "skyrl_kv_cache", None) or '{"format": "auto"}')
        # the engine never trains: quantized weights are kept packed (codes + scales)
        self.core = family_class(base).from_config(text_config(cfg, base),
                                                   dtype=vllm_config.model_config.dtype,
                                                   kv_cache=spec, pack=True,
                                                   numerics=getattr(cfg, "skyrl_numerics", None))
        self.kv = self.core.kv
        # read per step: a hybrid engine enlarges the block size after the model is built
        # (the attention page must hold a Mamba state page: Platform.update_block_size_for_backend)
        self._cache_config = vllm_config.cache_config
        self.layers = self.core.dims.layers
        layer_ids = self.core.moe_layer_ids()
        if layer_ids is not None:
            self.route_taps = nn.ModuleList(RouteTap(i) for i in layer_ids)
            self.core.route_hook = self._tap

        self._step_plan = None
        self._slot_views: dict[int, tuple] = {}   # layer -> (cache identity, its slot view)
        # the DSA indexer's choices of every scheduled token, per layer (index_capture.py)
        self.index_capture = None
        item = torch.finfo(vllm_config.model_config.dtype).bits // 8
        heads = -(-self.kv.row_bytes // (2 * SLOT_HEAD * item))
        linear = set(self.core.linear_layers()) if hasattr(self.core, "linear_layers") else set()
        self.attn = nn.ModuleList([
            nn.Identity() if i in linear else
            Attention(heads, SLOT_HEAD, 1.0, num_kv_heads=heads,
                      cache_config=vllm_config.cache_config,
                      prefix=f"model.layers.{i}.self_attn.attn")
            for i in range(self.layers)])
        if linear:       # recurrent layers: their state in vLLM's Mamba cache (vllm_hybrid_state)
            from .vllm_hybrid_state import EngineRecurrentState, RecurrentStateLayer

            order = sorted(linear)
            self.recurrent_state = nn.ModuleList(
                RecurrentStateLayer(self.core.state_shapes(), vllm_config.model_config.dtype,
                                    f"model.layers.{i}.linear_attn", vllm_config) for i in order)
            self.core.recurrent = EngineRecurrentState(dict(zip(order, self.recurrent_state)))

    @property
    def block_size(self) -> int:
        return int(self._cache_config.block_size)

    def _tap(self, moe_layer: int, ids: torch.Tensor) -> None:
        fn = self.route_taps[moe_layer].capture_fn
        if fn is not None:
            fn(ids)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.core.embed(input_ids)

    # ---- the paged cache as bytes ---------------------------------------------------------
    def _slots(self, i: int) -> torch.Tensor:
        kv = self.attn[i].kv_cache
        if isinstance(kv, (list, tuple)):
            from vllm.forward_context import get_forward_context

            kv = kv[get_forward_context().virtual_engine]
        key = (kv.data_ptr(), kv.numel(), kv.dtype)
        hit = self._slot_views.get(i)
        if hit is not None and hit[0] == key:     # (the views cost ~50 us a layer per step)
            return hit[1]
        per_slot = 2 * self.attn[i].num_kv_heads * SLOT_HEAD * kv.element_size()
        unit = _word(per_slot, self.kv.row_bytes)
        flat = kv.view(-1).view(torch.uint8).view(unit)   # raises rather than copy if not contiguous
        size = torch.tensor([], dtype=unit).element_size()
        view = flat.view(-1, per_slot // size)[:, :self.kv.row_bytes // size]
        self._slot_views[i] = (key, view)
        return view

    def _plan(self, meta, device):
        """The step's request groups, computed once per forward (every layer shares the block
        table): requests with the same number of queries (all decodes: 1) share one attention
        call over a right-padded batch; ``kv_lens`` keeps each request's bits what they are alone
        (tested). Returns (slots to write, groups); per group: (number of requests, query index
        or None when the group is every token in order, queries per request, longest length,
        kv lengths, flat slot index). Padding rows read slot 0; the attention never reads them
        (``kv_lens``). (The padded batch is the CPU path's; on GPU each request runs alone.)"""
        if self._step_plan is not None:
            return self._step_plan
        import numpy as np

        n_tok = int(meta.num_actual_tokens)
        qsl = meta.query_start_loc.cpu().numpy().astype(np.int64)
        seq_lens = meta.seq_lens.cpu().numpy().astype(np.int64)
        bs = self.block_size
        counts = np.diff(qsl)
        # only the rows and columns in use go to the host (on CPU: a view)
        cols = -(-int(seq_lens[:len(counts)].max(initial=1)) // bs)
        table = meta.block_table[:len(counts), :cols].cpu().numpy()
        live = np.flatnonzero(counts > 0)
        if device.type == "cpu":           # requests with the same query count share a call
            keys = counts[live]
            by_len = [live[keys == c] for c in dict.fromkeys(keys.tolist())]
        else:
            by_len = [live[j:j + 1] for j in range(len(live))]
        on = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        groups = []
        for reqs in by_len:
            lens = seq_lens[reqs]
            L = int(lens.max())
            nblk = -(-L // bs)
            blocks = table[reqs, :nblk].astype(np.int64)                        # [n, nblk]
            idx = (blocks[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(len(reqs), -1)
            pad = np.arange(L)[None, :] >= lens[:, None]                       # [n, L]
            idx = np.where(pad, 0, idx[:, :L])     # padding reads slot 0 (never attended to)
            sq = int(counts[reqs[0]])
            qidx = (qsl[reqs][:, None] + np.arange(sq)[None, :]).reshape(-1)
            in_order = len(qidx) == n_tok and bool((qidx == np.arange(n_tok)).all())
            groups.append((len(reqs), None if in_order else on(qidx), sq, L,
                           torch.from_numpy(lens) if len(reqs) > 1 else None,
                           on(idx.reshape(-1))))
        self._step_plan = (meta.slot_mapping[:n_tok].long(), groups)
        return self._step_plan

    def _attend(self, i: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            meta = meta.get(self.attn[i].layer_name)
        if meta is None:  # profiling / dummy run: no cache, one causal sequence
            return self.core._own_sequence_attend(i, q, rows)
        slots, groups = self._plan(meta, q.device)
        n = slots.shape[0]
        cache = self._slots(i)
        cache[slots] = self.kv.encode(i, rows[:n]).view(cache.dtype)
        out = None
        # bf16/fp16 rows on CPU: the kernel reads them in the cache, through the slots
        pool = (cache.view(self.kv.dtype) if q.device.type == "cpu" and self.kv.format == "auto"
                else None)
        chosen = self._index_rows(n) if self.index_capture is not None else None
        for nreq, qidx, sq, L, kv_lens, idx in groups:
            if qidx is None and q.shape[0] != n:
                qidx = torch.arange(n, device=q.device)
            qg = (q if qidx is None else q[qidx]).view(nreq, sq, *q.shape[1:])
            if chosen is not None:
                prev, self.core.index_hook = (self.core.index_hook,
                                              lambda _l, sel, _c, _at=qidx: chosen.put(_at, sel))
            try:
                if pool is not None:
                    o = self.core.attn_core_paged(i, qg, pool, idx.view(nreq, L), kv_lens)
                else:
                    data = cache.index_select(0, idx)             # (3x faster than cache[idx])
                    R = self.kv.decode(i, data.view(nreq, L, -1).view(torch.uint8))
                    o = self.core.attn_core(i, qg, R, kv_lens)
            finally:
                if chosen is not None:
                    self.core.index_hook = prev
            if qidx is None:                            # one group: every token, in order
                if chosen is not None:
                    self.index_capture(i, chosen.rows)
                return o.reshape(-1, *o.shape[2:])
            if out is None:
                out = q.new_zeros((q.shape[0],) + tuple(o.shape[2:]))
            out[qidx] = o.reshape(-1, *o.shape[2:])
        if out is None:
            return self.core._own_sequence_attend(i, q, rows)
        if chosen is not None:
            self.index_capture(i, chosen.rows)
        return out

    def _index_rows(self, n: int) -> "IndexRows":
        return IndexRows(torch.zeros((n, self.core.index.topk), dtype=torch.int64))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds=None, **kwargs) -> torch.Tensor:
        self._step_plan = None
        return self.core.forward_tokens(input_ids, positions, self._attend)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.core.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.hf_arch in TEXT_ARCHITECTURE:     # a multimodal checkpoint: its language model
            weights = ((text_weight_name(n), t) for n, t in weights)
        kept = ((n, t) for n, t in weights if n is not None and not self.core.ignored_weight(n))
        loaded = self.core.load_named(kept)
        # adapters start at the plan's own values (numerics.init_adapter), as the trainer's do
        return {f"core.params.{self.core._names[n]}"
                for n in loaded | set(self.core.adapter_names()) if n not in self.core._packed}


class IndexRows:
    """One layer's indexer choices of every scheduled token in token order, assembled from the
    request groups' ``index_hook`` calls (a group's rows are tokens ``qidx``, or all in order;
    a group with fewer keys than ``topk`` fills the leading columns, the rest stay 0)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def put(self, at, sel: torch.Tensor) -> None:
        k = sel.shape[1]
        if at is None:
            self.rows[:, :k] = sel
        else:
            self.rows[at, :k] = sel


class _SkyrlInvariantHybridForCausalLM(_SkyrlInvariantForCausalLM):
    """A family with recurrent layers (Qwen3-Next, Nemotron-H): vLLM's ``IsHybrid`` / ``HasInnerState``
    interface (class attributes and the state classmethods vLLM sizes its Mamba cache pages
    with), the state itself kept by :mod:`.vllm_hybrid_state` in the shapes and dtypes the
    trainer's recurrence carries."""
    is_hybrid = True
    has_inner_state = True

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        cfg = vllm_config.model_config.hf_text_config
        base = getattr(cfg, "skyrl_base_arch", None) or cls.hf_arch
        return family_class(base).state_shapes_of_config(cfg)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        from .vllm_hybrid_state import state_dtypes

        return state_dtypes(vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types):
        """(``IsHybrid``'s own, which this class does not inherit: vLLM is imported lazily.)
        The prefix cache's "align" mode copies a request's state to its next block with these."""
        funcs = cls.get_mamba_state_copy_func()
        return {t: funcs for t in mamba_types}


HYBRID = {"Qwen3NextForCausalLM", "NemotronHForCausalLM", "Qwen3_5ForCausalLM",
          "Qwen3_5MoeForCausalLM", *TEXT_ARCHITECTURE}


def _word(per_slot: int, row_bytes: int) -> torch.dtype:
    """The widest integer type whose size divides both the slot and the row (byte rows are
    gathered and written as words: same bytes, far fewer elements)."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if per_slot % size == 0 and row_bytes % size == 0:
            return dt
    return torch.uint8


def _make(hf_arch: str):
    base = _SkyrlInvariantHybridForCausalLM if hf_arch in HYBRID else _SkyrlInvariantForCausalLM
    return type(ARCHS[hf_arch], (base,), {"hf_arch": hf_arch})


SkyrlInvariantQwen3MoeForCausalLM = _make("Qwen3MoeForCausalLM")
SkyrlInvariantDeepseekV3ForCausalLM = _make("DeepseekV3ForCausalLM")
SkyrlInvariantDeepseekV32ForCausalLM = _make("DeepseekV32ForCausalLM")
SkyrlInvariantQwen3ForCausalLM = _make("Qwen3ForCausalLM")
SkyrlInvariantLlamaForCausalLM = _make("LlamaForCausalLM")
SkyrlInvariantQwen2ForCausalLM = _make("Qwen2ForCausalLM")
SkyrlInvariantMistralForCausalLM = _make("MistralForCausalLM")
SkyrlInvariantGptOssForCausalLM = _make("GptOssForCausalLM")
SkyrlInvariantMixtralForCausalLM = _make("MixtralForCausalLM")
SkyrlInvariantGlm4MoeForCausalLM = _make("Glm4MoeForCausalLM")
SkyrlInvariantQwen3NextForCausalLM = _make("Qwen3NextForCausalLM")
SkyrlInvariantNemotronHForCausalLM = _make("NemotronHForCausalLM")
SkyrlInvariantQwen3_5ForCausalLM = _make("Qwen3_5ForCausalLM")
SkyrlInvariantQwen3_5MoeForCausalLM = _make("Qwen3_5MoeForCausalLM")
SkyrlInvariantQwen3_5ForConditionalGeneration = _make("Qwen3_5ForConditionalGeneration")
SkyrlInvariantQwen3_5MoeForConditionalGeneration = _make("Qwen3_5MoeForConditionalGeneration")
