"""Quantized checkpoints: write them (modelopt NVFP4, compressed-tensors INT4) and check that a
trainer reproduces their codes (``qat_check``, the day-0 bring-up check behind
``skyrl-numerics qat-check MODEL_DIR``).

Layouts recognised (per quantized weight ``P``, any leading name, 2-D ``[out, in]``):

* modelopt NVFP4: ``P.weight`` uint8 ``[out, in/2]`` (E2M1 packed, low nibble first),
  ``P.weight_scale`` float8_e4m3fn ``[out, in/16]``, ``P.weight_scale_2`` float32 scalar
  (``amax/2688``), optional ``P.input_scale``.
* compressed-tensors pack-quantized INT4: ``P.weight_packed`` int32 ``[out, in/8]``,
  ``P.weight_scale`` ``[out, in/group]`` (weight dtype), ``P.weight_shape`` int ``[2]``.

``qat_check`` rebuilds each :class:`QTensor`, dequantizes it to the training dtype (what a trainer
holds), and re-encodes it two ways:

* static: with the stored scales (``requantize``): must give back every stored code;
* dynamic: recomputing the scales from the dequantized weight (what ``apply_qat`` does each step).

It reports per tensor whether codes and scales are exact and the max |error| of the trainer's
fake-quantized weight against the stored one.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from skyrl_numerics.errors import InputError

from . import codecs as C
from .api import dequantize, quantize, requantize
from .qtensor import QTensor
from .recipes_int4 import pack_int4_to_int32, unpack_int4_from_int32

FORMATS = ("modelopt_nvfp4", "ct_int4")


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _atomic_json(obj, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def quantize_weight_tensors(name: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for one 2-D weight ``name`` (ending in ``.weight``) in ``fmt``."""
    if not name.endswith(".weight") or w.dim() != 2:
        raise InputError(f"expected a 2-D '*.weight' tensor, got {name} with shape {tuple(w.shape)}", field=name)
    prefix = name[: -len(".weight")]
    if fmt == "modelopt_nvfp4":
        q = quantize(w, "nvfp4", convention="modelopt")
        return {f"{prefix}.weight": q.codes, f"{prefix}.weight_scale": q.scales,
                f"{prefix}.weight_scale_2": q.global_scale.reshape(())}
    if fmt == "ct_int4":
        q = quantize(w, "int4_g32")
        return {f"{prefix}.weight_packed": pack_int4_to_int32(q.codes), f"{prefix}.weight_scale": q.scales,
                f"{prefix}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    raise InputError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}", field="fmt")


def write_quantized_checkpoint(src_dir, out_dir, fmt: str, should_quantize) -> list[str]:
    """Copy an HF safetensors checkpoint, storing the 2-D weights for which
    ``should_quantize(name)`` is true in ``fmt``. Returns the quantized names. Writes each file to
    a temp name then renames; ``config.json`` gets a ``quantization_config``."""
    from safetensors.torch import load_file
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = []
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise InputError(f"no *.safetensors files in {src}", field="src_dir")
    for f in files:
        tensors = load_file(str(f))
        new: dict[str, torch.Tensor] = {}
        for k, v in tensors.items():
            if v.dim() == 2 and k.endswith(".weight") and should_quantize(k):
                new.update(quantize_weight_tensors(k, v, fmt))
                done.append(k)
            else:
                new[k] = v
        _atomic_save(new, out / f.name)
    cfg = json.loads((src / "config.json").read_text()) if (src / "config.json").exists() else {}
    cfg["quantization_config"] = (
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16} if fmt == "modelopt_nvfp4"
        else {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                        "strategy": "group", "group_size": 32}}}})
    _atomic_json(cfg, out / "config.json")
    return done


def write_fake_quantized_checkpoint(src_dir, out_dir, recipe: str, should_quantize, **opts) -> list[str]:
    """Copy an HF safetensors checkpoint with the chosen 2-D weights replaced by
    ``fake_quant(w, recipe, **opts)`` in their own dtype (per matrix, as ``apply_qat`` quantizes
    them). Serve this with a plain engine and train the *original* weights under ``apply_qat``
    with the same recipe: both sides then use identical weights (the doctor's "fake-quant
    matched" row). Returns the replaced names."""
    import shutil

    from safetensors.torch import load_file

    from .api import fake_quant
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise InputError(f"no *.safetensors files in {src}", field="src_dir")
    done = []
    for f in files:
        tensors = load_file(str(f))
        for k, v in tensors.items():
            if v.dim() == 2 and v.is_floating_point() and should_quantize(k):
                tensors[k] = fake_quant(v, recipe, **opts)
                done.append(k)
        _atomic_save(tensors, out / f.name)
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and not (out / extra.name).exists():
            shutil.copy2(extra, out / extra.name)
    return done


