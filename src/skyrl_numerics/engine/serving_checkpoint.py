"""A serving checkpoint whose MoE expert weights sit on a low-precision grid (NVFP4, INT4, …).

It stands in for a model served quantized: the expert weights are replaced by
``fake_quant(w, recipe)`` (stored in the model dtype), so vLLM serves exactly the values a real
NVFP4 / INT4 kernel would dequantize to. A trainer that keeps full-precision experts then sees a
gap on every token; a trainer with ``apply_qat`` under the same rule reproduces the grid bit for
bit and the gap falls back to the kernel-level baseline.
"""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from skyrl_numerics.atomic import atomic_dir

EXPERTS_PATTERN = "*.mlp.experts"
#: the attention projections (module names), what :func:`write_int4_checkpoint` quantizes
ATTENTION_PATTERN = "*.self_attn.*_proj"


def qat_rules(recipe: str, pattern: str = EXPERTS_PATTERN, **opts) -> list:
    """The ``apply_qat`` rules that reproduce :func:`cached_fake_quant_checkpoint`'s grid.

    ``recipe`` may name its module patterns itself, ``"RECIPE@PAT1|PAT2"`` (e.g.
    ``"int4_g32@*.self_attn.*_proj"``): one rule per pattern (how the doctor keys a trainer
    matched to :func:`write_int4_checkpoint`)."""
    from skyrl_numerics.quant import QATRule

    if "@" in recipe:
        recipe, pats = recipe.split("@", 1)
        return [QATRule(p, recipe, dict(opts)) for p in pats.split("|") if p]
    return [QATRule(pattern, recipe, dict(opts))]


def write_int4_checkpoint(src_dir: str | os.PathLike, *, experts: bool = False, group: int = 32,
                          out_dir=None) -> Path:
    """A real compressed-tensors ``pack-quantized`` INT4 checkpoint (W4A16, symmetric groups of
    ``group``) of ``src_dir``, served by vLLM's INT4 kernels (CPU: ``CPUWNA16LinearKernel``).

    The attention projections are quantized (and the MoE experts with ``experts=True``); the
    router, embeddings, norms and ``lm_head`` stay in the model dtype and are listed in the
    config's ``ignore``. Codes and scales are ``quant.quantize(w, "int4_g32", group=group)`` of
    each matrix, so ``qat_rules(int4_qat_spec(experts))`` makes a trainer hold the same grid.
    Cached next to ``src_dir``; built under a temp name and renamed."""
    import shutil

    from skyrl_numerics.quant.checkpoint import write_quantized_checkpoint

    if group not in (32, 128):
        raise ValueError(f"group {group}: compressed-tensors INT4 here is group 32 or 128")
    fmt = "ct_int4" if group == 32 else "ct_int4_g128"
    src = Path(src_dir)
    tag = f"int4-g{group}-{'attn+experts' if experts else 'attn'}"
    out = Path(out_dir) if out_dir is not None else src.parent / f"{src.name}-{tag}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out

    def match(name: str) -> bool:
        module = name.rsplit(".", 1)[0]
        if fnmatch.fnmatchcase(module, ATTENTION_PATTERN):
            return True
        return experts and fnmatch.fnmatchcase(name.rsplit(".", 3)[0], EXPERTS_PATTERN)
    with atomic_dir(out) as tmp:
        if not write_quantized_checkpoint(src, tmp, fmt, match):
            raise ValueError(f"no attention projection weights in {src}")
        for extra in src.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and not (Path(tmp) / extra.name).exists():
                shutil.copy2(extra, Path(tmp) / extra.name)
    return out


def int4_qat_spec(experts: bool = False) -> str:
    """The ``qat`` key (``RECIPE@patterns``, see :func:`qat_rules`) matching
    :func:`write_int4_checkpoint` with its default group 32 (for group 128 build the rules with
    ``qat_rules("int4_g32", pattern, group=128)``)."""
    pats = ATTENTION_PATTERN + (f"|{EXPERTS_PATTERN}" if experts else "")
    return f"int4_g32@{pats}"


def cached_fake_quant_checkpoint(src_dir: str | os.PathLike, recipe: str, *,
                                 pattern: str = EXPERTS_PATTERN, out_dir=None, **opts) -> Path:
    """``src_dir`` with the weights of the modules matching ``pattern`` (the experts)
    fake-quantized: its folder, built once and cached next to ``src_dir`` by recipe.

    The tensors are written by :func:`skyrl_numerics.quant.checkpoint.write_fake_quantized_checkpoint`
    (into a given folder, for the weights a predicate picks, per 2-D matrix as ``apply_qat``
    quantizes them); here the whole directory is built under a temp name and renamed, so a
    crash never leaves a half checkpoint where the cache looks.
    """
    from skyrl_numerics.quant.checkpoint import write_fake_quantized_checkpoint

    src = Path(src_dir)
    tag = "-".join([recipe] + [f"{k}={v}" for k, v in sorted(opts.items())])
    out = Path(out_dir) if out_dir is not None else src.parent / f"{src.name}-fq-{tag}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    # checkpoint names of expert matrices: model.layers.<i>.mlp.experts.<e>.<proj>.weight
    match = lambda name: fnmatch.fnmatchcase(name.rsplit(".", 3)[0], pattern)
    with atomic_dir(out) as tmp:
        if not write_fake_quantized_checkpoint(src, tmp, recipe, match, **opts):
            raise ValueError(f"pattern {pattern!r} matched no weight in {src}")
    return out
