"""``apply_qat`` rules on megatron-core modules: ColumnParallel/RowParallel linears and MoE experts.

:func:`skyrl_numerics.quant.apply_qat` wraps ``nn.Linear`` weights and 3-D fused expert parameters; megatron-core's
``ColumnParallelLinear`` / ``RowParallelLinear`` are not ``nn.Linear`` and ``GroupedMLP`` keeps its experts in
2-D ``weight1`` / ``weight2``, so ``apply_qat`` finds nothing there. :func:`apply_megatron_qat` takes the
same rules (:class:`skyrl_numerics.quant.QATRule`, globs over megatron module names) and registers the same
``torch.nn.utils.parametrize`` parametrizations, with what each weight's sharding needs so that every rank
sees **its shard of the fake-quant of the unsharded tensor**:

- a TP-sharded linear (``tp_group`` size > 1: ``linear_qkv``, ``linear_proj``, ``output_layer``): the forward
  all-gathers the full weight (detached), fake-quantizes it with the recipe, and keeps this rank's block;
  gradient straight-through (``w + (fq - w).detach()``; the clipped STE is refused here). Per-tensor and
  global scales (FP8 tensor, NVFP4's global) therefore come from the whole tensor, as on one rank.
- an unsharded linear (TP 1, or an expert linear with expert-TP 1): :class:`skyrl_numerics.quant.qat.FakeQuantWeight`
  itself, i.e. exactly ``apply_qat``. An expert's ``linear_fc1`` is ``[gate; up]`` (SwiGLU) and is quantized
  as its two halves (``split=2``), as HF checkpoints store ``gate_proj`` / ``up_proj`` and as ``apply_qat``
  treats ``gate_up_proj``.
- ``GroupedMLP`` ``weight1`` (memory ``[E_local, H, 2f]``) / ``weight2`` (``[E_local, f, H]``): one expert
  matrix at a time in HF orientation (``fc1_e = weight1[e]^T`` split gate/up, ``fc2_e = weight2[e]^T``),
  fake-quantized and laid back. Experts are whole on their EP rank (expert-TP 1), so no gather.

A rule matching ``SequentialMLP`` / ``GroupedMLP`` (e.g. the serving pattern ``*.mlp.experts``) covers all
its experts. A rule that matches nothing raises InputError, like ``apply_qat``. Activation recipes
(``act_recipe``) are applied as a forward pre-hook on the matched linear, as ``apply_qat`` does.
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.nn.utils import parametrize

from skyrl_numerics.errors import InputError

__all__ = ["apply_megatron_qat", "original_state_dict"]


class _ShardedFakeQuant(nn.Module):
    """Parametrization of a TP shard: this rank's block of ``fake_quant(all_gather(w))`` (STE)."""

    def __init__(self, recipe, opts, dim: int, group, split: int = 1):
        super().__init__()
        self.recipe, self.opts, self.dim, self.group, self.split = recipe, dict(opts), dim, group, split

    def forward(self, w):
        import torch.distributed as dist

        from skyrl_numerics.quant import fake_quant

        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        with torch.no_grad():
            parts = [torch.empty_like(w) for _ in range(n)]
            dist.all_gather(parts, w.detach().contiguous(), group=self.group)
            full = torch.cat(parts, dim=self.dim)
            chunks = full.chunk(self.split, dim=0) if self.split > 1 else (full,)
            fq = torch.cat([fake_quant(c, self.recipe, **self.opts) for c in chunks], dim=0)
            mine = fq.chunk(n, dim=self.dim)[r].to(w.dtype)
        return w + (mine - w).detach()


class _GroupedFakeQuant(nn.Module):
    """Parametrization of GroupedMLP ``weight1`` / ``weight2``: per expert matrix, in HF orientation."""

    def __init__(self, recipe, opts, clip, num_experts: int, shape3: tuple, split: int):
        super().__init__()
        from skyrl_numerics.quant.qat import FakeQuantWeight

        self.fq = FakeQuantWeight(recipe, opts, clip, split)
        self.E, self.shape3 = num_experts, shape3

    def forward(self, w):
        w3 = w.reshape(self.E, *self.shape3)          # [E, H, 2f] or [E, f, H]
        out = torch.stack([self.fq(w3[e].t()).t() for e in range(self.E)])
        return out.reshape(w.shape)


def _linears(mod):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return isinstance(mod, (ColumnParallelLinear, RowParallelLinear))


