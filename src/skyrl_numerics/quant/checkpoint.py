"""Quantized checkpoints: write them (modelopt NVFP4, compressed-tensors NVFP4 / INT4) and check that a
trainer reproduces their codes (``qat_check``, the day-0 bring-up check behind
``skyrl-numerics qat-check MODEL_DIR``).

Layouts recognised. Every stored tensor is named after the quantized parameter ``P`` plus a
suffix (``P`` is ``X.weight`` for a Linear, or e.g. ``X.experts.gate_up_proj`` for fused experts):

* modelopt NVFP4: ``P`` uint8 ``[out, in/2]`` (E2M1 packed, low nibble first),
  ``P_scale`` float8_e4m3fn ``[out, in/16]``, ``P_scale_2`` float32 scalar ``g = amax/2688``
  (a *decode* scale), optional ``X.input_scale``.
* compressed-tensors ``nvfp4-pack-quantized``: ``P_packed`` uint8 ``[out, in/2]`` (same packing),
  ``P_scale`` float8_e4m3fn ``[out, in/16]``, ``P_global_scale`` float32 ``[1]``
  ``G = 2688/amax`` (an *encode* scale, the reciprocal of modelopt's ``weight_scale_2``:
  compressed-tensors' modelopt converter stores ``1 / weight_scale_2`` there); dequant
  ``y * fl(s / G)``.
* compressed-tensors ``pack-quantized`` INT4: ``P_packed`` int32 ``[out, in/8]``,
  ``P_scale`` ``[out, in/group]`` (weight dtype), ``P_shape`` int ``[2]``.

Fused 3-D experts (``P`` of shape ``[E, out, in]``, as transformers >= 5 holds
``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``) are quantized per expert
matrix and stored stacked: codes ``[E, out, in/2]`` (``[E, out, in/8]`` int32 for INT4), scales
``[E, out, in/16]``, one global per expert (``P_scale_2`` / ``P_global_scale`` of shape ``[E]``),
``P_shape = [E, out, in]``. They are read back as one :class:`QTensor` per expert, keyed
``P[e]``.

``qat_check`` rebuilds each :class:`QTensor`, dequantizes it to the training dtype (what a trainer
holds), and re-encodes it two ways:

* static: with the stored scales (``requantize``): must give back every stored code;
* dynamic: recomputing the scales from the dequantized weight (what ``apply_qat`` does each step).

It reports per tensor whether codes and scales are exact and the max |error| of the trainer's
fake-quantized weight against the stored one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from skyrl_numerics.atomic import atomic_file
from skyrl_numerics.errors import InputError

from . import codecs as C
from .api import dequantize, quantize, requantize
from .qtensor import QTensor
from .recipes_int4 import pack_int4_to_int32

FORMATS = ("modelopt_nvfp4", "ct_nvfp4", "ct_int4", "ct_int4_g128", "ct_fp8_channel", "ct_fp8_block",
           "modelopt_fp8", "deepseek_fp8")
#: what the formats append to a quantized parameter's name for its stored tensors
QUANT_SUFFIXES = ("", "_scale", "_scale_2", "_packed", "_global_scale", "_shape", "_scale_inv")


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file
    with atomic_file(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))


def _atomic_json(obj, path: Path) -> None:
    with atomic_file(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=2)


def _quantize_matrix(w: torch.Tensor, fmt: str, global_amax=None) -> dict[str, torch.Tensor]:
    """``{suffix: tensor}`` for one 2-D matrix in ``fmt`` (suffixes appended to the param name).
    ``global_amax`` (NVFP4 only): the amax the per-tensor global is computed from, e.g. the max
    over the projections serving fuses (q/k/v, gate/up); default: this matrix's own."""
    if fmt == "modelopt_nvfp4":
        q = quantize(w, "nvfp4", convention="modelopt", global_amax=global_amax)
        return {"": q.codes, "_scale": q.scales, "_scale_2": q.global_scale.reshape(())}
    if fmt == "ct_nvfp4":
        q = quantize(w, "nvfp4", convention="compressed_tensors", global_amax=global_amax)
        return {"_packed": q.codes, "_scale": q.scales, "_global_scale": q.global_scale.reshape(1)}
    if fmt in ("ct_int4", "ct_int4_g128"):
        q = quantize(w, "int4_g32", group=128 if fmt == "ct_int4_g128" else 32)
        return {"_packed": pack_int4_to_int32(q.codes), "_scale": q.scales,
                "_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if fmt == "modelopt_fp8":                  # modelopt's export: the quotient rounds in the weight dtype
        from .vendor_check.schemes import modelopt_fp8_quantize
        q = modelopt_fp8_quantize(w)
        return {"": q.codes, "_scale": q.scales.reshape(())}
    if fmt in ("ct_fp8_channel", "ct_fp8_block", "modelopt_fp8"):
        block = {"ct_fp8_channel": (1, -1), "ct_fp8_block": (128, 128), "modelopt_fp8": (-1, -1)}[fmt]
        sd = torch.float32 if fmt == "modelopt_fp8" else w.dtype      # ct: observer (= scale) dtype
        q = quantize(w, "fp8_channel", block=block, scale_dtype=sd)
        return {"": q.codes, "_scale": q.scales.reshape(()) if fmt == "modelopt_fp8" else q.scales}
    if fmt == "deepseek_fp8":
        q = quantize(w, "fp8_block", block=(128, 128))
        return {"": q.codes, "_scale_inv": q.scales}
    raise InputError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}", field="fmt")