def load_qtensors(model_dir, dtype: torch.dtype = torch.bfloat16) -> dict[str, QTensor]:
    """Every quantized weight of a checkpoint as a :class:`QTensor` (keys: ``P.weight``)."""
    from safetensors import safe_open
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise InputError(f"no *.safetensors files in {d}", field="model_dir")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    out: dict[str, QTensor] = {}
    for k, v in tensors.items():
        if not k.endswith(".weight_scale"):
            continue
        p = k[: -len(".weight_scale")]
        if f"{p}.weight_scale_2" in tensors and f"{p}.weight" in tensors:
            codes = tensors[f"{p}.weight"]
            if codes.dtype != torch.uint8 or v.dtype != torch.float8_e4m3fn:
                raise InputError(f"NVFP4 weight {p}: expected uint8 codes and float8_e4m3fn scales, "
                                 f"got {codes.dtype} and {v.dtype}", field=p)
            shape = (codes.shape[0], codes.shape[1] * 2)
            if v.shape != (shape[0], shape[1] // 16):
                raise InputError(f"NVFP4 weight {p}: scale shape {tuple(v.shape)} does not match "
                                 f"{(shape[0], shape[1] // 16)}", field=p)
            out[f"{p}.weight"] = QTensor("nvfp4", codes, v, tensors[f"{p}.weight_scale_2"].float().reshape(()),
                                         (1, 16), shape, dtype, {"convention": "modelopt", "tile": (1, 16)})
        elif f"{p}.weight_packed" in tensors:
            shape = tuple(int(s) for s in tensors[f"{p}.weight_shape"].tolist())
            group = shape[1] // v.shape[1]
            q = unpack_int4_from_int32(tensors[f"{p}.weight_packed"], shape[1])
            out[f"{p}.weight"] = QTensor("int4_g32", q, v, None, (1, group), shape, dtype,
                                         {"group": group, "scale_dtype": v.dtype})
    return out


@dataclass
class QATCheckReport:
    """Per-tensor rows and a summary; ``ok`` when every stored code re-encodes exactly (static)."""

    model_dir: str
    rows: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r["static_exact"] for r in self.rows)

    def summary(self) -> dict:
        n = len(self.rows)
        return {"tensors": n, "static_exact": sum(r["static_exact"] for r in self.rows),
                "dynamic_exact": sum(r["dynamic_exact"] for r in self.rows),
                "max_abs_err_dynamic": max((r["max_abs_err_dynamic"] for r in self.rows), default=0.0)}

    def to_text(self) -> str:
        lines = [f"qat-check {self.model_dir}: {'OK' if self.ok else 'MISMATCH'} {self.summary()}"]
        for r in self.rows:
            lines.append(f"  {r['name']:<60} {r['recipe']:<9} static {'exact' if r['static_exact'] else 'DIFF'}"
                         f" ({r['static_code_mismatches']} codes)  dynamic "
                         f"{'exact' if r['dynamic_exact'] else 'diff'} ({r['dynamic_code_mismatches']} codes, "
                         f"{r['dynamic_scale_mismatches']} scales, max|err| {r['max_abs_err_dynamic']:.3g})")
        return "\n".join(lines)


def _code_view(q: QTensor) -> torch.Tensor:
    if q.recipe == "nvfp4":
        c = C.unpack_fp4(q.codes)
        if q.opts.get("convention") in ("modelopt", "compressed_tensors"):   # -0 re-encodes as +0
            c = torch.where(c == 8, 0, c)
        return c
    return q.codes.view(torch.uint8) if q.codes.dtype.itemsize == 1 and q.codes.is_floating_point() else q.codes


def _scale_bits(q: QTensor) -> torch.Tensor:
    s = q.scales
    return s.view(torch.uint8) if s.dtype.itemsize == 1 else s


def qat_check(model_dir, dtype: torch.dtype = torch.bfloat16) -> QATCheckReport:
    """Check that a quantized checkpoint round-trips through a trainer holding ``dtype`` weights."""
    qts = load_qtensors(model_dir, dtype)
    if not qts:
        raise InputError(f"no quantized weights (modelopt NVFP4 or compressed-tensors INT4) in {model_dir}",
                         field="model_dir")
    rep = QATCheckReport(str(model_dir))
    for name, q in sorted(qts.items()):
        w = dequantize(q, dtype)
        st = requantize(w, q)
        dy = quantize(w, q.recipe, **{k: v for k, v in q.opts.items() if k in ("convention", "tile", "group")})
        st_mis = int((_code_view(st) != _code_view(q)).sum())
        dy_mis = int((_code_view(dy) != _code_view(q)).sum())
        sc_mis = int((_scale_bits(dy) != _scale_bits(q)).sum())
        err = float((dequantize(dy, torch.float32) - w.float()).abs().max())
        rep.rows.append({"name": name, "recipe": q.recipe, "shape": list(q.shape),
                         "static_exact": st_mis == 0, "static_code_mismatches": st_mis,
                         "dynamic_exact": dy_mis == 0 and sc_mis == 0, "dynamic_code_mismatches": dy_mis,
                         "dynamic_scale_mismatches": sc_mis, "max_abs_err_dynamic": err})
    return rep