def _wrap_linear(name, mod, rule, split):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from skyrl_numerics.quant.qat import FakeQuantWeight

    if parametrize.is_parametrized(mod, "weight"):
        raise InputError(f"module {name!r} parameter 'weight' already has QAT applied", field="rules")
    group = getattr(mod, "tp_group", None)
    tp = group.size() if group is not None else 1
    if tp > 1:
        if rule.clip:
            raise InputError(f"{name}: the clipped STE is not supported on a tensor-parallel weight", field="clip")
        if split > 1:
            raise InputError(f"{name}: a TP-sharded gated fc1 ([gate_r; up_r] per rank) is not supported",
                             field="rules")
        dim = 0 if isinstance(mod, ColumnParallelLinear) else 1
        p = _ShardedFakeQuant(rule.recipe, rule.opts, dim, group)
    else:
        p = FakeQuantWeight(rule.recipe, rule.opts, rule.clip, split)
    parametrize.register_parametrization(mod, "weight", p)
    return f"weight:{rule.recipe}" + (f"(tp={tp})" if tp > 1 else "")


def act_hook(mod, rule):
    from skyrl_numerics.quant.qat import act_hook as hook

    mod._qat_act_hook = mod.register_forward_pre_hook(hook(rule))
    return f"input:{rule.act_recipe}"


def apply_megatron_qat(model: nn.Module, rules) -> dict[str, list[str]]:
    """Wrap the megatron-core modules that ``rules`` match; returns ``{module_name: [what was wrapped]}``."""
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
    from skyrl_numerics.quant.qat import as_rule

    rules = [as_rule(r, i) for i, r in enumerate(rules)]
    hits = [0] * len(rules)
    done: dict[str, list[str]] = {}
    covered: set[int] = set()
    for name, mod in list(model.named_modules()):
        if id(mod) in covered:
            continue
        i = next((j for j, r in enumerate(rules) if fnmatch.fnmatchcase(name, r.pattern)), None)
        if i is None:
            continue
        rule = rules[i]
        if isinstance(mod, SequentialMLP):
            hits[i] += 1
            for e, expert in enumerate(mod.local_experts):
                for lname, split in (("linear_fc1", 2 if mod.config.gated_linear_unit else 1), ("linear_fc2", 1)):
                    lin = getattr(expert, lname)
                    covered.add(id(lin))
                    what = [_wrap_linear(f"{name}.local_experts.{e}.{lname}", lin, rule, split)] \
                        if rule.recipe is not None else []
                    if rule.act_recipe is not None:
                        what.append(act_hook(lin, rule))
                    done[f"{name}.local_experts.{e}.{lname}"] = what
            continue
        if isinstance(mod, GroupedMLP):
            hits[i] += 1
            H, El = mod.config.hidden_size, mod.num_local_experts
            what = []
            if rule.recipe is not None:
                f2 = mod.weight1.shape[1] // El
                split = 2 if mod.config.gated_linear_unit else 1
                for pname, shape3, sp in (("weight1", (H, f2), split), ("weight2", (mod.weight2.shape[0] // El, H), 1)):
                    if parametrize.is_parametrized(mod, pname):
                        raise InputError(f"module {name!r} parameter {pname!r} already has QAT applied", field="rules")
                    parametrize.register_parametrization(
                        mod, pname, _GroupedFakeQuant(rule.recipe, rule.opts, rule.clip, El, shape3, sp))
                    what.append(f"{pname}:{rule.recipe}")
            if rule.act_recipe is not None:
                raise InputError(f"{name}: activation fake-quant is not supported on GroupedMLP", field="act_recipe")
            done[name] = what
            continue
        if _linears(mod):
            hits[i] += 1
            what = [_wrap_linear(name, mod, rule, 1)] if rule.recipe is not None else []
            if rule.act_recipe is not None:
                what.append(act_hook(mod, rule))
            done[name] = what
    for i, h in enumerate(hits):
        if h == 0:
            raise InputError(f"QAT rule pattern {rules[i].pattern!r} matched no megatron-core linear or experts module",
                             index=i, field="pattern")
    return done


def original_state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` with parametrized weights under their plain names (the full-precision
    ``original``), ``_extra_state`` dropped: what the mapping / weight sync expects."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("_extra_state"):
            continue
        out[k.replace("parametrizations.", "").replace(".original", "")] = v
    return out
