"""Quantized serving numerics and LoRA adapters in the invariant forward (engine and trainer).

A :class:`NumericsPlan` says, per group of linear layers, how a serving engine computes them::

    group       linears                                              (HF names)
    attention   q_proj k_proj v_proj o_proj | q_a_proj q_b_proj kv_a_proj_with_mqa o_proj (MLA)
    dense       mlp.{gate,up,down}_proj of dense layers
    shared      mlp.shared_experts.{gate,up,down}_proj
    experts     mlp.experts.<e>.{gate,up,down}_proj                  (each expert its own weight)

and a projection ``y = x W^T`` of a planned linear becomes, on both sides::

    x_q = A(x)                    activation format A, per token (row-local, see below)
    W_q = D(Q(W))                 weight format: codes + scales, decoded in the model dtype
    y   = linear(x_q, W_q)        the invariant GEMM (:func:`.blocks.linear`)
    y   = bf16(fl32(y) + s · fl32(linear(linear(x, A_l), B_l)))      with LoRA, s = alpha / r

The LoRA branch reads the *unquantized* input (as vLLM's LoRA layers do beside a quantized base)
and is added in float32, rounded once. MLA's ``kv_b_proj`` is absorbed into the attention
(``W_UK``, ``W_UV``): like vLLM, it is decoded to the model dtype and used without activation
quantization, and it takes no adapter (an adapter would have to be merged before absorption).

Weight formats (``quant`` recipes; formulas in ``quant/recipes_*.py``). A format named like a
``quant.RECIPES`` entry *is* that recipe (its weight options fixed: modelopt's NVFP4 convention,
128x128 FP8 blocks); the others have names of their own:

    nvfp4              E2M1, 1x16 blocks, E4M3 block scales, fp32 global amax/2688 (modelopt writer)
    fp8_channel        E4M3, one scale per output row (compressed-tensors ``channel``)
    fp8_block          E4M3, 128x128 blocks (DeepSeek-V3 ``weight_scale_inv``)
    int4_g32           INT4 symmetric groups of 32 along the input (compressed-tensors W4A16)
    mxfp8              E4M3, 1x32 blocks, E8M0 scales
    fp8_tensor_weight  E4M3, one scale amax/448 for the whole weight, ``w / s`` (the writers'
                       convention: modelopt FP8, compressed-tensors ``tensor``; quant's
                       ``fp8_channel`` over one block). Not quant's ``fp8_tensor``, which is
                       vLLM's per-tensor *activation* quantizer (``x * fl(1/s)``).
    nvfp4_ct           NVFP4 as compressed-tensors stores it (encode global 2688/amax)
    int4_g128          INT4 symmetric groups of 128

Activation formats — each one quantizes a token's row from that row alone, so a token's bits do
not depend on the batch (the invariance the engine needs); again a name of a ``quant`` recipe is
that recipe:

    none         the model dtype as it is
    fp8_token    dynamic per-token E4M3 (vLLM ``dynamic_per_token_scaled_fp8_quant``)
    fp8_tensor   *static* per-tensor E4M3 with ``act_scale`` (a checkpoint's ``input_scale``).
                 Dynamic per-tensor scales depend on every token of the batch: refused.
    nvfp4        vLLM's NVFP4 activation quantizer with a static global amax ``act_amax``
                 (default 2688, global scale 1), or the stored global ``act_global`` itself
                 (a modelopt checkpoint's ``input_scale``: ``fl(fl(g·2688)/2688)`` is not always g)
    mxfp8        dynamic E4M3 1x32 blocks, E8M0 scales
    fp8_group    dynamic E4M3 1x128 groups (vLLM ``per_token_group_quant_fp8``, DeepSeek-V3 FP8)

With adapters (``lora_rank > 0``) the base is frozen: quantized weights are kept *packed*
(codes + scales, :class:`~skyrl_numerics.quant.qtensor.QTensor`) on both sides and decoded per
call. Without adapters the trainer keeps its bf16 weights and fake-quantizes them per call with a
straight-through gradient (QAT); the engine packs what it is sent — the same ``Q`` on the same
bf16 values, so the same codes.

Adapters are per expert for routed experts (vLLM's MoE LoRA layout holds one ``A``/``B`` per
expert and slot): a token's update then touches only the experts it was routed to, as the base.
``A`` starts uniform in ``±1/sqrt(in)`` from a generator seeded by the plan's seed and the
name's CRC32, ``B`` at zero, so both sides start with the same adapters and a no-op update.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field

import torch

from skyrl_numerics.errors import InputError

from .multimodal import text_fields

GROUPS = ("attention", "dense", "shared", "experts")
#: weight format -> (quant recipe, options); a name in ``quant.RECIPES`` maps to that recipe
WEIGHT_FORMATS = {
    "nvfp4": ("nvfp4", {"convention": "modelopt"}),
    "fp8_channel": ("fp8_channel", {}),
    "fp8_block": ("fp8_block", {"block": (128, 128)}),
    "int4_g32": ("int4_g32", {}),
    "mxfp8": ("mxfp8", {}),
    "fp8_tensor_weight": ("fp8_channel", {"block": (-1, -1)}),
    # read from vendor checkpoints (vendor_plan.py): compressed-tensors' NVFP4, INT4 groups of 128
    "nvfp4_ct": ("nvfp4", {"convention": "compressed_tensors"}),
    "int4_g128": ("int4_g32", {"group": 128}),
}
#: plan weight format names that meant another quant recipe than their name says: refused,
#: naming the new name (no saved file holds a plan: plans are built from recipes each run)
RENAMED_WEIGHT_FORMATS = {"fp8_tensor": "fp8_tensor_weight"}
#: activation format -> quant recipe (``none``: the model dtype); options in quantize_activation
ACT_RECIPES = {"none": None, "fp8_token": "fp8_token", "fp8_tensor": "fp8_tensor", "nvfp4": "nvfp4",
               "mxfp8": "mxfp8", "fp8_group": "fp8_block"}
ACT_FORMATS = tuple(ACT_RECIPES)
# the input dim a format's blocks need to divide (serving kernels do not pad these)
_K_MULTIPLE = {"nvfp4": 16, "int4_g32": 32, "mxfp8": 32, "nvfp4_ct": 16, "int4_g128": 128,
               "fp8_group": 128}
_ADAPTER = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class LinearFormat:
    """How one group's linears are served: ``weight`` (a :data:`WEIGHT_FORMATS` name or None
    for the model dtype) and ``act`` (an :data:`ACT_FORMATS` name); ``act_scale`` is the static
    scale of ``fp8_tensor`` activations, ``act_amax`` the static global amax of ``nvfp4`` ones."""
    weight: str | None = None
    act: str = "none"
    act_scale: float | None = None
    act_amax: float = 2688.0
    act_global: float | None = None     # nvfp4: the stored global g itself (modelopt input_scale)

    def check(self, where: str) -> None:
        if self.weight in RENAMED_WEIGHT_FORMATS:
            raise InputError(f"{where}: weight format {self.weight!r} is now called "
                             f"{RENAMED_WEIGHT_FORMATS[self.weight]!r} (quant's {self.weight!r} is "
                             "vLLM's per-tensor activation quantizer, another rounding)",
                             field=f"{where}.weight")
        if self.weight is not None and self.weight not in WEIGHT_FORMATS:
            raise InputError(f"{where}: weight format {self.weight!r} is not one of "
                             f"{sorted(WEIGHT_FORMATS)}", field=f"{where}.weight")
        if self.act not in ACT_FORMATS:
            raise InputError(f"{where}: activation format {self.act!r} is not one of "
                             f"{list(ACT_FORMATS)}", field=f"{where}.act")
        if self.act == "fp8_tensor" and not (self.act_scale and self.act_scale > 0
                                             and math.isfinite(self.act_scale)):
            raise InputError(f"{where}: fp8_tensor activations need a static act_scale > 0 (a "
                             "dynamic per-tensor scale depends on the whole batch, so no token's "
                             "bits would be its own)", field=f"{where}.act_scale")
        if self.act_global is not None and not (self.act == "nvfp4" and self.act_global > 0
                                                and math.isfinite(self.act_global)):
            raise InputError(f"{where}: act_global is the static global of nvfp4 activations, finite "
                             f"and > 0; got {self.act_global} for {self.act!r}", field=f"{where}.act_global")
        if not (self.act_amax > 0 and math.isfinite(self.act_amax)):
            raise InputError(f"{where}: act_amax must be finite and > 0, got {self.act_amax}",
                             field=f"{where}.act_amax")


@dataclass(frozen=True)
class NumericsPlan:
    """Formats per group (:data:`GROUPS`) and LoRA (``lora_rank`` 0: none) on ``lora_targets``."""
    formats: dict = field(default_factory=dict)        # group -> LinearFormat
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = ()
    seed: int = 0

    def __post_init__(self):
        fm = {g: (f if isinstance(f, LinearFormat) else LinearFormat(**f))
              for g, f in dict(self.formats).items()}
        object.__setattr__(self, "formats", fm)
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        for g, f in fm.items():
            if g not in GROUPS:
                raise InputError(f"unknown linear group {g!r}; expected one of {list(GROUPS)}",
                                 field="formats")
            f.check(g)
        if not (isinstance(self.lora_rank, int) and self.lora_rank >= 0):
            raise InputError(f"lora_rank must be an int >= 0, got {self.lora_rank!r}",
                             field="lora_rank")
        bad = [t for t in self.lora_targets if t not in GROUPS]
        if bad:
            raise InputError(f"unknown LoRA target(s) {bad}; expected groups of {list(GROUPS)}",
                             field="lora_targets")
        if self.lora_rank and not self.lora_targets:
            raise InputError("lora_rank > 0 with no lora_targets", field="lora_targets")
        if self.lora_rank and not (self.lora_alpha > 0 and math.isfinite(self.lora_alpha)):
            raise InputError(f"lora_alpha must be finite and > 0, got {self.lora_alpha}",
                             field="lora_alpha")

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    def format_of(self, group: str | None) -> LinearFormat | None:
        return self.formats.get(group) if group else None

    def __hash__(self) -> int:     # a value (engine and reference caches key on it)
        return hash(self.to_json())

    def to_json(self) -> str:
        """The plan as JSON: what crosses a process (vLLM's ``hf_overrides``), HTTP or file."""
        d = asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, s) -> "NumericsPlan | None":
        if s is None or s == "":
            return None
        if isinstance(s, NumericsPlan):
            return s
        d = json.loads(s) if isinstance(s, str) else dict(s)
        return cls(**d)


