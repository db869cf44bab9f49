"""A small LoRA: low-rank adapters on ``nn.Linear`` layers chosen by glob over module names.

    y = x W^T + b + s · (x A^T) B^T,    A ∈ R^{r×in}, B ∈ R^{out×r},  s = alpha / r

``A`` starts Kaiming-uniform and ``B`` at zero, so the adapted model equals the base model before
the first update. The base weights are frozen. The scale is a persistent buffer (``lora_scaling``)
so a state dict alone is enough to merge: ``W' = W + s · B A`` (:func:`merge_lora_state_dict`, what
a weight sync to an inference engine sends).

Parameter names: ``<name>.base.weight`` / ``.base.bias`` (frozen) and ``<name>.lora_A`` /
``<name>.lora_B``.

MoE experts stored as fused 3-D parameters (transformers 5's standard layout,
:func:`skyrl_numerics.quant.hf_experts.standard_experts`) that a target glob names get one adapter per
expert and projection, as vLLM's MoE LoRA holds them: ``<name>.lora.{gate,up,down}_A [E, r, in]``
/ ``_B [E, out, r]`` (:class:`~skyrl_numerics.quant.hf_experts.ExpertsLoRA`; a token's update touches
only the experts it was routed to). Merged per expert into ``gate_up_proj`` / ``down_proj``.
Another experts layout named by a pattern is refused (its adapters could not be served).
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
from typing import Sequence

import torch
from torch import nn

from skyrl_numerics.quant import hf_experts
from skyrl_numerics.errors import InputError

from ..config import DEFAULT_LORA_PATTERNS

__all__ = ["LoRALinear", "apply_lora", "merge_lora_state_dict"]


class LoRALinear(nn.Module):
    """``base(x) + scaling · lora_B(lora_A(x))`` around a frozen ``nn.Linear``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=dev, dtype=dt))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=dev, dtype=dt))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.register_buffer("lora_scaling", torch.tensor(alpha / rank, dtype=torch.float32))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T * self.lora_scaling.to(x.dtype)


def apply_lora(model: nn.Module, *, rank: int = 8, alpha: float = 16.0,
               patterns: Sequence[str] = DEFAULT_LORA_PATTERNS, seed: int | None = 0) -> list[str]:
    """Replace every ``nn.Linear`` whose module name matches a glob in ``patterns``; freeze the rest.

    Returns the adapted module names. ``seed`` makes ``A``'s init reproducible (every data-parallel
    rank must start from the same adapters). Raises InputError if nothing matches.
    """
    if rank < 1:
        raise InputError(f"LoRA rank must be >= 1, got {rank}", field="lora_rank")
    hit = [(n, m) for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, g) for g in patterns)]
    names = [n for n, m in hit if isinstance(m, nn.Linear)]
    experts = [n for n, m in hit if not isinstance(m, nn.Linear)
               and (hf_experts.stored(m, "gate_up_proj") is not None
                    or any(p.dim() == 3 for p in m.parameters(recurse=False)))]
    for n in experts:
        if not hf_experts.standard_experts(model.get_submodule(n)):
            raise InputError(f"LoRA pattern match {n!r}: {type(model.get_submodule(n)).__name__} is not "
                             "transformers' standard fused experts layout (gate_up_proj [E, 2I, H], "
                             "no bias); its per-expert adapters are not supported", field="lora_patterns")
    if not names and not experts:
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:6]
        raise InputError(f"no nn.Linear matches {list(patterns)} (e.g. {linear})", field="lora_patterns")
    model.requires_grad_(False)
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng:
        if seed is not None:
            torch.manual_seed(seed)
        for n in names:
            parent_name, _, child = n.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha))
        for n in experts:
            mod = model.get_submodule(n)
            ref = hf_experts.stored(mod, "gate_up_proj")
            hf_experts.install(mod, lora=hf_experts.ExpertsLoRA(*hf_experts.experts_dims(mod), rank, alpha,
                                                                 dtype=ref.dtype, device=ref.device))
    return names + experts


def merge_lora_state_dict(state_dict: dict) -> dict:
    """Fold adapters into plain weights: ``<n>.weight = base.weight + s · B @ A`` (float32 math or
    wider, base dtype).

    Keys without adapters pass through, so the result has the base model's names. Per-expert
    adapters (``<experts>.lora.*``) are merged into ``<experts>.gate_up_proj`` / ``down_proj``.
    """
    out = {}
    for k, v in state_dict.items():
        if k.endswith(".lora_A") or k.endswith(".lora_B") or k.endswith(".lora_scaling"):
            continue
        if ".lora." in k:
            continue
        prefix, _, leaf = k.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj") and f"{prefix}.lora.scaling" in state_dict:
            lo = {p: state_dict[f"{prefix}.lora.{p}"] for p in
                  (f"{q}_{ab}" for q in hf_experts.PARTS for ab in "AB")}
            gu, dn = hf_experts.merge(state_dict[f"{prefix}.gate_up_proj"], state_dict[f"{prefix}.down_proj"],
                                      lo, float(state_dict[f"{prefix}.lora.scaling"]))
            out[k] = gu if leaf == "gate_up_proj" else dn
            continue
        if ".base." in k:
            prefix, _, leaf = k.rpartition(".base.")
            if leaf == "weight" and f"{prefix}.lora_A" in state_dict:
                acc = torch.promote_types(v.dtype, torch.float32)
                a, b = state_dict[f"{prefix}.lora_A"].to(acc), state_dict[f"{prefix}.lora_B"].to(acc)
                s = float(state_dict[f"{prefix}.lora_scaling"])
                v = (v.to(acc) + s * (b @ a)).to(v.dtype)
            out[f"{prefix}.{leaf}"] = v
        else:
            out[k] = v
    return out
