"""A small LoRA: low-rank adapters on ``nn.Linear`` layers chosen by glob over module names.

    y = x W^T + b + s · (x A^T) B^T,    A ∈ R^{r×in}, B ∈ R^{out×r},  s = alpha / r

``A`` starts Kaiming-uniform and ``B`` at zero, so the adapted model equals the base model before
the first update. The base weights are frozen. The scale is a persistent buffer (``lora_scaling``)
so a state dict alone is enough to merge: ``W' = W + s · B A`` (:func:`merge_lora_state_dict`, what
a weight sync to an inference engine sends).

Parameter names: ``<name>.base.weight`` / ``.base.bias`` (frozen) and ``<name>.lora_A`` /
``<name>.lora_B``. MoE experts stored as fused 3-D parameters (Qwen3-MoE in transformers 5) are
not ``nn.Linear`` and are not adapted.
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
from typing import Sequence

import torch
from torch import nn

from skyrl_numerics.errors import InputError

__all__ = ["LoRALinear", "apply_lora", "merge_lora_state_dict", "DEFAULT_TARGETS"]

DEFAULT_TARGETS = ("*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj")


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
               targets: Sequence[str] = DEFAULT_TARGETS, seed: int | None = 0) -> list[str]:
    """Replace every ``nn.Linear`` whose module name matches a glob in ``targets``; freeze the rest.

    Returns the adapted module names. ``seed`` makes ``A``'s init reproducible (every data-parallel
    rank must start from the same adapters). Raises InputError if nothing matches.
    """
    if rank < 1:
        raise InputError(f"LoRA rank must be >= 1, got {rank}", field="lora_rank")
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and any(fnmatch.fnmatchcase(n, g) for g in targets)]
    if not names:
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:6]
        raise InputError(f"no nn.Linear matches {list(targets)} (e.g. {linear})", field="lora_targets")
    model.requires_grad_(False)
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng:
        if seed is not None:
            torch.manual_seed(seed)
        for n in names:
            parent_name, _, child = n.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha))
    return names


def merge_lora_state_dict(state_dict: dict) -> dict:
    """Fold adapters into plain weights: ``<n>.weight = base.weight + s · B @ A`` (float32 math, base dtype).

    Keys without adapters pass through, so the result has the base model's names.
    """
    out = {}
    for k, v in state_dict.items():
        if k.endswith(".lora_A") or k.endswith(".lora_B") or k.endswith(".lora_scaling"):
            continue
        if ".base." in k:
            prefix, _, leaf = k.rpartition(".base.")
            if leaf == "weight" and f"{prefix}.lora_A" in state_dict:
                a, b = state_dict[f"{prefix}.lora_A"].float(), state_dict[f"{prefix}.lora_B"].float()
                s = float(state_dict[f"{prefix}.lora_scaling"])
                v = (v.float() + s * (b @ a)).to(v.dtype)
            out[f"{prefix}.{leaf}"] = v
        else:
            out[k] = v
    return out