def group_of(name: str) -> str | None:
    """The :data:`GROUPS` entry of a weight name, or None (norms, router, embeddings, lm-head,
    MLA's absorbed ``kv_b_proj`` — which follows the attention's *weight* format only)."""
    if not name.endswith(("_proj.weight", "_proj_with_mqa.weight")) or not name.startswith("model.layers."):
        return None
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.shared_experts." in name:
        return "shared"
    if ".mlp." in name:
        return "dense"
    return None


def is_absorbed(name: str) -> bool:
    return name.endswith("self_attn.kv_b_proj.weight")


def adapter_names(name: str) -> tuple[str, str]:
    """``(A, B)`` names of the adapter on weight ``name`` (``….q_proj.weight`` ->
    ``….q_proj.lora_A.weight``, ``….q_proj.lora_B.weight``)."""
    base = name[: -len(".weight")]
    return base + _ADAPTER[0], base + _ADAPTER[1]


def is_adapter(name: str) -> bool:
    return name.endswith(_ADAPTER)


# ---- the per-call numerics ---------------------------------------------------------------
def quantize_weight(w: torch.Tensor, fmt: str):
    recipe, opts = WEIGHT_FORMATS[fmt]
    from skyrl_numerics.quant import quantize

    return quantize(w, recipe, **opts)


