"""What every invariant family shares: weights under HF names, the KV-cache row contract, the
trainer-side sequence forwards and the trainer logprobs.

A family module subclasses :class:`InvariantCausalLM` and defines ``__init__`` (its parameters),
``forward_tokens(ids, positions, attend)``, ``attn_core`` and ``kv`` (a
:class:`~skyrl_numerics.invariant.kv_format.KVFormat`). Attention is split so that both
callers run the same numbers:

    the family computes per token:  q [T, H, Dq]  and its cache row  r [T, W]  (model dtype)
    attend(layer, q, r)   trainer: rows of the token's own sequence, each sent through the cache
                                   format (``kv.roundtrip``)
                          vLLM:    rows written into the paged cache as bytes (``kv.encode``),
                                   each request's rows read back through its block table
                                   (``kv.decode``)
    both then call  attn_core(layer, q [n, Sq, H, Dq], rows [n, L, W], kv_lens) -> [n, Sq, H, Do]

``attn_core`` is built on :func:`skyrl_numerics.kernels.attention`, whose result for a query does
not depend on Sq (prefill vs decode) nor on padding to other requests' lengths (``kv_lens``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from skyrl_numerics.errors import InputError

from skyrl_numerics.kernels import matmul as inv_matmul

from .blocks import add_rms_norm, linear, rms_norm, routed_experts, sigmoid_group_topk, softmax_topk
from .multimodal import is_multimodal, text_config, text_weight_name

# attend(layer, q [T, H, Dq], rows [T, W]) -> out [T, H, Do]
Attend = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")


def load_checkpoint_tensors(model_dir) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (one ``model.safetensors`` or shards)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InputError(f"{model_dir}: no *.safetensors files", field="model_dir")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


_ST_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
             "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
             "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def checkpoint_files(model_dir) -> list:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InputError(f"{model_dir}: no *.safetensors files", field="model_dir")
    return files


def checkpoint_tensor_names(model_dir) -> list[str]:
    """The tensor names of an HF checkpoint directory (its safetensors headers, checked)."""
    from skyrl_numerics.safetensors_header import read_header

    return [n for f in checkpoint_files(model_dir) for n in read_header(f, str(model_dir))]


def iter_checkpoint_tensors(model_dir, names=None):
    """``(name, tensor)`` of an HF checkpoint directory one tensor at a time (``names``: only
    those), each read into memory of its own with plain file reads: a loader copying each into
    its weights holds one checkpoint tensor beside them, and no mapping of the file (a mapped
    file's pages count in the process's RSS until it is closed)."""
    import struct

    from skyrl_numerics.safetensors_header import read_header

    for f in checkpoint_files(model_dir):
        entries = read_header(f, str(model_dir))
        with open(f, "rb") as fh:
            start = 8 + struct.unpack("<Q", fh.read(8))[0]
            for name, e in entries.items():
                if names is not None and name not in names:
                    continue
                if e["dtype"] not in _ST_TORCH:
                    raise InputError(f"tensor {name!r}: dtype {e['dtype']} is not one of "
                                     f"{sorted(_ST_TORCH)}", source=str(f), field=name)
                lo, hi = e["data_offsets"]
                dtype = _ST_TORCH[e["dtype"]]
                if hi == lo:
                    yield name, torch.empty(e["shape"], dtype=dtype)
                    continue
                buf = bytearray(hi - lo)
                fh.seek(start + lo)
                if fh.readinto(buf) != hi - lo:
                    raise InputError(f"tensor {name!r}: the file ends inside its data",
                                     source=str(f), field=name)
                yield name, torch.frombuffer(buf, dtype=dtype).reshape(e["shape"])


class InvariantCausalLM(nn.Module):
    """Parameters under HF names (``add``/``w``), loading, and the trainer-side forwards."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.params = nn.ParameterDict()
        self._names: dict[str, str] = {}
        self._expert_lists: dict[str, list] = {}
        self.route_hook: Callable[[int, torch.Tensor], None] | None = None
        # quantized serving numerics + LoRA (numerics.py): None = the model dtype throughout
        self.numerics = None
        self._proj: dict = {}              # HF weight name -> numerics.Projection
        self._packed: dict = {}            # HF weight name -> QTensor (frozen, served packed)
        self._packed_shapes: dict = {}
        self._adapters: list[str] = []     # LoRA tensor names, in creation order
        self._alias: dict[str, str] = {}   # a tied lm-head: "lm_head.weight" -> the embeddings

    # ---- weights --------------------------------------------------------------------------
    def add(self, name: str, *shape: int, dtype: torch.dtype | None = None) -> None:
        key = name.replace(".", "__")
        self.params[key] = nn.Parameter(torch.empty(*shape, dtype=dtype or self.dtype),
                                        requires_grad=False)
        self._names[name] = key

    def add_decoder_weights(self, tied: bool = False) -> None:
        """The weights :meth:`forward_tokens` itself uses: embeddings, final norm, lm-head and
        each layer's two RMSNorms (``self.dims``: vocab, hidden, layers). ``tied``
        (``tie_word_embeddings``): the lm-head is the embedding matrix itself — one parameter
        under ``model.embed_tokens.weight``; ``w("lm_head.weight")`` reads it, and a checkpoint's
        own ``lm_head.weight`` is skipped on load, as vLLM skips it."""
        d = self.dims
        self.add("model.embed_tokens.weight", d.vocab, d.hidden)
        self.add("model.norm.weight", d.hidden)
        if tied:
            self._alias["lm_head.weight"] = "model.embed_tokens.weight"
        else:
            self.add("lm_head.weight", d.vocab, d.hidden)
        for i in range(d.layers):
            self.add(f"model.layers.{i}.input_layernorm.weight", d.hidden)
            self.add(f"model.layers.{i}.post_attention_layernorm.weight", d.hidden)

    def add_swiglu(self, prefix: str, inter: int, names: tuple = SWIGLU_NAMES) -> None:
        """A SwiGLU MLP of width ``inter`` under ``{prefix}{gate, up, down}.weight`` (``names``:
        the three projections' names, Mixtral's ``w1, w3, w2``): ``[inter, hidden]`` twice, then
        ``[hidden, inter]`` (``self.dims.hidden``)."""
        h = self.dims.hidden
        for n, shape in zip(names, ((inter, h), (inter, h), (h, inter))):
            self.add(f"{prefix}{n}.weight", *shape)

    def swiglu_weights(self, prefix: str, names: tuple = SWIGLU_NAMES) -> tuple:
        """The projections of the SwiGLU MLP :meth:`add_swiglu` added under ``prefix``."""
        return tuple(self.proj(f"{prefix}{n}.weight") for n in names)

    def softmax_routed(self, moe_layer: int, x: torch.Tensor, prefix: str, num_experts: int,
                       top_k: int, renormalize: bool, names: tuple = SWIGLU_NAMES) -> torch.Tensor:
        """Softmax top-k routed SwiGLU experts (Qwen3-MoE, Qwen3-Next, Mixtral): router logits
        ``x W`` of ``{prefix}gate.weight``, :func:`~.blocks.softmax_topk`, the ids recorded as MoE
        layer ``moe_layer``, experts ``{prefix}experts.<e>.{names}``."""
        w, ids = softmax_topk(linear(x, self.w(prefix + "gate.weight")), top_k, renormalize)
        self._route(moe_layer, ids)
        experts = self.expert_weights(prefix + "experts.", num_experts, names)
        return routed_experts(x, ids, w, experts.__getitem__, num_experts=num_experts)

    def sigmoid_routed(self, moe_layer: int, x: torch.Tensor, prefix: str, d,
                       names: tuple = SWIGLU_NAMES, latent: tuple | None = None) -> torch.Tensor:
        """Sigmoid group-limited top-k routed experts (DeepSeek-V3 ``noaux_tc``, GLM-4-MoE,
        Nemotron-H): fp32 router logits ``x W`` of ``{prefix}gate.weight``,
        :func:`~.blocks.sigmoid_group_topk` with ``{prefix}gate.e_score_correction_bias`` (when
        the model has one) and ``d``'s ``experts, top_k, n_group, topk_group, norm_topk_prob,
        routed_scaling``, the ids recorded as MoE layer ``moe_layer``, experts
        ``{prefix}experts.<e>.{names}`` (three names: SwiGLU, two: ReLU²). ``latent = (W1, W2)``
        (Nemotron-H's LatentMoE): the experts run on ``x W1^T`` and their weighted sum is
        projected back, ``(sum_s w_s expert_s(x W1^T)) W2^T``."""
        logits = inv_matmul(x.float(), self.w(prefix + "gate.weight").float().t())   # fp32 router
        bias_name = prefix + "gate.e_score_correction_bias"
        w, ids = sigmoid_group_topk(logits, self.w(bias_name) if bias_name in self._names else None,
                                    d.top_k, d.n_group, d.topk_group, d.norm_topk_prob,
                                    d.routed_scaling)
        self._route(moe_layer, ids)
        experts = self.expert_weights(prefix + "experts.", d.experts, names)
        xe = x if latent is None else linear(x, latent[0])
        out = routed_experts(xe, ids, w, experts.__getitem__, num_experts=d.experts)
        return out if latent is None else linear(out, latent[1])

    def w(self, name: str) -> torch.Tensor:
        """The weight under an HF name (a packed one decoded: see :meth:`served_weight`)."""
        name = self._alias.get(name, name)
        if name in self._packed:
            return self.served_weight(name)
        # (the ParameterDict's own dict: what params[key] returns, without Module.__getattr__,
        # ~0.8 us a lookup, tens of lookups a forward)
        return self.params._parameters[self._names[name]]

    def proj(self, name: str):
        """What :func:`.blocks.linear` multiplies by for weight ``name``: the weight itself, or
        its :class:`.numerics.Projection` (quantized formats, LoRA) when the plan covers it."""
        p = self._proj.get(name)
        return p if p is not None else self.params._parameters[self._names[name]]

    def served_weight(self, name: str) -> torch.Tensor:
        """Weight ``name`` as the plan serves it: a packed weight decoded, a planned bf16 weight
        fake-quantized (straight-through under grad), any other weight as it is."""
        from . import numerics as N

        if name in self._packed:
            q = self._packed[name]
            if q is None:
                raise InputError(f"packed weight {name!r} was never loaded", field=name)
            return N.decode_weight(q, self.dtype)
        w = self.params[self._names[name]]
        f = self.numerics.format_of(N.group_of(name)) if self.numerics is not None else None
        if f is None or not f.weight:
            return w
        return N._ste(lambda t: N.decode_weight(N.quantize_weight(t, f.weight), t.dtype), w)

    def adapter_names(self) -> list[str]:
        return list(self._adapters)

    def expert_weights(self, prefix: str, num_experts: int, names: tuple = SWIGLU_NAMES) -> list:
        """``[(w_gate, w_up, w_down)]`` of experts ``0 .. E-1`` named ``{prefix}{e}.gate_proj.weight``
        etc. (``names``: the three projections' names, Mixtral's ``w1, w3, w2``): the parameters
        themselves, looked up once per layer (a decode step would otherwise
        spend ~3E dict lookups per layer). Loading copies into these tensors in place; a
        parameter replaced by another object (e.g. wrapped by FSDP) is noticed and looked up again."""
        if f"{prefix}0.{names[0]}.weight" in self._proj:   # planned experts: their projections
            return [tuple(self.proj(f"{prefix}{e}.{n}.weight") for n in names)
                    for e in range(num_experts)]
        hit = self._expert_lists.get(prefix)
        if (hit is None or len(hit) != num_experts
                or hit[0][0] is not self.w(f"{prefix}0.{names[0]}.weight")
                or hit[-1][-1] is not self.w(f"{prefix}{num_experts - 1}.{names[-1]}.weight")):
            hit = [tuple(self.w(f"{prefix}{e}.{n}.weight") for n in names)
                   for e in range(num_experts)]
            self._expert_lists[prefix] = hit
        return hit

    def hf_names(self) -> list[str]:
        return list(self._names)

    def load_named(self, named) -> set[str]:
        """Copy ``(hf_name, tensor)`` pairs in; unknown names and other shapes are an error
        naming the tensor. A packed weight is quantized as it arrives. LoRA adapters are all
        checked first and applied together at the end: an update that fails anywhere leaves
        the adapters as they were."""
        from . import numerics as N

        loaded = set()
        adapters = []
        vendor = getattr(self, "_vendor", None)     # a vendor-quantized checkpoint (vendor_plan.py)
        if vendor is not None:
            named = vendor.take(self, named)        # its weights' stored parts go to the packed storage
        with torch.no_grad():
            for name, t in named:
                if name not in self._names:
                    what = ("an adapter this model's plan does not have (target, name)"
                            if N.is_adapter(name) else "unexpected weight")
                    raise InputError(f"{what} {name!r} for {type(self).__name__}", field=name)
                want = self._packed_shapes.get(name) or tuple(self.params[self._names[name]].shape)
                if tuple(t.shape) != tuple(want):
                    raise InputError(f"tensor {name!r}: shape {tuple(t.shape)}, expected {tuple(want)}"
                                     + (" (the adapter rank differs)" if N.is_adapter(name) else ""),
                                     field=name)
                if name in self._adapters:
                    if not torch.isfinite(t).all():
                        raise InputError(f"adapter {name!r} holds non-finite values", field=name)
                    adapters.append((name, t))
                elif name in self._packed:
                    f = self.numerics.format_of(N.group_of(name))
                    self._packed[name] = N.quantize_weight(t.to(self.dtype), f.weight)
                else:
                    dst = self.params[self._names[name]]
                    dst.copy_(t.to(dst.dtype))
                loaded.add(name)
            for name, t in adapters:
                dst = self.params[self._names[name]]
                dst.copy_(t.to(dst.dtype))
        if vendor is not None:
            vendor.finish(self)
        return loaded

    @classmethod
    def config_parts(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None) -> dict:
        raise NotImplementedError

    @staticmethod
    def engine_config_overrides(hf_config: dict) -> dict:
        """Config fields the vLLM engine must see changed for this family (``hf_overrides``; a
        ``config.json`` dict in): none by default."""
        return {}

    @classmethod
    def from_config(cls, cfg, dtype: torch.dtype = torch.bfloat16, kv_cache=None, numerics=None,
                    pack: bool | None = None):
        """An empty model (weights to be loaded) for an HF config; ``numerics`` a
        :class:`.numerics.NumericsPlan` (or its JSON), ``pack`` whether planned quantized weights
        are kept packed (default: under LoRA, where the base is frozen; an engine always)."""
        model = cls(**cls.config_parts(cfg, dtype=dtype, kv_cache=kv_cache))
        from .numerics import NumericsPlan, attach

        plan = NumericsPlan.from_json(numerics)
        if plan is not None:
            attach(model, plan, pack=pack)
        if getattr(cfg, "skyrl_vendor", None):      # served from a vendor's stored codes + scales
            from .vendor_plan import install

            install(model, cfg.skyrl_vendor)
        return model

    @classmethod
    def from_checkpoint(cls, model_dir, *, kv_cache=None, dtype: torch.dtype = torch.bfloat16,
                        numerics=None):
        """Build from an HF checkpoint directory; ``kv_cache`` as in
        :func:`~skyrl_numerics.invariant.kv_format.parse_kv_spec` (the engine's),
        ``numerics`` as in :meth:`from_config`."""
        from transformers import AutoConfig

        from .vendor_plan import from_vendor_checkpoint, vendor_quant_config

        quant = vendor_quant_config(model_dir)      # a vendor-quantized checkpoint: its own plan
        if quant is not None:
            return from_vendor_checkpoint(cls, model_dir, quant, kv_cache=kv_cache, dtype=dtype,
                                          numerics=numerics)
        cfg = AutoConfig.from_pretrained(str(model_dir))
        # a multimodal checkpoint: its language model's config and weight names (vision skipped)
        rename = text_weight_name if is_multimodal(cfg) else (lambda n: n)
        model = cls.from_config(text_config(cfg), dtype=dtype, kv_cache=kv_cache,
                                numerics=numerics)
        as_text = {n: rename(n) for n in checkpoint_tensor_names(model_dir)}  # read one at a time below
        tensors = [t for t in as_text.values() if t is not None]
        missing = set(model.hf_names()) - set(tensors) - set(model.adapter_names())
        if missing:
            raise InputError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}",
                             source=str(model_dir), field=sorted(missing)[0])
        extra = sorted(k for k in tensors if k not in model._names and not model.ignored_weight(k))
        if extra:
            raise InputError(f"checkpoint has {len(extra)} weights the invariant "
                             f"{type(model).__name__} does not use (it would not reproduce "
                             f"them), e.g. {extra[:3]}", source=str(model_dir), field=extra[0])
        stored = {n for n, t in as_text.items() if t in model._names}
        model.load_named((as_text[n], t) for n, t in iter_checkpoint_tensors(model_dir, names=stored))
        return model.eval()

    def ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors the engine does not run either: a tied lm-head's copy, and the
        multi-token-prediction draft module under ``mtp.`` (Qwen3-Next, Qwen3.5, Nemotron-H ship
        one; vLLM's models drop the prefix unless speculative decoding runs, which the invariant
        engine refuses). Families with MTP layers inside ``model.layers`` add their own rule."""
        return name in self._alias or name.startswith("mtp.")

    # ---- to be provided by the family -----------------------------------------------------
    kv = None   # KVFormat

    def attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
        raise NotImplementedError

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attend: Attend) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` of a flat token stream: pre-norm decoder
        layers ``h += attention(rms_norm(h)); h += ffn(rms_norm(h))`` (HF layer norm names),
        each residual add with the norm after it (:func:`.blocks.add_rms_norm`)."""
        eps, n = self.dims.eps, self.dims.layers
        self._cos_sin = None          # RoPE's cos/sin of these positions: once per forward
        h = self.embed(input_ids)
        norms = [f"model.layers.{i}.{w}" for i in range(n)
                 for w in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        norms.append("model.norm.weight")
        x = rms_norm(h, self.w(norms[0]), eps)
        for i in range(n):
            a = self.attention(i, x, positions, attend)
            h, x = add_rms_norm(h, a, self.w(norms[2 * i + 1]), eps)
            h, x = add_rms_norm(h, self.ffn(i, x), self.w(norms[2 * i + 2]), eps)
        return x

    def attn_core(self, layer: int, q: torch.Tensor, rows: torch.Tensor,
                  kv_lens: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def attn_core_paged(self, layer: int, q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                        kv_lens: torch.Tensor | None) -> torch.Tensor:
        """:meth:`attn_core` over ``pool[slots]`` (``pool [S, width]``: a paged cache's rows in
        the model dtype, ``slots [n, L]`` each request's slots in order), reading the rows in
        place where the family knows how (its ``_paged_kv``) — bit for bit the gathered rows'
        result (tested)."""
        views = self._paged_kv(pool)
        if views is None:
            n, L = slots.shape
            return self.attn_core(layer, q, pool.index_select(0, slots.reshape(-1)).view(n, L, -1),
                                  kv_lens)
        from skyrl_numerics.kernels.cpu_attention import paged_attention

        k_pool, v_pool = views
        lens = kv_lens if kv_lens is not None else torch.full((slots.shape[0],), slots.shape[1])
        return paged_attention(q.transpose(1, 2), k_pool, v_pool, slots, lens,
                               self.scale).transpose(1, 2)

    def _paged_kv(self, pool: torch.Tensor):
        """``(k_pool [S, Hkv, D], v_pool [S, Hkv, Dv])`` views of the cache rows for the paged
        kernel (what :meth:`attn_core` makes of a row: keys, values), or None (gather, then
        :meth:`attn_core`)."""
        return None

    def rope_cos_sin(self, positions: torch.Tensor):
        """``self.rope.cos_sin(positions)``, computed once per :meth:`forward_tokens` (every
        layer rotates at the same positions)."""
        hit = getattr(self, "_cos_sin", None)
        if hit is None or hit[0] is not positions:
            hit = self._cos_sin = (positions, self.rope.cos_sin(positions))
        return hit[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.w("model.embed_tokens.weight")[input_ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm-head in the model dtype, as vLLM computes logits."""
        return linear(hidden, self.w("lm_head.weight"))

    def route_info(self) -> dict:
        """``{"layers", "k", "num_experts"}`` of the MoE layers (for route capture)."""
        raise NotImplementedError

    def moe_layer_ids(self) -> list[int] | None:
        """The decoder-layer index of each MoE layer, in the order ``route_hook`` numbers them
        (``None``: a dense model). A family that lists its routed layers (``dims.moe_layers``:
        Qwen3-MoE's ``mlp_only_layers`` may sit anywhere) gives them; otherwise the dense layers
        lead (DeepSeek's ``first_k_dense_replace``) and the MoE layers are the trailing
        ``route_info()["layers"]``."""
        listed = getattr(self.dims, "moe_layers", None)
        if listed is not None:
            return [int(i) for i in listed]
        n = int(self.dims.layers)
        return list(range(n - int(self.route_info()["layers"]), n))

    def _route(self, moe_layer: int, ids: torch.Tensor) -> None:
        if self.route_hook is not None:
            self.route_hook(moe_layer, ids)

    def attention_op(self, q, k, v, scale: float, kv_lens=None) -> torch.Tensor:
        """The invariant attention kernel; with grad enabled (training) its forward bits are kept
        and the backward comes from the reference formula (:mod:`.train`)."""
        if torch.is_grad_enabled() and kv_lens is None and (q.requires_grad or k.requires_grad
                                                             or v.requires_grad):
            from skyrl_numerics.invariant.autograd import TrainableAttention

            return TrainableAttention.apply(q, k, v, scale)
        if q.device.type == "cpu":
            from skyrl_numerics.kernels import cpu   # what kernels.attention runs on CPU

            return cpu.attention(q, k, v, True, scale, kv_lens=kv_lens)
        from skyrl_numerics.kernels import attention

        return attention(q, k, v, causal=True, scale=scale, kv_lens=kv_lens)

    # ---- trainer side ---------------------------------------------------------------------
    def cache_roundtrip(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows as the engine reads them back from its cache; straight-through under grad."""
        if rows.requires_grad and self.kv.format != "auto":
            from skyrl_numerics.invariant.autograd import StraightThrough

            return StraightThrough.apply(rows, self.kv.roundtrip(layer, rows.detach()))
        return self.kv.roundtrip(layer, rows)

    def _own_sequence_attend(self, layer: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        rows = self.cache_roundtrip(layer, rows)
        return self.attn_core(layer, q[None], rows[None], None)[0]

    def sequence_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states of one whole sequence (prefill over itself)."""
        return self.forward_tokens(ids, torch.arange(ids.shape[0]), self._own_sequence_attend)

    def packed_hidden(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """Several whole sequences back to back in one forward (attention stays within each
        sequence). Row for row equal to :meth:`sequence_hidden`."""
        lens = [len(s) for s in seqs]
        bounds = np.concatenate([[0], np.cumsum(lens)]).tolist()
        positions = torch.cat([torch.arange(n) for n in lens])

        def attend(layer, q, rows):
            return torch.cat([self._own_sequence_attend(layer, q[a:b], rows[a:b])
                              for a, b in zip(bounds[:-1], bounds[1:])])
        return self.forward_tokens(torch.cat(seqs), positions, attend)
