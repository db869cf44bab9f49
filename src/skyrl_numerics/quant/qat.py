"""Quantization-aware training: ``apply_qat(model, rules)``.

Each rule names modules by a glob over ``model.named_modules()`` names (``fnmatch``) and a recipe.
Matched modules get:

* weights: a ``torch.nn.utils.parametrize`` parametrization, so every read of the weight returns
  ``ste_fake_quant(w)`` while the optimizer updates the full-precision ``original``. It applies to
  ``nn.Linear.weight`` and to fused MoE expert parameters: modules holding 3-D ``[E, out, in]``
  parameters (transformers >= 5 ``Qwen3MoeExperts.gate_up_proj`` / ``down_proj``, found by shape)
  are fake-quantized one expert matrix ``[out, in]`` at a time, and ``gate_up_proj`` is split into
  its gate and up halves first, because checkpoints store (and per-tensor / global scales cover)
  ``gate_proj`` and ``up_proj`` separately.
* activations (optional ``act_recipe``): the input of every GEMM the module runs is
  fake-quantized with the STE, as a W4A4 / W8A8 serving engine quantizes it. For ``nn.Linear``
  that is the module's input (a forward pre-hook). A fused experts module runs two GEMMs per
  expert: for transformers' standard layout (``@use_experts_implementation`` with concatenated
  ``[gate; up]``, not transposed, no bias, gated) the module runs
  :func:`skyrl_numerics.quant.hf_experts.experts_forward`, the eager per-expert loop with both inputs
  quantized::

      x_q = Q(x);  h = apply_gate(x_q @ W_gu[e].T);  y_e = Q(h) @ W_down[e].T
      out[t] += w[t, slot] * y_e[t]          (experts in ascending id, as transformers' loop)

  (with ``Q`` the identity it is bitwise transformers' eager forward: tested). Any other experts
  layout gets the pre-hook only (the tokens entering ``gate_up_proj``), and says so in what
  :func:`apply_qat` returns (``input:R (gate_up only)``).

``remove_qat(model)`` removes both, keeping the full-precision weights (or, with
``bake=True``, the fake-quantized ones).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.nn.utils import parametrize

from skyrl_numerics.quant import hf_experts
from skyrl_numerics.errors import InputError

from .api import RECIPES, recipe_options
from .ste import ste_fake_quant


@dataclass
class QATRule:
    """``pattern``: module-name glob; ``recipe`` / ``opts``: weight format (None: weights untouched);
    ``act_recipe`` / ``act_opts``: input-activation format (None: none); ``clip``: clipped STE."""

    pattern: str
    recipe: str | None
    opts: dict = field(default_factory=dict)
    act_recipe: str | None = None
    act_opts: dict = field(default_factory=dict)
    clip: bool = False


def as_rule(r, i: int) -> QATRule:
    if isinstance(r, QATRule):
        rule = r
    elif isinstance(r, dict):
        try:
            rule = QATRule(**r)
        except TypeError as e:
            raise InputError(f"bad QAT rule: {e}", index=i, field="rules") from None
    elif isinstance(r, (tuple, list)) and len(r) == 2:
        rule = QATRule(r[0], r[1])
    else:
        raise InputError(f"a QAT rule is a QATRule, a dict or (pattern, recipe), got {r!r}", index=i, field="rules")
    for name, opts in ((rule.recipe, rule.opts), (rule.act_recipe, rule.act_opts)):
        if name is None:
            continue
        if name not in RECIPES:
            raise InputError(f"unknown recipe {name!r}; expected one of {', '.join(RECIPES)}", index=i, field="recipe")
        bad = set(opts) - set(recipe_options(name))
        if bad:
            raise InputError(f"recipe {name!r} has no option(s) {sorted(bad)}", index=i, field="opts")
    return rule


class FakeQuantWeight(nn.Module):
    """Parametrization: ``w -> ste_fake_quant(w)``; 3-D ``[E, out, in]`` per expert matrix,
    optionally split into ``split`` row-chunks (gate/up) each quantized as its own tensor."""

    def __init__(self, recipe: str, opts: dict, clip: bool, split: int = 1):
        super().__init__()
        self.recipe, self.opts, self.clip, self.split = recipe, dict(opts), clip, split

    def _one(self, w2d: torch.Tensor) -> torch.Tensor:
        parts = w2d.chunk(self.split, dim=0) if self.split > 1 else (w2d,)
        out = [ste_fake_quant(p, self.recipe, clip=self.clip, **self.opts) for p in parts]
        return torch.cat(out, dim=0) if len(out) > 1 else out[0]

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if w.dim() == 3:      # unbind: the backward writes the [E, ...] gradient once, not per expert
            return torch.stack([self._one(we) for we in w.unbind(0)])
        return self._one(w)


def _expert_params(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]


def apply_qat(model: nn.Module, rules) -> dict[str, list[str]]:
    """Wrap the modules that ``rules`` match; returns ``{module_name: [what was wrapped]}``.

    The first matching rule wins for each module. A rule that matches no ``nn.Linear`` or
    expert module raises :class:`InputError` (a typo should not silently train unquantized).
    """
    rules = [as_rule(r, i) for i, r in enumerate(rules)]
    done: dict[str, list[str]] = {}
    hits = [0] * len(rules)
    for name, mod in list(model.named_modules()):
        rule_i = next((i for i, r in enumerate(rules) if fnmatch.fnmatchcase(name, r.pattern)), None)
        if rule_i is None:
            continue
        rule = rules[rule_i]
        targets = ["weight"] if isinstance(mod, nn.Linear) else _expert_params(mod)
        if not targets:
            continue
        hits[rule_i] += 1
        wrapped = []
        if rule.recipe is not None:
            for pname in targets:
                if parametrize.is_parametrized(mod, pname):
                    raise InputError(f"module {name!r} parameter {pname!r} already has QAT applied", field="rules")
                split = 2 if pname == "gate_up_proj" else 1
                fq = FakeQuantWeight(rule.recipe, rule.opts, rule.clip, split)
                parametrize.register_parametrization(mod, pname, fq)
                wrapped.append(f"{pname}:{rule.recipe}")
        if rule.act_recipe is not None and hf_experts.standard_experts(mod):
            hf_experts.install(mod, act_quant=_act_quant(rule))
            wrapped.append(f"input:{rule.act_recipe}")
        elif rule.act_recipe is not None:
            mod._qat_act_hook = mod.register_forward_pre_hook(act_hook(rule))
            wrapped.append(f"input:{rule.act_recipe}"
                           + ("" if isinstance(mod, nn.Linear) else " (gate_up only)"))
        done[name] = wrapped
    for i, h in enumerate(hits):
        if h == 0:
            raise InputError(f"QAT rule pattern {rules[i].pattern!r} matched no Linear or expert module",
                             index=i, field="pattern")
    return done


def _act_quant(rule: QATRule):
    return partial(ste_fake_quant, recipe=rule.act_recipe, clip=rule.clip, **rule.act_opts)


def act_hook(rule: QATRule):
    quant = _act_quant(rule)

    def hook(module, args):
        if not args or not torch.is_tensor(args[0]) or not args[0].is_floating_point():
            return None
        return (quant(args[0]), *args[1:])
    return hook


def bake_frozen(model: nn.Module) -> list[str]:
    """Quantize once the QAT weights nobody trains (a LoRA base: ``original`` frozen): the
    parametrization is replaced by its value ``fake_quant(w)`` as a frozen parameter, so the
    forward stops re-quantizing it on every call (bitwise the same value; at Qwen3-30B-A3B expert
    dims the per-call NVFP4 fake-quant is most of the step, ``benchmarks/bench_hf_experts.py``).
    Returns the baked ``module.param`` names; activation quantizers stay."""
    done = []
    for name, mod in model.named_modules():
        if not parametrize.is_parametrized(mod):
            continue
        for pname in list(mod.parametrizations.keys()):
            if mod.parametrizations[pname].original.requires_grad:
                continue
            with torch.no_grad():
                parametrize.remove_parametrizations(mod, pname, leave_parametrized=True)
            getattr(mod, pname).requires_grad_(False)
            done.append(f"{name}.{pname}")
    return done


def remove_qat(model: nn.Module, bake: bool = False) -> None:
    """Undo :func:`apply_qat`. ``bake=True`` keeps the fake-quantized weights as the parameters."""
    for mod in model.modules():
        if "_act_quant" in mod.__dict__:
            hf_experts.uninstall(mod, act_quant=True)
        if hasattr(mod, "_qat_act_hook"):
            mod._qat_act_hook.remove()
            del mod._qat_act_hook
        if parametrize.is_parametrized(mod):
            for pname in list(mod.parametrizations.keys()):
                with torch.no_grad():
                    parametrize.remove_parametrizations(mod, pname, leave_parametrized=bake)
