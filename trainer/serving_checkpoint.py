"""A serving checkpoint whose MoE expert weights sit on a low-precision grid (NVFP4, INT4, …).

It stands in for a model served quantized: the expert weights are replaced by
``fake_quant(w, recipe)`` (stored in the model dtype), so vLLM serves exactly the values a real
NVFP4 / INT4 kernel would dequantize to. A trainer that keeps full-precision experts then sees a
gap on every token; a trainer with ``apply_qat`` under the same rule reproduces the grid bit for
bit and the gap falls back to the kernel-level baseline.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

EXPERTS_PATTERN = "*.mlp.experts"


def qat_rules(recipe: str, pattern: str = EXPERTS_PATTERN, **opts) -> list:
    """The ``apply_qat`` rules that reproduce :func:`write_fake_quant_checkpoint`'s grid."""
    from skyrl_numerics.quant import QATRule

    return [QATRule(pattern, recipe, dict(opts))]


def write_fake_quant_checkpoint(src_dir: str | os.PathLike, recipe: str, *,
                                pattern: str = EXPERTS_PATTERN, out_dir=None, **opts) -> Path:
    """Copy ``src_dir`` with the weights matched by ``pattern`` fake-quantized; cached by name.

    Written to a temp dir and renamed, so a crash leaves no half checkpoint.
    """
    import torch

    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.quant import apply_qat, remove_qat

    src = Path(src_dir)
    tag = "-".join([recipe] + [f"{k}={v}" for k, v in sorted(opts.items())])
    out = Path(out_dir) if out_dir is not None else src.parent / f"{src.name}-fq-{tag}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    model = load_hf_model(src)
    with torch.no_grad():
        apply_qat(model, qat_rules(recipe, pattern, **opts))
        remove_qat(model, bake=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        # keep the source's config.json (dtype fields, naming) byte for byte
        shutil.copy(src / "config.json", tmp / "config.json")
        try:
            os.replace(tmp, out)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
