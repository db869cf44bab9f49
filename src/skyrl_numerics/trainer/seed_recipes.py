"""The seed recipes as small config objects: ``train --recipe ml4|k2|beam [--recipe-set KEY=VALUE]``.

A :class:`SeedRecipe` is the whole stack a published run uses — serving formats per group of
linears, the KV cache, LoRA, the GRPO group and the trainer (a
:class:`~skyrl_numerics.trainer.config.TrainerConfig`: R3, support replay, the off-policy
correction, the PPO clip, the learning rate) — and becomes two loop configurations
(:func:`loop_configs`):

- ``bitwise``: the invariant engine serving the recipe's numerics (quantized weights packed,
  activations quantized per token, LoRA adapters, the cache format) and the invariant trainer
  computing the same numbers (:mod:`skyrl_numerics.invariant.numerics`); with LoRA only
  the adapters are trained and synced. True on-policy: Δ = 0.
- ``published``: the recipe as its authors run it — a stock trainer (HF model, FSDP) simulating
  the serving formats with fake-quant (weights and activations, ``quant.apply_qat``) and LoRA on
  its linears, R3 and support replay, the token TIS correction; the engine serves the recipe's
  formats. vLLM CPU has no NVFP4 / MXFP8 / W4A4 kernels, so that engine is the invariant one with
  the recipe's numerics standing in for the GPU kernels: the gap shown is the trainer's (its
  kernels, its MLA formulation, its fake-quant placement), not a GPU kernel's.

Format fields are ``WEIGHT/ACT`` (``nvfp4/nvfp4`` = W4A4, ``fp8_tensor_weight/fp8_token`` = W8A8 with
dynamic per-token activations, ``int4_g32/none`` = W4A16); ``none`` keeps the model dtype;
``fp8_tensor@S`` is a static activation scale ``S``, ``nvfp4@A`` a static activation amax ``A``.
``lora_targets`` are linear groups (the plan's); the published trainer's module globs come from
them in one place (:func:`~skyrl_numerics.trainer.published.lora_patterns_for`).

=========  ================================================================================
recipe     what (source)
=========  ================================================================================
``ml4``    Mistral Large 4 day-0 recipe (SkyRL #2575): NVFP4 W4A4 routed experts, FP8 W8A8
           attention + shared experts (+ dense MLPs), FP8 latent KV, LoRA 32/64 on attention,
           dense, shared and routed experts, R3, token TIS cap 2, DAPO clip 0.2 / 0.28,
           GRPO 8 samples per prompt, no KL
``k2``     Kimi K2 RL: INT4 W4A16 (groups of 32) routed experts, trainer fake-quant, LoRA
           32/64, R3, token TIS cap 2. The grid is compressed-tensors RTN (``int4_g32``,
           ``amax/7.5``); Kimi's own releases use ``amax/7.0`` (quant recipe ``int4_g32_kimi``),
           which is not a serving format of the invariant engine yet
``beam``   MXFP8 RL: MXFP8 weights and activations on every linear, full fine-tune (no LoRA:
           the trainer fake-quantizes its bf16 weights, the engine packs what it is sent)
=========  ================================================================================
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import FAMILIES, family_class
from skyrl_numerics.invariant.kv_format import parse_kv_spec
from skyrl_numerics.invariant.multimodal import text_fields
from skyrl_numerics.invariant.numerics import LinearFormat, NumericsPlan, check_plan_for_config, group_of
from skyrl_numerics.invariant.vendor_plan import vendor_numerics, vendor_quant_config

from .config import TrainerConfig
from .loop import LoopConfig

KV_CHOICES = ("auto", "fp8", "fp8_latent", "fp8_ds_mla")
GROUP_FIELDS = ("attention", "dense", "shared", "experts")
#: trainer fields the recipe's plan sets (LoRA, fake-quant) or ``tis_cap`` spells
_DERIVED = ("qat", "lora_rank", "lora_alpha", "lora_patterns", "correction", "correction_kwargs")
_NULLABLE = ("tis_cap", "dual_clip", "grad_clip", "temperature")
_PLAN_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")
_RECIPE_FIELDS = ("kv_cache", "samples_per_prompt", "kl_coef")


def published_trainer() -> TrainerConfig:
    """The seed recipes' trainer: R3, support replay, token TIS cap 2 (the rest the defaults:
    DAPO clip 0.2 / 0.28, lr 1e-2)."""
    return TrainerConfig(route_replay=True, use_support=True, correction="token_tis",
                         correction_kwargs={"cap": 2.0})


@dataclass(frozen=True)
class SeedRecipe:
    """One recipe: its serving numerics (a :class:`NumericsPlan` over every group, LoRA included),
    the engine's cache, the trainer, the GRPO group. Every field can be overridden with
    ``--recipe-set FIELD=VALUE``: a group's ``WEIGHT/ACT`` (``experts=nvfp4/nvfp4``) and the plan's
    ``lora_rank`` / ``lora_alpha`` / ``lora_targets``, a field of ``trainer`` by its bare name (or
    ``trainer.FIELD``), and ``tis_cap`` (the token TIS cap, ``none``: off)."""
    name: str
    numerics: NumericsPlan = field(default_factory=lambda: numerics_plan())
    kv_cache: str = "auto"              # auto | fp8 | fp8_latent (MLA only) | fp8_ds_mla
    trainer: TrainerConfig = field(default_factory=published_trainer)
    samples_per_prompt: int = 8
    kl_coef: float = 0.0
    doc: str = field(default="", compare=False)

    @property
    def tis_cap(self) -> float | None:
        """The published trainer's token TIS cap (None: no correction)."""
        t = self.trainer
        return float(t.correction_kwargs.get("cap", 2.0)) if t.correction == "token_tis" else None

    def spec(self, group: str) -> str:
        """A group's format as ``WEIGHT/ACT[@X]`` (``none/none``: the model dtype)."""
        f = self.numerics.format_of(group)
        if f is None:
            return "none/none"
        x = (f"@{f.act_scale:g}" if f.act_scale is not None
             else f"@{f.act_amax:g}" if f.act == "nvfp4" and f.act_amax != 2688.0 else "")
        return f"{f.weight or 'none'}/{f.act}{x}"

    def with_overrides(self, items) -> "SeedRecipe":
        """``["lora_rank=16", "experts=mxfp8/mxfp8", "lr=1e-3", ...]`` applied; unknown fields and
        bad values are refused naming the field."""
        kw, pkw, tkw = {}, {}, {}
        formats = dict(self.numerics.formats)
        for item in items or ():
            k, v = _split_override(item)
            if k in GROUP_FIELDS:
                _set_format(formats, k, v)
            elif k in _PLAN_FIELDS:
                pkw[k] = _coerce(k, v, getattr(self.numerics, k))
            elif k in _RECIPE_FIELDS:
                kw[k] = _coerce(k, v, getattr(self, k))
            elif k == "tis_cap":
                tkw.update(_tis_fields(_coerce(k, v, 2.0)))
            elif k in _trainer_fields():
                tkw[k] = _coerce(k, v, getattr(self.trainer, k))
            else:
                known = GROUP_FIELDS + _PLAN_FIELDS + _RECIPE_FIELDS + _trainer_fields() + ("tis_cap",)
                raise InputError(f"recipe {self.name!r} has no field {k!r}; fields: {sorted(known)}", field=k)
        r = dataclasses.replace(self, numerics=dataclasses.replace(self.numerics, formats=formats, **pkw),
                                trainer=dataclasses.replace(self.trainer, **tkw), **kw)
        r.check()
        return r

    def check(self) -> None:
        if self.kv_cache not in KV_CHOICES:
            raise InputError(f"recipe {self.name!r}: kv_cache {self.kv_cache!r} is not one of "
                             f"{list(KV_CHOICES)}", field="kv_cache")
        if self.kl_coef != 0:
            raise InputError(f"recipe {self.name!r}: kl_coef {self.kl_coef}: the loop has no KL "
                             "term (all three seed recipes run without one)", field="kl_coef")
        if self.samples_per_prompt < 2:
            raise InputError(f"samples_per_prompt {self.samples_per_prompt}: GRPO needs a group "
                             "of >= 2", field="samples_per_prompt")

    def plan_for_groups(self, groups) -> NumericsPlan:
        """The recipe's plan on a model with these linear groups (the others dropped; no LoRA
        targets without a rank)."""
        p = self.numerics
        targets = tuple(t for t in p.lora_targets if t in groups) if p.lora_rank else ()
        return dataclasses.replace(p, formats={g: f for g, f in p.formats.items() if g in groups},
                                   lora_targets=targets)


