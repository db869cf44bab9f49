"""transformers' fused MoE experts, run with quantized GEMM inputs and per-expert LoRA.

transformers 5 stores a layer's routed experts as one module with 3-D parameters
(``gate_up_proj [E, 2I, H]``, gate rows first, and ``down_proj [E, H, I]``). A W4A4 / W8A8
engine quantizes the input of *both* GEMMs of every expert, and vLLM's MoE LoRA holds one
adapter per expert and projection; neither fits a hook on the module. This is the one place that
replaces such a module's forward (per instance, reversible), with the eager per-expert loop::

    x_q  = Q(x)
    g, u = x_q W_gu[e]ᵀ  (+ s·(x A_g[e]ᵀ) B_g[e]ᵀ,  + s·(x A_u[e]ᵀ) B_u[e]ᵀ)   adapters on raw x
    h    = apply_gate([g; u])                        the class's own gating (clamped SwiGLUs too)
    y_e  = Q(h) W_down[e]ᵀ  (+ s·(h A_d[e]ᵀ) B_d[e]ᵀ)
    out[t] += w[t, slot] · y_e[t]                   experts in ascending id, as transformers' loop

``Q`` is the module's activation quantizer (:func:`skyrl_numerics.quant.apply_qat`, identity
when none) and the adapter terms are added once in float32 (or wider), ``(y + s·lo).to(y.dtype)``: the
order of the invariant engine's :class:`~skyrl_numerics.invariant.numerics.Projection`,
whose per-expert adapters (``….experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight``) are these
tensors unstacked (:func:`served_adapters`). With neither, the loop is bitwise transformers'
eager forward (tested). Only the standard layout (:func:`standard_experts`) is replaced.
"""
from __future__ import annotations

import math
import types

import torch
from torch import nn
from torch.nn.utils import parametrize

PARTS = ("gate", "up", "down")


def stored(mod: nn.Module, name: str):
    """The stored parameter (a parametrized one is not read through its parametrization)."""
    if parametrize.is_parametrized(mod, name):
        return mod.parametrizations[name].original
    return mod._parameters.get(name)