def quantize_weight_tensors(name: str, w: torch.Tensor, fmt: str, global_amax=None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for one weight ``name`` in ``fmt``: a 2-D ``*.weight`` matrix, or a
    3-D ``[E, out, in]`` stack of expert matrices (each quantized on its own, results stacked;
    per-expert globals ``[E]``). ``global_amax`` (NVFP4): a scalar, or ``[E]`` for a stack."""
    if fmt not in FORMATS:
        raise InputError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}", field="fmt")
    if w.dim() == 2 and name.endswith(".weight"):
        return {name + k: v for k, v in _quantize_matrix(w, fmt, global_amax).items()}
    if w.dim() != 3:
        raise InputError(f"expected a 2-D '*.weight' tensor or a 3-D [E, out, in] expert stack, got {name} "
                         f"with shape {tuple(w.shape)}", field=name)
    per = [_quantize_matrix(w[e], fmt, None if global_amax is None else global_amax[e])
           for e in range(w.shape[0])]
    out = {}
    for k in per[0]:
        if k == "_shape":
            out[name + k] = torch.tensor(list(w.shape), dtype=torch.int64)
        elif k in ("_scale_2", "_global_scale") or (k == "_scale" and per[0][k].dim() == 0):
            out[name + k] = torch.stack([p[k].reshape(()) for p in per])
        else:
            out[name + k] = torch.stack([p[k] for p in per])
    return out


def _quantization_config(fmt: str) -> dict:
    if fmt == "modelopt_nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    if fmt == "ct_nvfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                   "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "format": "nvfp4-pack-quantized"}}}
    if fmt == "modelopt_fp8":
        return {"quant_method": "modelopt", "quant_algo": "FP8"}
    if fmt == "deepseek_fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if fmt in ("ct_fp8_channel", "ct_fp8_block"):
        w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
             "strategy": "channel" if fmt == "ct_fp8_channel" else "block"}
        if fmt == "ct_fp8_block":
            w["block_structure"] = [128, 128]
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "format": "float-quantized"}}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group",
                                                      "group_size": 128 if fmt == "ct_int4_g128" else 32}}}}


def write_quantized_checkpoint(src_dir, out_dir, fmt: str, should_quantize, *, ignore="auto") -> list[str]:
    """Copy an HF safetensors checkpoint, storing the floating-point 2-D ``*.weight`` tensors and
    3-D expert stacks for which ``should_quantize(name)`` is true in ``fmt`` (one of
    :data:`FORMATS`). Returns the quantized names. Writes each file to a temp name then renames;
    ``config.json`` gets a ``quantization_config``.

    ``ignore`` (compressed-tensors formats): the config's ``ignore`` list — module names a loader
    must leave unquantized. ``"auto"`` lists every module whose 2-D ``*.weight`` stayed in floating
    point (``lm_head``, the MoE routers, experts not quantized, ...), which vLLM needs: its
    ``targets: ["Linear"]`` otherwise also claims those layers (and the MoE experts); ``None``
    writes no list; or pass the list."""
    from safetensors.torch import load_file
    if fmt not in FORMATS:
        raise InputError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}", field="fmt")
    src, out = Path(src_dir), Path(out_dir)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise InputError(f"no *.safetensors files in {src}", field="src_dir")
    out.mkdir(parents=True, exist_ok=True)
    done, kept = [], []
    for f in files:
        tensors = load_file(str(f))
        new: dict[str, torch.Tensor] = {}
        for k, v in tensors.items():
            shaped = (v.dim() == 2 and k.endswith(".weight")) or v.dim() == 3
            if shaped and v.is_floating_point() and should_quantize(k):
                new.update(quantize_weight_tensors(k, v, fmt))
                done.append(k)
            else:
                new[k] = v
                if v.dim() == 2 and k.endswith(".weight") and v.is_floating_point() and "embed" not in k:
                    kept.append(k[: -len(".weight")])
        _atomic_save(new, out / f.name)
    cfg = json.loads((src / "config.json").read_text()) if (src / "config.json").exists() else {}
    qc = _quantization_config(fmt)
    if qc.get("quant_method") == "compressed-tensors" and ignore is not None:
        if ignore == "auto":
            ignore = sorted(kept)
        if not isinstance(ignore, (list, tuple)) or not all(isinstance(x, str) for x in ignore):
            raise InputError(f"ignore must be 'auto', None or a list of module names, got {ignore!r}",
                             field="ignore")
        qc["ignore"] = list(ignore)
    cfg["quantization_config"] = qc
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


def _nvfp4_qtensors(n: str, codes, scales, glob, convention: str, dtype, gname: str) -> dict[str, QTensor]:
    """QTensors of one NVFP4 parameter ``n`` held in memory (2-D, or 3-D stacked experts -> ``n[e]``)."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn:
        raise InputError(f"NVFP4 weight {n}: expected uint8 codes and float8_e4m3fn scales, "
                         f"got {codes.dtype} and {scales.dtype}", field=n)
    if codes.dim() not in (2, 3):
        raise InputError(f"NVFP4 weight {n}: codes must be 2-D or 3-D (stacked experts), got shape "
                         f"{tuple(codes.shape)}", field=n)
    cols = codes.shape[-1] * 2
    want = (*codes.shape[:-1], -(-cols // 16))
    if tuple(scales.shape) != want:
        raise InputError(f"NVFP4 weight {n}: scale shape {tuple(scales.shape)} does not match {want}", field=n)
    n_glob = codes.shape[0] if codes.dim() == 3 else 1
    if glob.numel() != n_glob:
        raise InputError(f"NVFP4 weight {n}: {gname} has {glob.numel()} values, expected {n_glob} "
                         f"(one per {'expert matrix' if codes.dim() == 3 else 'tensor'})", field=gname)
    glob = glob.float().reshape(-1)
    opts = {"convention": convention, "tile": (1, 16)}
    if codes.dim() == 2:
        return {n: QTensor("nvfp4", codes, scales, glob.reshape(()), (1, 16), (codes.shape[0], cols), dtype, opts)}
    return {f"{n}[{e}]": QTensor("nvfp4", codes[e], scales[e], glob[e].reshape(()), (1, 16),
                                 (codes.shape[1], cols), dtype, dict(opts)) for e in range(codes.shape[0])}


def _config_int4_group(d: Path) -> int | None:
    """The INT4 ``group_size`` config.json's compressed-tensors groups name, if exactly one.
    No config.json: None (the layouts come from the tensor names); a config.json that is not a
    JSON object is the project's error naming it (never silently ignored)."""
    from .vendor_check.readers import read_json

    if not (d / "config.json").is_file():
        return None
    qc = read_json(d / "config.json").get("quantization_config") or {}
    try:
        sizes = {w.get("group_size") for g in (qc.get("config_groups") or {}).values()
                 for w in [(g or {}).get("weights") or {}] if w.get("type") == "int" and w.get("num_bits") == 4}
    except AttributeError:          # groups that are not objects: no INT4 group size named
        return None
    return sizes.pop() if len(sizes) == 1 and isinstance(next(iter(sizes)), int) else None


def _layout_of(t, P: str, int4_group: int | None = None):
    """The stored layout of weight ``P`` from its tensors' names and dtypes (``None``: an FP8
    layout, which ``load_qtensors`` does not read); a spec whose companions are missing is
    refused by ``read_param``, naming the missing tensor."""
    from .vendor_check.readers import Spec
    has = lambda sfx: P + sfx in t                                                   # noqa: E731
    dt = t.meta[P][0] if P in t else None
    if has("_blocks") or has("_scales"):
        return Spec("gpt_oss_mxfp4", "tensor names", block=(1, 32))
    if has("_scale_2"):
        return Spec("modelopt_nvfp4", "tensor names")
    if has("_global_scale"):
        return Spec("ct_nvfp4", "tensor names")
    if has("_shape") or (has("_packed") and t.meta[P + "_packed"][0] == "I32"):
        if not (has("_shape") and has("_scale")):
            return Spec("ct_int4", "tensor names", group_size=1)      # read_param names what is missing
        n = int(t[P + "_shape"].reshape(-1)[-1]) if t.meta[P + "_shape"][1] else 0
        ns = t.meta[P + "_scale"][1][-1] if t.meta[P + "_scale"][1] else 0
        if int4_group is not None and int4_group > 0:
            return Spec("ct_int4", "config.json group_size", group_size=int4_group)
        if ns <= 0 or n <= 0 or (n % ns and ns != 1):
            raise InputError(f"{P}: {ns} group scales per row do not divide the {n} columns of {P}_shape",
                             field=P + "_scale", source=t.src(P + "_scale"))
        return Spec("ct_int4", "tensor names", group_size=n // ns if n % ns == 0 else n)
    if has("_packed"):
        return Spec("ct_nvfp4", "tensor names")
    if dt in ("F8_E4M3", "F8_E5M2") or has("_scale_inv"):
        return None
    if dt == "U8" or has("_scale"):
        return Spec("modelopt_nvfp4", "tensor names")
    return None


def load_qtensors(model_dir, dtype: torch.dtype = torch.bfloat16) -> dict[str, QTensor]:
    """Every quantized weight of a checkpoint as a :class:`QTensor` (keys: the parameter name
    ``P``, e.g. ``X.weight``; for a 3-D stacked expert tensor one entry per expert, ``P[e]``).
    Codes and scales are kept as stored (no dequantization). The layout of each weight is read
    from its tensor names (modelopt NVFP4, compressed-tensors NVFP4 / INT4) and validated as
    ``qat-check --base`` does (:func:`.vendor_check.readers.read_param`: dtypes, shapes, finite
    non-negative scales, missing companions refused)."""
    from .vendor_check.readers import Tensors, read_param, stored_weights
    t = Tensors(Path(model_dir), "model_dir")
    g = _config_int4_group(Path(model_dir))
    out: dict[str, QTensor] = {}
    for P in stored_weights(t, ("", "_packed")):
        spec = _layout_of(t, P, g)
        if spec is not None:
            out.update(read_param(t, P, spec, dtype))
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
        raise InputError(f"no quantized weights (modelopt NVFP4, compressed-tensors NVFP4 or INT4) in {model_dir}",
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
