"""Run a model from a quantized checkpoint keeping only codes + scales in memory.

``load_quantized_weights(model, model_dir)`` reads a checkpoint written in modelopt NVFP4 or
compressed-tensors NVFP4 / INT4 (see ``checkpoint``), loads its plain tensors into ``model`` and, for every
quantized weight, replaces the parameter by a parametrization that holds the stored codes and
scales as buffers and dequantizes them on each access. The base weights are frozen (they have no
full-precision copy), so adapters (LoRA) train on top of exactly the weights the server uses —
the Mistral-Large / Kimi INT4 path. Fused MoE experts (transformers 5 ``[E, out, in]``
parameters) are taken from the checkpoint's stacked 3-D tensor of the same name (one quantized
matrix per expert) when it has one, else assembled from its per-expert
``experts.{e}.{gate,up,down}_proj``.

Wrap forwards in ``torch.nn.utils.parametrize.cached()`` to dequantize each weight once per step.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from skyrl_numerics.errors import InputError

from .api import dequantize
from .checkpoint import QUANT_SUFFIXES, load_qtensors
from .qtensor import QTensor


class _QBuf(nn.Module):
    """One QTensor as buffers (so ``.to(device)`` moves it) plus its metadata."""

    def __init__(self, q: QTensor):
        super().__init__()
        self.register_buffer("codes", q.codes)
        self.register_buffer("scales", q.scales)
        self.register_buffer("global_scale", q.global_scale if q.global_scale is not None else torch.empty(0))
        self.meta = (q.recipe, q.block, q.shape, q.dtype, dict(q.opts))

    def qtensor(self) -> QTensor:
        recipe, block, shape, dtype, opts = self.meta
        g = self.global_scale if self.global_scale.numel() else None
        return QTensor(recipe, self.codes, self.scales, g, block, shape, dtype, opts)


class DequantWeight(nn.Module):
    """Parametrization ignoring the (empty) original and returning the dequantized weight.

    ``layout``: ``"2d"`` (one matrix), ``"gate_up"`` (``[E, 2I, H]`` from gate and up per expert),
    ``"experts"`` (``[E, out, in]`` from one matrix per expert)."""

    def __init__(self, pieces: list[QTensor], layout: str, dtype: torch.dtype):
        super().__init__()
        self.pieces = nn.ModuleList(_QBuf(q) for q in pieces)
        self.layout, self.dtype = layout, dtype

    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            w = [dequantize(p.qtensor(), self.dtype) for p in self.pieces]
            if self.layout == "2d":
                return w[0]
            if self.layout == "gate_up":
                return torch.stack([torch.cat(w[i:i + 2], 0) for i in range(0, len(w), 2)])
            return torch.stack(w)


def _stored_part_of(key: str, qparams: set[str]) -> bool:
    """Whether checkpoint tensor ``key`` is one of a quantized parameter's stored pieces."""
    return any(key.endswith(suf) and key[: len(key) - len(suf)] in qparams for suf in QUANT_SUFFIXES)


def _attach(module: nn.Module, pname: str, pieces: list[QTensor], layout: str, dtype: torch.dtype) -> None:
    old = getattr(module, pname)
    setattr(module, pname, nn.Parameter(torch.empty(0, dtype=dtype, device=old.device), requires_grad=False))
    parametrize.register_parametrization(module, pname, DequantWeight(pieces, layout, dtype), unsafe=True)
    got = getattr(module, pname)
    if tuple(got.shape) != tuple(old.shape):
        raise InputError(f"quantized weight for {pname} has shape {tuple(got.shape)}, the model expects "
                         f"{tuple(old.shape)}", field=pname)


def load_quantized_weights(model: nn.Module, model_dir, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Load ``model_dir`` into ``model`` (see module doc). Returns
    ``{"quantized": [...], "plain": n_plain_tensors, "unused": [...]}``."""
    from pathlib import Path

    from safetensors import safe_open
    qts = load_qtensors(model_dir, dtype)
    used: set[str] = set()
    quantized = []
    modules = dict(model.named_modules())
    for mname, mod in modules.items():
        if isinstance(mod, nn.Linear) and f"{mname}.weight" in qts:
            _attach(mod, "weight", [qts[f"{mname}.weight"]], "2d", dtype)
            used.add(f"{mname}.weight")
            quantized.append(f"{mname}.weight")
            continue
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.dim() != 3:
                continue
            E = p.shape[0]
            if f"{mname}.{pname}[0]" in qts:                  # stored stacked: one matrix per expert
                keys = [f"{mname}.{pname}[{e}]" for e in range(E)]
                layout = "experts"
            elif pname == "gate_up_proj":
                keys = [f"{mname}.{e}.{k}_proj.weight" for e in range(E) for k in ("gate", "up")]
                layout = "gate_up"
            else:
                keys = [f"{mname}.{e}.{pname}.weight" for e in range(E)]
                layout = "experts"
            if all(k in qts for k in keys):
                _attach(mod, pname, [qts[k] for k in keys], layout, dtype)
                used.update(keys)
                quantized.append(f"{mname}.{pname}")
    # plain tensors: everything in the checkpoint that the model has under the same name
    state = model.state_dict()
    n_plain, unused = 0, []
    qparams = {k.split("[")[0] for k in qts}
    qprefixes = {k[: -len(".weight")] for k in qparams if k.endswith(".weight")}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k.rsplit(".", 1)[0] in qprefixes or _stored_part_of(k, qparams):
                    continue
                if k in state and tuple(state[k].shape) == tuple(fh.get_slice(k).get_shape()):
                    with torch.no_grad():
                        state[k].copy_(fh.get_tensor(k))
                    n_plain += 1
                else:
                    unused.append(k)
    return {"quantized": quantized, "plain": n_plain, "unused": unused}
