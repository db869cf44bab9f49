"""The published trainer of a serving plan: an HF model (FSDP) that fake-quantizes what the engine
serves quantized and carries LoRA where the plan has adapters.

A :class:`~skyrl_numerics.invariant.numerics.NumericsPlan` names linear *groups* (attention,
dense, shared, experts); an HF model's modules are matched by globs. This module is the one place
one is turned into the other: :func:`qat_rules_for` (``quant.apply_qat`` rules) and
:func:`lora_patterns_for` (``TrainerConfig.lora_patterns``), both through
:func:`published_trainer_kwargs`; :func:`plain_names` gives the trained state under the names the
engine serves.
"""
from __future__ import annotations

import fnmatch

import torch

from skyrl_numerics.invariant.numerics import ACT_RECIPES, WEIGHT_FORMATS, NumericsPlan
from skyrl_numerics.quant import QATRule
from skyrl_numerics.quant.hf_experts import served_adapters

_HF_PATTERNS = {
    "attention": ["model.layers.*.self_attn.*_proj", "model.layers.*.self_attn.kv_a_proj_with_mqa"],
    "shared": [f"model.layers.*.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")],
    "dense": [f"model.layers.*.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")],
    "experts": ["model.layers.*.mlp.experts"],
}
_HF_LORA = {
    "experts": ["model.layers.*.mlp.experts"],
    "attention": [f"*.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj",
                                                "q_b_proj", "kv_a_proj_with_mqa")],
    "shared": [f"*.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")],
    "dense": [f"model.layers.*.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")],
}


def _act_rule(f) -> tuple:
    """The ``apply_qat`` activation recipe and options of a plan's activation format."""
    if f.act == "fp8_tensor":
        return "fp8_tensor", {"scale": torch.tensor(float(f.act_scale))}
    if f.act == "nvfp4":
        return "nvfp4", {"convention": "vllm", "global_amax": torch.tensor(float(f.act_amax))}
    if f.act == "fp8_group":
        return "fp8_block", {"block": (1, 128)}
    return ACT_RECIPES[f.act], {}


def published_trainer_kwargs(plan: NumericsPlan, model=None) -> dict:
    """``TrainerConfig`` fields of the published trainer for a plan: ``qat`` (:func:`qat_rules_for`)
    and LoRA on the planned groups (:func:`lora_patterns_for`; per expert on the routed experts,
    ``fsdp.lora``: the engine's adapter layout)."""
    patterns = lora_patterns_for(plan.lora_targets)
    return {"qat": qat_rules_for(plan, model) or None, "lora_rank": plan.lora_rank if patterns else 0,
            "lora_alpha": plan.lora_alpha, "lora_patterns": patterns or ("*.o_proj",)}


def qat_rules_for(plan: NumericsPlan, model=None) -> list:
    """``quant.apply_qat`` rules: the HF model fake-quantizes the planned weights (STE) and their
    inputs (for a fused experts module both GEMM inputs of every expert, the tokens and the
    ``down_proj`` input, as the engine quantizes them; MLA's ``kv_b_proj`` weight only).
    ``model``: the HF model the rules are for — rules naming modules it does not have (MLA's
    ``kv_b_proj`` in a GQA model) are left out (``apply_qat`` refuses a rule matching nothing)."""
    rules = []
    for g, f in sorted(plan.formats.items()):     # by group name, whatever order the plan was built in
        recipe, opts = WEIGHT_FORMATS[f.weight] if f.weight else (None, {})
        act, act_opts = _act_rule(f)
        if g == "attention" and recipe:
            rules.append(QATRule("model.layers.*.self_attn.kv_b_proj", recipe, dict(opts)))
        rules += [QATRule(p, recipe, dict(opts), act, dict(act_opts)) for p in _HF_PATTERNS[g]]
    if model is not None:
        names = [n for n, _ in model.named_modules()]
        rules = [r for r in rules if any(fnmatch.fnmatchcase(n, r.pattern) for n in names)]
    return rules


def lora_patterns_for(groups) -> list[str]:
    """The HF module globs (``TrainerConfig.lora_patterns``) of LoRA target *groups* (a plan's or a
    recipe's ``lora_targets``: attention, dense, shared, experts) — the one place one meaning is
    turned into the other."""
    return [p for g in groups for p in _HF_LORA.get(g, ())]


def plain_names(state: dict) -> dict:
    """A parametrized (QAT) / LoRA model's state under plain names: ``X.parametrizations.P.original``
    -> ``X.P`` (the full-precision weight), ``X.lora_A`` -> ``X.lora_A.weight``, a fused experts
    module's ``X.lora.{p}_A [E, r, in]`` -> ``X.{e}.{p}_proj.lora_A.weight`` (the engine's names)."""
    out, experts = {}, {}
    for k, v in state.items():
        if ".lora." in k:              # per-expert adapters of a fused experts module
            head, _, leaf = k.rpartition(".lora.")
            if leaf != "scaling":
                experts.setdefault(head, {})[leaf] = v
            continue
        if ".parametrizations." in k and k.endswith(".original"):
            head, _, rest = k.partition(".parametrizations.")
            k = f"{head}.{rest[: -len('.original')]}"
        elif k.endswith((".lora_A", ".lora_B")):
            k = k + ".weight"
        elif k.endswith(".lora_scaling"):
            continue
        out[k.replace(".base.", ".")] = v
    for head, lora in experts.items():
        out.update(served_adapters(head, lora))
    return out