def numerics_plan(*, lora_rank: int = 0, lora_alpha: float = 16.0, lora_targets=GROUP_FIELDS,
                  **specs) -> NumericsPlan:
    """A recipe's plan from ``WEIGHT/ACT`` specs per group (``experts="nvfp4/nvfp4"``); groups in
    the model dtype are left out. LoRA targets default to every group."""
    formats: dict = {}
    for g, spec in specs.items():
        _set_format(formats, g, spec)
    return NumericsPlan(formats=formats, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets)


def _set_format(formats: dict, group: str, spec: str) -> None:
    if group not in GROUP_FIELDS:
        raise InputError(f"unknown linear group {group!r}; expected one of {list(GROUP_FIELDS)}", field=group)
    f = parse_format(spec, group)
    if f["weight"] is not None or f["act"] != "none":
        formats[group] = LinearFormat(**f)
    else:
        formats.pop(group, None)


def _trainer_fields() -> tuple:
    return tuple(f.name for f in dataclasses.fields(TrainerConfig) if f.name not in _DERIVED)


def _split_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise InputError(f"--recipe-set {item!r}: expected FIELD=VALUE", field="recipe-set")
    k, v = item.split("=", 1)
    return k.strip().replace("-", "_").removeprefix("trainer."), v.strip()