def standard_experts(mod: nn.Module) -> bool:
    """transformers' standard fused layout: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
    no bias, the class's ``_apply_gate`` as the gating (the flags ``@use_experts_implementation``
    sets: concatenated, not transposed, gated)."""
    gu, dn = stored(mod, "gate_up_proj"), stored(mod, "down_proj")
    if gu is None or dn is None or gu.dim() != 3 or dn.dim() != 3:
        return False
    E, I2, H = gu.shape
    return (I2 % 2 == 0 and tuple(dn.shape) == (E, H, I2 // 2)
            and callable(getattr(mod, "_apply_gate", None))
            and getattr(mod, "is_concatenated", False) is True
            and getattr(mod, "is_transposed", True) is False
            and getattr(mod, "has_bias", True) is False and getattr(mod, "has_gate", False) is True
            and isinstance(getattr(mod, "num_experts", None), int))


def experts_dims(mod: nn.Module) -> tuple[int, int, int]:
    """``(E, H, I)`` of a standard experts module."""
    E, I2, H = stored(mod, "gate_up_proj").shape
    return int(E), int(H), int(I2) // 2


class ExpertsLoRA(nn.Module):
    """Per-expert adapters of one experts module: ``{gate,up,down}_A [E, r, in]`` (uniform in
    ``±1/sqrt(in)``, LoRALinear's Kaiming bound) and ``_B [E, out, r]`` (zero: a no-op start),
    ``scaling`` = alpha / r (a buffer: a state dict alone describes the adapted model)."""

    def __init__(self, E: int, H: int, I: int, rank: int, alpha: float, *, dtype, device=None):
        super().__init__()
        for part, (out, inp) in zip(PARTS, ((I, H), (I, H), (H, I))):
            a = torch.empty(E, rank, inp, dtype=dtype, device=device).uniform_(-1, 1) / math.sqrt(inp)
            setattr(self, f"{part}_A", nn.Parameter(a))
            setattr(self, f"{part}_B", nn.Parameter(torch.zeros(E, out, rank, dtype=dtype, device=device)))
        self.register_buffer("scaling", torch.tensor(alpha / rank, dtype=torch.float32))

    def per_expert(self) -> dict:
        """``{name: (tensor of expert 0, 1, ...)}``: ``unbind`` views, so the backward writes each
        parameter's gradient once (``t[e]`` per expert would allocate a whole ``[E, ...]``
        gradient per expert)."""
        return {f"{p}_{ab}": getattr(self, f"{p}_{ab}").unbind(0) for p in PARTS for ab in "AB"}

    def add(self, y: torch.Tensor, x: torch.Tensor, e: int, parts, views: dict) -> torch.Tensor:
        """``y`` (the base rows of ``parts``, side by side) + the adapters' rows, in float32."""
        lo = [(x @ views[f"{p}_A"][e].T) @ views[f"{p}_B"][e].T for p in parts]
        lo = lo[0] if len(lo) == 1 else torch.cat(lo, dim=-1)
        acc = torch.promote_types(y.dtype, torch.float32)      # bf16 -> float32; float64 stays
        return (y.to(acc) + float(self.scaling) * lo.to(acc)).to(y.dtype)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The module doc's loop (bound to a standard experts module by :func:`install`)."""
    quant = self.__dict__.get("_act_quant") or (lambda t: t)
    lora = self._modules.get("lora")
    # read once (a QAT weight: quantized once) and split per expert by unbind: its backward
    # stacks the experts' gradients once (indexing per expert would allocate a whole [E, ...]
    # gradient per expert: 30x transformers' grouped_mm at Qwen3-30B-A3B dims)
    w_gu, w_down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
    views = lora.per_expert() if lora is not None else None
    x = quant(hidden_states)
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        if e == self.num_experts:        # padding id (expert parallel: not a local expert)
            continue
        pos, tok = torch.where(mask[e])
        gu = nn.functional.linear(x[tok], w_gu[e])
        if lora is not None:
            gu = lora.add(gu, hidden_states[tok], e, ("gate", "up"), views)
        h = self._apply_gate(gu)
        y = nn.functional.linear(quant(h), w_down[e])
        if lora is not None:
            y = lora.add(y, h, e, ("down",), views)
        out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
    return out


def install(mod: nn.Module, *, act_quant=None, lora: ExpertsLoRA | None = None) -> None:
    """Run ``mod`` with :func:`experts_forward`, adding an activation quantizer and / or adapters."""
    if not standard_experts(mod):
        raise ValueError(f"{type(mod).__name__} is not the standard fused experts layout")
    if act_quant is not None:
        mod._act_quant = act_quant
    if lora is not None:
        mod.lora = lora
    mod.forward = types.MethodType(experts_forward, mod)


def uninstall(mod: nn.Module, *, act_quant: bool = False, lora: bool = False) -> None:
    """Remove what :func:`install` added; the class's forward is back once nothing is left."""
    if act_quant:
        mod.__dict__.pop("_act_quant", None)
    if lora and "lora" in mod._modules:
        del mod.lora
    if "_act_quant" not in mod.__dict__ and "lora" not in mod._modules:
        mod.__dict__.pop("forward", None)


def served_adapters(prefix: str, lora_state: dict) -> dict:
    """``{prefix}.lora.{p}_A [E, r, in]`` -> ``{prefix}.{e}.{p}_proj.lora_A.weight [r, in]`` (the
    engine's per-expert names), ``_B`` alike; ``lora_state`` maps ``{p}_A`` / ``{p}_B`` to tensors."""
    out = {}
    for p in PARTS:
        for ab in ("A", "B"):
            t = lora_state[f"{p}_{ab}"]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{p}_proj.lora_{ab}.weight"] = t[e]
    return out


def merge(gate_up: torch.Tensor, down: torch.Tensor, lora_state: dict, scaling: float):
    """``W + s · B A`` per expert (float32 math, or wider; the weights' dtype): the merged
    ``(gate_up_proj, down_proj)``."""
    acc = torch.promote_types(gate_up.dtype, torch.float32)

    def d(p):
        return torch.einsum("eor,eri->eoi", lora_state[f"{p}_B"].to(acc), lora_state[f"{p}_A"].to(acc))
    gu = gate_up.to(acc) + scaling * torch.cat([d("gate"), d("up")], dim=1)
    dn = down.to(acc) + scaling * d("down")
    return gu.to(gate_up.dtype), dn.to(down.dtype)
