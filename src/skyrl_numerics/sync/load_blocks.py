"""vLLM's load blocks: the checkpoint tensors vLLM loads together.

vLLM fuses some checkpoint tensors into one parameter (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``, every expert of a layer into one ``w13``/``w2``), and reloads such a parameter
whole. An update must therefore carry every tensor of each block it touches: a block is the
module path up to the submodule of a numbered layer (``model.layers.<i>.<mlp|self_attn|...>``),
or the tensor's parent module outside the layers (``lm_head``, ``model.embed_tokens``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant.multimodal import is_multimodal, text_weight_name


def block_of(name: str) -> str:
    """The whole-block group a checkpoint tensor belongs to (see module docstring)."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] in ("layers", "h", "blocks") and parts[i + 1].isdigit():
            return ".".join(parts[:i + 3])
    return ".".join(parts[:-1]) or name


_NAME_CACHE: dict[str, frozenset[str]] = {}


def checkpoint_names(model_dir: str | os.PathLike) -> frozenset[str]:
    """Tensor names stored in a checkpoint directory's ``*.safetensors`` files (headers only);
    of a multimodal checkpoint run text only (``invariant/multimodal.py``), its language model's
    under the text names the trainer sends (the vision tower's left out)."""
    key = str(model_dir)
    if key not in _NAME_CACHE:
        from safetensors import safe_open

        names: set[str] = set()
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                names.update(h.keys())
        cfg = Path(model_dir) / "config.json"
        if cfg.is_file() and is_multimodal(json.loads(cfg.read_text())):
            names = {t for t in map(text_weight_name, names) if t is not None}
        _NAME_CACHE[key] = frozenset(names)
    return _NAME_CACHE[key]


def check_complete_blocks(names: Iterable[str], all_names: Iterable[str]) -> None:
    """Raise ``InputError`` unless ``names`` ⊆ ``all_names`` and covers whole blocks."""
    names, all_names = set(names), set(all_names)
    unknown = sorted(names - all_names)
    if unknown:
        raise InputError(f"tensor {unknown[0]!r} is not in the engine's checkpoint "
                         f"({len(unknown)} unknown names)", field="named_tensors")
    touched = {block_of(n) for n in names}
    missing = sorted(n for n in all_names - names if block_of(n) in touched)
    if missing:
        raise InputError(f"partial update of block {block_of(missing[0])!r} lacks {missing[0]!r} "
                         f"({len(missing)} tensors missing); vLLM reloads fused layers whole, so "
                         "send every tensor of each block you update", field="named_tensors")


def expand_to_blocks(names: Iterable[str], all_names: Iterable[str]) -> list[str]:
    """Every name in ``all_names`` that shares a block with one of ``names`` (in order)."""
    blocks = {block_of(n) for n in names}
    return [n for n in all_names if block_of(n) in blocks]