def _tis_fields(cap) -> dict:
    if cap is not None and not cap > 0:
        raise InputError(f"tis_cap must be > 0 or none, got {cap}", field="tis_cap")
    return ({"correction": "token_tis", "correction_kwargs": {"cap": cap}} if cap is not None
            else {"correction": None, "correction_kwargs": {}})


def _coerce(k: str, v: str, old):
    if v.lower() in ("none", "null") and k in _NULLABLE:
        return None
    try:
        if isinstance(old, bool):
            if v.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(v)
            return v.lower() in ("true", "1", "yes", "on")
        if isinstance(old, int) and not isinstance(old, bool):
            return int(v)
        if isinstance(old, float) or old is None:
            return float(v)
        if isinstance(old, tuple):
            parts = [s.strip() for s in v.split(",") if s.strip()]
            return tuple(type(old[0])(x) for x in parts) if old and not isinstance(old[0], str) else tuple(parts)
    except ValueError:
        raise InputError(f"--recipe-set {k}={v!r}: expected a {type(old).__name__}", field=k) from None
    return v


def parse_format(spec: str, group: str) -> dict:
    """``"WEIGHT/ACT[@X]"`` -> LinearFormat kwargs (checked); errors name the group."""
    if not isinstance(spec, str) or spec.count("/") != 1:
        raise InputError(f"{group}={spec!r}: expected WEIGHT/ACT, e.g. nvfp4/nvfp4 or int4_g32/none",
                         field=group)
    w, a = (s.strip() for s in spec.split("/"))
    kw = {"weight": None if w == "none" else w, "act": a}
    if "@" in a:
        a, x = a.split("@", 1)
        try:
            val = float(x)
        except ValueError:
            raise InputError(f"{group}={spec!r}: {x!r} after @ is not a number", field=group) from None
        kw["act"] = a
        kw["act_scale" if a == "fp8_tensor" else "act_amax"] = val
    f = LinearFormat(**kw)
    f.check(group)
    return dataclasses.asdict(f)


_W8A8_TENSOR = "fp8_tensor_weight/fp8_token"
SEED_RECIPES = {
    "ml4": SeedRecipe("ml4", numerics_plan(experts="nvfp4/nvfp4", attention=_W8A8_TENSOR, shared=_W8A8_TENSOR,
                                           dense=_W8A8_TENSOR, lora_rank=32, lora_alpha=64.0),
                      kv_cache="fp8_latent",
                      doc="Mistral Large 4 day-0 (SkyRL #2575): NVFP4 W4A4 experts, FP8 W8A8 "
                          "attention + shared, FP8 latent KV, LoRA 32/64, R3, TIS 2"),
    "k2": SeedRecipe("k2", numerics_plan(experts="int4_g32/none", lora_rank=32, lora_alpha=64.0),
                     doc="Kimi K2: INT4 W4A16 experts, fake-quant trainer, LoRA 32/64, R3, TIS 2"),
    "beam": SeedRecipe("beam", numerics_plan(experts="mxfp8/mxfp8", attention="mxfp8/mxfp8",
                                             shared="mxfp8/mxfp8", dense="mxfp8/mxfp8"),
                       doc="MXFP8 RL: MXFP8 weights and activations, full fine-tune"),
}


