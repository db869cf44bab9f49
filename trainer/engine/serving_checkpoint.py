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


def qat_rules(recipe: str, pattern: str = EXPERTS_PATTERN, **opts) -> list:
    """The ``apply_qat`` rules that reproduce :func:`write_fake_quant_checkpoint`'s grid."""
    from skyrl_numerics.quant import QATRule

    return [QATRule(pattern, recipe, dict(opts))]


def write_fake_quant_checkpoint(src_dir: str | os.PathLike, recipe: str, *,
                                pattern: str = EXPERTS_PATTERN, out_dir=None, **opts) -> Path:
    """``src_dir`` with the expert weights fake-quantized, cached next to it by recipe.

    The tensors are written by :func:`skyrl_numerics.quant.checkpoint.write_fake_quantized_checkpoint`
    (per 2-D matrix, as ``apply_qat`` quantizes them); here the whole directory is built under a
    temp name and renamed, so a crash never leaves a half checkpoint where the cache looks.
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