def decode_weight(q, dtype: torch.dtype) -> torch.Tensor:
    from skyrl_numerics.quant import dequantize

    return dequantize(q, dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward ``fn(x)`` (a rounding onto a serving grid), backward identity."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x.detach())

    @staticmethod
    def backward(ctx, g):
        return g, None


def _ste(fn, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x, fn)
    return fn(x)


def quantize_activation(x: torch.Tensor, f: LinearFormat) -> torch.Tensor:
    """``A(x)`` of the module doc in ``x.dtype``, row by row (straight-through under grad):
    ``quant.fake_quant`` — ``dequantize(quantize(x))`` bit for bit (its fused paths are tested
    against that reference)."""
    recipe = ACT_RECIPES[f.act]
    if recipe is None:
        return x
    from skyrl_numerics.quant import fake_quant

    opts: dict = {}
    if f.act == "fp8_tensor":
        opts = {"scale": torch.tensor(float(f.act_scale))}
    elif f.act == "nvfp4":     # a checkpoint's stored global scale, else the static amax
        g = ({"global_scale": torch.tensor(float(f.act_global))} if f.act_global is not None
             else {"global_amax": torch.tensor(float(f.act_amax))})
        opts = {"convention": "vllm", **g}
    elif f.act == "fp8_group":
        opts = {"block": (1, 128)}

    def fn(t):
        return fake_quant(t.reshape(-1, t.shape[-1]), recipe, **opts).reshape(t.shape)
    return _ste(fn, x)


class Projection:
    """One planned linear: ``proj(x)`` is the module doc's ``y`` (``linear(x, proj)`` calls it)."""

    __slots__ = ("model", "name", "fmt", "adapter", "scale")

    def __init__(self, model, name: str, fmt: LinearFormat | None, adapter, scale: float):
        self.model, self.name, self.fmt, self.adapter, self.scale = model, name, fmt, adapter, scale

    def weight(self) -> torch.Tensor:
        return self.model.served_weight(self.name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x, quantize_activation(x, self.fmt) if self.fmt is not None else x)

    def apply(self, x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
        """``y`` given ``xq = A(x)`` already computed (projections sharing an input share it)."""
        from .blocks import linear

        y = linear(xq, self.weight())
        if self.adapter is None:
            return y
        a, b = (self.model.w(n) for n in self.adapter)
        lo = linear(linear(x, a), b)
        return (y.float() + self.scale * lo.float()).to(y.dtype)


def project_many(x: torch.Tensor, ws) -> list[torch.Tensor]:
    """``[linear(x, w) for w in ws]`` bit for bit, each activation format of ``x`` computed once
    (q/k/v, gate/up: one input, one format)."""
    from .blocks import linear

    done: dict = {}
    out = []
    for w in ws:
        if not isinstance(w, Projection):
            out.append(linear(x, w))
            continue
        if w.fmt not in done:
            done[w.fmt] = quantize_activation(x, w.fmt) if w.fmt is not None else x
        out.append(w.apply(x, done[w.fmt]))
    return out


def init_adapter(name: str, shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The starting value of adapter tensor ``name`` (module doc): the same on every side."""
    if name.endswith(_ADAPTER[1]):
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / math.sqrt(shape[1])
    return ((torch.rand(shape, generator=g, dtype=torch.float32) * 2 - 1) * bound).to(dtype)


def check_applicable(plan: NumericsPlan, shapes: dict) -> None:
    """Refuse (naming the weight and the plan field) what the plan cannot do on a model whose
    linear weights have ``shapes`` (HF name -> (out, in)): a format whose blocks do not divide a
    linear's input dim, a planned group the model does not have."""
    have = {group_of(n) for n in shapes} - {None}
    for g, f in plan.formats.items():
        if (f.weight or f.act != "none") and g not in have:
            raise InputError(f"this model has no {g!r} linears to serve in {f.weight or f.act}",
                             field=f"formats.{g}")
    for t in plan.lora_targets:
        if t not in have:
            raise InputError(f"LoRA target {t!r}: this model has no such linears", field="lora_targets")
    for n, shp in shapes.items():
        f = plan.format_of(group_of(n))
        if f is None:
            continue
        k = int(shp[-1])
        for what, fmt in (("weight", f.weight), ("act", None if is_absorbed(n) else f.act)):
            m = _K_MULTIPLE.get(fmt or "")
            if m and k % m:
                raise InputError(f"{n}: {fmt} {what}s need the input dim to be a multiple of {m}, "
                                 f"got {k}", field=f"formats.{group_of(n)}.{what}")


def attach(model, plan: NumericsPlan, pack: bool | None = None) -> None:
    """Put ``plan`` into an (empty) invariant model: projections for planned linears, adapter
    parameters, and packed storage instead of bf16 weights for quantized ones when ``pack``
    (default: under LoRA, the base frozen; an engine, which never trains, passes True)."""
    pack = plan.lora if pack is None else pack
    shapes = {n: tuple(model.w(n).shape) for n in model.hf_names() if group_of(n)}
    check_applicable(plan, shapes)
    model.numerics = plan
    for n, shp in shapes.items():
        g = group_of(n)
        f = plan.format_of(g)
        adapter = None
        if plan.lora and g in plan.lora_targets and not is_absorbed(n):
            adapter = adapter_names(n)
            for an, ashape in zip(adapter, ((plan.lora_rank, shp[1]), (shp[0], plan.lora_rank))):
                model.add(an, *ashape)
                model.w(an).copy_(init_adapter(an, ashape, model.dtype, plan.seed))
                model._adapters.append(an)
        if f is not None and f.weight and pack:          # served packed, no bf16 copy
            del model.params[model._names[n]]
            model._packed[n] = None
            model._packed_shapes[n] = shp
        if is_absorbed(n):
            continue          # used through model.w (decoded), never as a projection
        if (f is not None and (f.weight or f.act != "none")) or adapter is not None:
            fmt = f if (f is not None and f.act != "none") else None
            model._proj[n] = Projection(model, n, fmt, adapter,
                                        plan.lora_scale if adapter else 1.0)


def check_plan_for_config(plan: NumericsPlan, hf_config: dict, kv_cache=None) -> None:
    """:func:`check_applicable` for a checkpoint config (``config.json`` as a dict), its
    weight shapes taken from the family built on the meta device (nothing allocated)."""
    from types import SimpleNamespace

    from . import architecture_of, family_class

    cfg = SimpleNamespace(**text_fields(hf_config))     # a multimodal one's language model
    cls = family_class(architecture_of(cfg))
    with torch.device("meta"):
        model = cls(**cls.config_parts(cfg, kv_cache=kv_cache))
    check_applicable(plan, {n: tuple(model.w(n).shape) for n in model.hf_names() if group_of(n)})


def plan_adapter_shapes(plan: NumericsPlan, hf_config: dict) -> dict:
    """``{adapter name: shape}`` a model of this config carries under ``plan``."""
    if not plan.lora:
        return {}
    from types import SimpleNamespace

    from . import architecture_of, family_class

    cfg = SimpleNamespace(**text_fields(hf_config))     # a multimodal one's language model
    cls = family_class(architecture_of(cfg))
    with torch.device("meta"):
        model = cls(**cls.config_parts(cfg))
    out = {}
    for n in model.hf_names():
        if group_of(n) in plan.lora_targets and not is_absorbed(n):
            o, i = model.w(n).shape
            a, b = adapter_names(n)
            out[a], out[b] = (plan.lora_rank, int(i)), (int(o), plan.lora_rank)
    return out


def engine_adapter_shapes(hf_config) -> dict:
    """The adapters an invariant engine serves (its ``hf_config`` carries the plan as
    ``skyrl_numerics``) with their shapes; empty for any other engine."""
    plan = NumericsPlan.from_json(getattr(hf_config, "skyrl_numerics", None))
    if plan is None:
        return {}
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    d["architectures"] = [getattr(hf_config, "skyrl_base_arch", None) or d["architectures"][0]]
    return plan_adapter_shapes(plan, d)


def check_adapters(tensors: dict, shapes: dict) -> None:
    """Refuse, before anything is sent, adapters the engine does not serve (name: target or
    model) or of another shape (rank), naming the first such tensor."""
    unknown = sorted(n for n in tensors if n not in shapes)
    if unknown:
        raise InputError(f"adapter {unknown[0]!r} is not one the engine serves ({len(unknown)} "
                         f"unknown; the engine has {len(shapes)} adapters: check the LoRA targets "
                         "and the model)", field=unknown[0])
    for n, t in tensors.items():
        if tuple(t.shape) != tuple(shapes[n]):
            raise InputError(f"adapter {n!r}: shape {tuple(t.shape)}, the engine serves "
                             f"{tuple(shapes[n])} (rank {shapes[n][0] if n.endswith(_ADAPTER[0]) else shapes[n][1]})",
                             field=n)