def get_recipe(name: str, overrides=()) -> SeedRecipe:
    if name not in SEED_RECIPES:
        raise InputError(f"unknown recipe {name!r}; known: {sorted(SEED_RECIPES)}", field="recipe")
    return SEED_RECIPES[name].with_overrides(overrides)


def resolve(recipe: SeedRecipe, model_dir) -> tuple:
    """``(NumericsPlan, kv_cache format, notes)`` of ``recipe`` on the checkpoint at
    ``model_dir``; groups the model does not have are dropped (noted), and what cannot apply is
    refused naming the recipe field — all before any engine starts."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = text_fields(raw)      # a multimodal checkpoint's language model
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in FAMILIES:
        raise InputError(f"recipe {recipe.name!r}: its bitwise config needs a batch-invariant family; "
                         f"{arch} is not one of {sorted(FAMILIES)}", field="model")
    quant = vendor_quant_config(model_dir, raw)    # a vendor-quantized base: its own formats
    if quant is not None and not recipe.numerics.lora_rank:
        raise InputError(f"recipe {recipe.name!r} fine-tunes every weight, but {model_dir} is "
                         "quantized (its packed weights are not trainable): set lora_rank",
                         field="lora_rank")
    have, notes = _model_groups(recipe, arch, cfg)
    kv = _kv_format(recipe, cfg)
    plan = recipe.plan_for_groups(have)
    if quant is not None:
        plan = vendor_numerics(raw, quant, dataclasses.replace(plan, formats={}), kv_cache=parse_kv_spec(kv))
        method = (quant.get("config") or {}).get("quant_method", "?")
        notes.append(f"formats: the checkpoint's own ({method}), not the recipe's")
    check_plan_for_config(plan, cfg, kv_cache=kv)
    return plan, kv, notes


def _model_groups(recipe: SeedRecipe, arch: str, cfg: dict) -> tuple[set, list]:
    """The linear groups the model has (its family built on the meta device) and a note for each
    group the recipe names that it lacks; routed experts the model lacks are refused."""
    cls = family_class(arch)
    with torch.device("meta"):
        model = cls(**cls.config_parts(SimpleNamespace(**cfg)))
    have = {group_of(n) for n in model.hf_names()} - {None}
    p = recipe.numerics
    if "experts" in p.formats and "experts" not in have:
        raise InputError(f"recipe {recipe.name!r} serves routed experts in {recipe.spec('experts')}; "
                         "this model has none", field="experts")
    notes = [f"{g}: not in this model" for g in GROUP_FIELDS
             if g not in have and (g in p.formats or (p.lora_rank and g in p.lora_targets))]
    return have, notes


def _kv_format(recipe: SeedRecipe, cfg: dict) -> str | None:
    """The engine's cache format (None: the model dtype); ``fp8_latent`` is FP8 on an MLA model."""
    kv = recipe.kv_cache
    if kv == "fp8_latent":
        if cfg.get("kv_lora_rank") is None:
            raise InputError(f"recipe {recipe.name!r}: kv_cache=fp8_latent needs an MLA model (a "
                             "latent cache); this one caches K/V per head: set kv_cache=fp8 or auto",
                             field="kv_cache")
        kv = "fp8"
    return None if kv == "auto" else kv


def loop_configs(recipe: SeedRecipe, model_dir, names) -> list:
    """The :class:`~skyrl_numerics.trainer.loop.LoopConfig` of each requested configuration
    (``published``, ``bitwise``) of ``recipe`` on ``model_dir``: both embed the recipe's trainer
    (``bitwise`` without R3 and correction: its routes and logprobs are the engine's own)."""
    plan, kv, notes = resolve(recipe, model_dir)
    out = []
    for n in names:
        if n == "bitwise":
            trainer = dataclasses.replace(recipe.trainer, route_replay=False, use_support=True,
                                          correction=None, correction_kwargs={})
            out.append(LoopConfig("bitwise", trainer, bitwise=True, kv_cache=kv, recipe=recipe.name,
                                  numerics=plan))
        elif n == "published":
            if any(x.startswith("formats: the checkpoint") for x in notes):
                raise InputError(f"recipe {recipe.name!r}: 'published' trains an HF model, which "
                                 f"would load {model_dir} dequantized by transformers — not wired; "
                                 "run --configs bitwise on a quantized checkpoint", field="configs")
            out.append(LoopConfig("published", recipe.trainer, kv_cache=kv, recipe=recipe.name,
                                  numerics=plan))
        else:
            raise InputError(f"recipe configurations are 'published' and 'bitwise', got {n!r}",
                             field="configs")
    return out
