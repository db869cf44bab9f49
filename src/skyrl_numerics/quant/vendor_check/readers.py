"""Strict reading of a quantized checkpoint for ``qat-check --base``: every config field and every
stored tensor is validated, and every quantized tensor must be accounted for.

Config (:func:`ct_weights_spec`, :func:`modelopt_spec`, :func:`deepseek_spec`): unknown keys, wrong
types, unsupported values and inconsistent combinations (``num_bits: 4, type: float`` without the
``nvfp4-pack-quantized`` format, a group size other than 16 for NVFP4, a block strategy without a
``block_structure``, asymmetric or dynamic weights, an observer that is not min-max, GPTQ
activation ordering, Hadamard transforms, sparsity) raise :class:`InputError` naming the field.

Tensors (:func:`read_quantized`): each stored weight ``P`` is read with the layout of its kind
(:data:`LAYOUTS`): codes, block scales, global scales and ``P_shape`` must all be there, in the
layout's dtype and in exactly the shape the codes imply; scales must be finite and non-negative
(INT4 group scales and NVFP4 globals > 0). A tensor in a quantized dtype (uint8 / int32 / FP8)
that belongs to no weight of the scheme, or a scale whose codes are missing, is refused.
Errors name the safetensors file (``source``), the tensor and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from skyrl_numerics.errors import InputError

from .. import codecs as C
from ..qtensor import QTensor
from ..recipes_int4 import unpack_int4_from_int32

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
QUANT_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)
CT_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                  "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
MINMAX_OBSERVERS = (None, "minmax", "memoryless_minmax", "static_minmax", "memoryless")
_DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16,
           "torch.float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn}


def read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {path}: {e}", field=path.name) from None
    if not isinstance(obj, dict):
        raise InputError(f"{path} must hold a JSON object, got {type(obj).__name__}", field=path.name)
    return obj


@dataclass(frozen=True)
class Spec:
    """What one config (group) fixes for a weight: ``kind`` (a key of :data:`LAYOUTS`), the FP8
    ``block``, the INT4 ``group_size``, the config's ``scale_dtype`` and where it was read."""

    kind: str
    where: str
    block: tuple[int, int] | None = None
    group_size: int | None = None
    scale_dtype: torch.dtype | None = None


def _bad(where: str, key: str, msg: str):
    raise InputError(f"{where}: {msg}", field=key)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def ct_weights_spec(where: str, w, fmt) -> Spec:
    """Validate one compressed-tensors ``weights`` argument block (``where`` names the group)."""
    if not isinstance(w, dict):
        _bad(where, "weights", f"weights must be an object, got {type(w).__name__}")
    extra = sorted(set(w) - CT_WEIGHT_KEYS)
    if extra:
        _bad(where, extra[0], f"unknown weights field(s) {extra}; QuantizationArgs has {sorted(CT_WEIGHT_KEYS)}")
    typ, bits, strat = w.get("type"), w.get("num_bits"), w.get("strategy")
    if not _int(bits):
        _bad(where, "num_bits", f"num_bits must be an integer, got {bits!r}")
    if typ not in ("int", "float"):
        _bad(where, "type", f"type must be 'int' or 'float', got {typ!r}")
    if w.get("symmetric", True) is not True:
        _bad(where, "symmetric", f"only symmetric weights are supported (no zero point), got {w.get('symmetric')!r}")
    if w.get("dynamic", False) not in (False, None):
        _bad(where, "dynamic", f"stored weights cannot be dynamic, got {w.get('dynamic')!r}")
    if w.get("actorder") not in (None, False):
        _bad(where, "actorder", f"activation ordering (GPTQ g_idx) is not supported, got {w.get('actorder')!r}")
    if w.get("observer") not in MINMAX_OBSERVERS:
        _bad(where, "observer", f"observer {w.get('observer')!r} is not reproduced here (min-max observers only)")
    if w.get("observer_kwargs") not in (None, {}):
        _bad(where, "observer_kwargs", f"observer_kwargs {w.get('observer_kwargs')!r} are not reproduced here "
                                       f"(plain min-max statistics only)")
    if w.get("zp_dtype") is not None:
        _bad(where, "zp_dtype", f"symmetric weights have no zero point dtype, got {w.get('zp_dtype')!r}")
    sd = w.get("scale_dtype")
    if sd is not None and not (isinstance(sd, str) and sd in _DTYPES):
        _bad(where, "scale_dtype", f"unknown scale_dtype {sd!r}")
    sd = _DTYPES.get(sd)
    gs, bs = w.get("group_size"), w.get("block_structure")
    if not isinstance(fmt, str):
        _bad(where, "format", f"format must be a string, got {fmt!r}")
    if strat != "block" and bs is not None:
        _bad(where, "block_structure", f"block_structure {bs!r} given for strategy {strat!r}")
    if typ == "int" and bits == 4:
        if strat != "group":
            _bad(where, "strategy", f"int4 weights: only strategy 'group' is supported, got {strat!r}")
        if not _int(gs) or gs <= 0 or gs % 2:
            _bad(where, "group_size", f"int4 group strategy needs a positive even group_size, got {gs!r}")
        if fmt != "pack-quantized":
            _bad(where, "format", f"int4 weights are stored 'pack-quantized', the config says {fmt!r}")
        if sd is not None and sd not in FLOATS:
            _bad(where, "scale_dtype", f"int4 group scales are float32/bfloat16/float16, got {sd}")
        return Spec("ct_int4", where, group_size=gs, scale_dtype=sd)
    if typ == "float" and bits == 4:
        if fmt != "nvfp4-pack-quantized":
            _bad(where, "format", f"num_bits 4, type float: only NVFP4 ('nvfp4-pack-quantized') is supported, "
                                  f"format is {fmt!r}")
        if strat != "tensor_group":
            _bad(where, "strategy", f"NVFP4 weights use strategy 'tensor_group', got {strat!r}")
        if gs != 16:
            _bad(where, "group_size", f"NVFP4 groups are 16 elements, got {gs!r}")
        if sd not in (None, torch.float8_e4m3fn):
            _bad(where, "scale_dtype", f"NVFP4 block scales are float8_e4m3fn, got {sd}")
        return Spec("ct_nvfp4", where, group_size=16, scale_dtype=torch.float8_e4m3fn)
    if typ == "float" and bits == 8:
        if fmt not in ("float-quantized", "naive-quantized"):
            _bad(where, "format", f"fp8 weights are stored 'float-quantized', the config says {fmt!r}")
        if sd is not None and sd not in FLOATS:
            _bad(where, "scale_dtype", f"fp8 scales are float32/bfloat16/float16, got {sd}")
        if strat in ("channel", "tensor"):
            if gs is not None:
                _bad(where, "group_size", f"strategy {strat!r} takes no group_size, got {gs!r}")
            return Spec("ct_fp8", where, block=(1, -1) if strat == "channel" else (-1, -1), scale_dtype=sd)
        if strat == "block":
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(_int(b) and b > 0 for b in bs)):
                _bad(where, "block_structure", f"block strategy needs block_structure [r, c], got {bs!r}")
            if gs is not None:
                _bad(where, "group_size", f"strategy 'block' takes no group_size, got {gs!r}")
            return Spec("ct_fp8", where, block=(int(bs[0]), int(bs[1])), scale_dtype=sd)
        _bad(where, "strategy", f"fp8 weights: strategy must be channel, tensor or block, got {strat!r}")
    _bad(where, "num_bits", f"unknown compressed-tensors scheme: weights type={typ!r} num_bits={bits!r} "
                            f"strategy={strat!r}; supported: int4 group, nvfp4 tensor_group, fp8 channel/block/tensor")


def ct_top_level(qc: dict, src: str) -> None:
    """Top-level compressed-tensors fields that change what is stored."""
    if qc.get("quantization_status", "compressed") != "compressed":
        _bad(src, "quantization_status", f"weights are stored compressed only when quantization_status is "
                                         f"'compressed', got {qc.get('quantization_status')!r}")
    for k in ("sparsity_config", "transform_config"):
        if qc.get(k) not in (None, {}):
            _bad(src, k, f"{k} is not supported (it changes the stored weights), got {qc.get(k)!r}")
    ign = qc.get("ignore", [])
    if ign is not None and not (isinstance(ign, list) and all(isinstance(x, str) and x for x in ign)):
        _bad(src, "ignore", f"ignore must be a list of module names / 're:' patterns, got {ign!r}")
    f = qc.get("format")
    if f is not None and not isinstance(f, str):
        _bad(src, "format", f"format must be a string, got {f!r}")


def modelopt_spec(q: dict, src: str) -> Spec:
    if not isinstance(q, dict):
        _bad(src, "quantization", f"expected an object, got {type(q).__name__}")
    algo = q.get("quant_algo")
    if algo == "NVFP4":
        if q.get("group_size", 16) != 16:
            _bad(src, "group_size", f"NVFP4 groups are 16 elements, got {q.get('group_size')!r}")
        kind = "modelopt_nvfp4"
    elif algo == "FP8":
        if q.get("group_size") is not None:
            _bad(src, "group_size", f"modelopt FP8 weights are per tensor (no group_size), got {q.get('group_size')!r}")
        kind = "modelopt_fp8"
    else:
        _bad(src, "quant_algo", f"unknown modelopt quant_algo {algo!r}; supported: NVFP4, FP8")
    ex = q.get("exclude_modules", [])
    if ex is not None and not (isinstance(ex, list) and all(isinstance(x, str) and x for x in ex)):
        _bad(src, "exclude_modules", f"exclude_modules must be a list of module name patterns, got {ex!r}")
    return Spec(kind, src)


def deepseek_spec(qc: dict, src: str) -> Spec:
    bs = qc.get("weight_block_size")
    if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(_int(b) and b > 0 for b in bs)):
        _bad(src, "weight_block_size", f"quant_method fp8 needs weight_block_size [r, c] (DeepSeek-V3: [128, 128]), "
                                       f"got {bs!r}; only the block format is supported")
    if qc.get("fmt", "e4m3") != "e4m3":
        _bad(src, "fmt", f"only e4m3 weights are supported, got {qc.get('fmt')!r}")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        _bad(src, "activation_scheme", f"activation_scheme must be dynamic or static, got {qc.get('activation_scheme')!r}")
    return Spec("deepseek_fp8_block", src, block=(int(bs[0]), int(bs[1])))


# ----------------------------------------------------------------------------------------- tensors
#: kind -> (code suffix, code dtypes, block-scale suffix, scale dtypes, global suffix or None)
LAYOUTS = {
    "modelopt_nvfp4": ("", (torch.uint8,), "_scale", (torch.float8_e4m3fn,), "_scale_2"),
    "ct_nvfp4": ("_packed", (torch.uint8,), "_scale", (torch.float8_e4m3fn,), "_global_scale"),
    "ct_int4": ("_packed", (torch.int32,), "_scale", FLOATS, None),
    "ct_fp8": ("", (torch.float8_e4m3fn,), "_scale", FLOATS, None),
    "modelopt_fp8": ("", (torch.float8_e4m3fn,), "_scale", (torch.float32,), None),
    "deepseek_fp8_block": ("", (torch.float8_e4m3fn,), "_scale_inv", (torch.float32,), None),
    "gpt_oss_mxfp4": ("_blocks", (torch.uint8,), "_scales", (torch.uint8,), None),
}
ALL_SUFFIXES = ("_global_scale", "_scale_inv", "_scale_2", "_packed", "_shape", "_scale", "_blocks", "_scales")


def _owner(name: str) -> str | None:
    """The weight a companion tensor (``P_scale``, ...) belongs to, if it names one."""
    for s in ALL_SUFFIXES:
        if name.endswith(s):
            p = name[: -len(s)]
            return p if p.endswith("weight") or p.endswith("_proj") else None
    return None


class Tensors:
    """Name -> tensor over every ``*.safetensors`` file of a directory, read on access; errors
    from a malformed file are :class:`InputError` naming it."""

    def __init__(self, d: Path, what: str):
        from safetensors import safe_open
        if not d.exists():
            raise InputError(f"{d}: not found", field=what)
        if not d.is_dir():
            raise InputError(f"{d}: not a directory", field=what)
        self.files = sorted(d.glob("*.safetensors"))
        if not self.files:
            raise InputError(f"no *.safetensors files in {d}", field=what)
        self.where: dict[str, Path] = {}
        self.meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        for f in self.files:
            try:
                with safe_open(str(f), "pt") as fh:
                    for k in fh.keys():
                        sl = fh.get_slice(k)
                        self.where[k] = f
                        self.meta[k] = (sl.get_dtype(), tuple(sl.get_shape()))
            except Exception as e:                                  # noqa: BLE001 (safetensors' own errors)
                raise InputError(f"cannot read {f}: {e}", field=what, source=f.name) from None

    def __contains__(self, k):
        return k in self.where

    def __getitem__(self, k) -> torch.Tensor:
        from safetensors import safe_open
        try:
            with safe_open(str(self.where[k]), "pt") as fh:
                return fh.get_tensor(k)
        except Exception as e:                                      # noqa: BLE001
            raise InputError(f"cannot read tensor {k}: {e}", field=k, source=self.where[k].name) from None

    def src(self, k) -> str | None:
        return self.where[k].name if k in self.where else None


def _err(t: Tensors, key: str, msg: str, field: str, index=None):
    raise InputError(f"{key}: {msg}", field=field, index=index, source=t.src(key))


def _values(s: torch.Tensor) -> torch.Tensor:
    return C.decode(s.view(torch.uint8), C.E4M3) if s.dtype == torch.float8_e4m3fn else s.float()


def _check_values(t: Tensors, key: str, v: torch.Tensor, positive: bool) -> None:
    bad = ~torch.isfinite(v)
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        _err(t, key, f"holds a non-finite value ({float(v.flatten()[i])}) at flat index {i}", key, i)
    bad = (v <= 0) | torch.signbit(v) if positive else torch.signbit(v)      # -0.0: no writer stores it
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        _err(t, key, f"holds {float(v.flatten()[i])} at flat index {i}; must be {'> 0' if positive else '>= 0'} "
                     f"(sign bit clear)", key, i)


def _get(t: Tensors, key: str, dtypes, what: str, P: str) -> torch.Tensor:
    if key not in t:
        raise InputError(f"{P}: {what} {key} is missing", field=key, source=t.src(P) or t.src(P + "_packed"))
    x = t[key]
    if x.dtype not in dtypes:
        _err(t, key, f"{what} must be {' or '.join(str(d).replace('torch.', '') for d in dtypes)}, got "
                     f"{str(x.dtype).replace('torch.', '')}", key)
    return x


def _expect_shape(t: Tensors, key: str, got, want: tuple, why: str, alts=()) -> None:
    if tuple(got) != tuple(want) and tuple(got) not in [tuple(a) for a in alts]:
        _err(t, key, f"shape {tuple(got)}, expected {tuple(want)} ({why})", key)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def read_param(t: Tensors, P: str, spec: Spec, dtype) -> dict[str, QTensor]:
    """Validated QTensors of stored weight ``P`` (``P[e]`` per expert of a 3-D stack)."""
    if spec.kind == "gpt_oss_mxfp4":
        return read_mxfp4(t, P, dtype)
    code_sfx, code_dt, sc_sfx, sc_dt, g_sfx = LAYOUTS[spec.kind]
    codes = _get(t, P + code_sfx, code_dt, "codes", P)
    scales = _get(t, P + sc_sfx, sc_dt, "block scales", P)
    if spec.scale_dtype is not None and scales.dtype != spec.scale_dtype:
        _err(t, P + sc_sfx, f"dtype {scales.dtype} differs from the config's scale_dtype {spec.scale_dtype} "
                            f"({spec.where})", P + sc_sfx)
    ck = P + code_sfx
    if codes.dim() not in (2, 3):
        _err(t, ck, f"codes must be 2-D or a 3-D expert stack, got shape {tuple(codes.shape)}", ck)
    lead = tuple(codes.shape[:-2])
    n_mat = codes.shape[0] if codes.dim() == 3 else 1
    if spec.kind == "ct_int4":
        sk = P + "_shape"
        shp = _get(t, sk, (torch.int64, torch.int32), "weight shape", P)
        if shp.dim() != 1 or shp.numel() != codes.dim() or bool((shp <= 0).any()):
            _err(t, sk, f"must list the {codes.dim()} positive dims of the weight, got {shp.tolist()}", sk)
        shape = tuple(int(s) for s in shp.tolist())
        _expect_shape(t, ck, codes.shape, (*shape[:-1], _cdiv(shape[-1], 8)),
                      f"{shape[-1]} int4 codes per row packed 8 per int32, weight_shape {list(shape)}")
        if shape[-1] >= spec.group_size and shape[-1] % spec.group_size:   # compressed-tensors' own rule: a
            _err(t, sk, f"group_size {spec.group_size} ({spec.where}) does not divide the input dim "  # row
                        f"{shape[-1]}", "group_size")                                     # shorter than a group
        _expect_shape(t, P + sc_sfx, scales.shape, (*shape[:-1], _cdiv(shape[-1], spec.group_size)),  # is one
                      f"one scale per {spec.group_size} columns of weight_shape {list(shape)}")
    elif spec.kind in ("modelopt_nvfp4", "ct_nvfp4"):
        shape = (*codes.shape[:-1], codes.shape[-1] * 2)
        if shape[-1] % 16:             # compressed-tensors refuses ragged groups, vLLM's kernels need K % 16
            _err(t, ck, f"{codes.shape[-1]} bytes per row hold {shape[-1]} FP4 codes, not a multiple of the "
                        f"16-element NVFP4 group (a packed row of the wrong length)", ck)
        _expect_shape(t, P + sc_sfx, scales.shape, (*codes.shape[:-1], _cdiv(shape[-1], 16)),
                      f"one E4M3 scale per 16 of the {shape[-1]} FP4 codes per row")
    else:
        shape = tuple(codes.shape)
        R, Cc = shape[-2], shape[-1]
        if spec.kind == "ct_fp8" and spec.block == (1, -1):
            want, alts, why = (*lead, R, 1), [], "strategy channel: one scale per output row"
        elif spec.kind == "modelopt_fp8" or (spec.kind == "ct_fp8" and spec.block == (-1, -1)):
            want, alts, why = (*lead,) if lead else (), [(*lead, 1)], "one scale per tensor"
        else:
            br, bc = spec.block
            want, alts, why = (*lead, _cdiv(R, br), _cdiv(Cc, bc)), [], f"{br}x{bc} blocks ({spec.where})"
        _expect_shape(t, P + sc_sfx, scales.shape, want, why, alts)
    _check_values(t, P + sc_sfx, _values(scales), positive=spec.kind == "ct_int4")
    glob = None
    if g_sfx is not None:
        gk = P + g_sfx
        glob = _get(t, gk, (torch.float32,), "global scale", P)
        _expect_shape(t, gk, glob.shape, (n_mat,) if lead else (), "one per expert matrix" if lead else "one per "
                      "tensor", alts=[] if lead else [(1,)])
        _check_values(t, gk, glob, positive=False)      # 0: an all-zero tensor's global (recipes_nvfp4)
        glob = glob.reshape(-1)
    return _qtensors(P, spec, codes, scales, glob, shape, dtype)


def _qtensors(P, spec: Spec, codes, scales, glob, shape, dtype) -> dict[str, QTensor]:
    mats = [(P, codes, scales, None if glob is None else glob[0])] if codes.dim() == 2 else \
        [(f"{P}[{e}]", codes[e], scales[e].reshape(scales.shape[1:]) if scales.dim() else scales,
          None if glob is None else glob[e]) for e in range(codes.shape[0])]
    out = {}
    for n, c, s, g in mats:
        shp = tuple(shape[-2:])
        if spec.kind in ("modelopt_nvfp4", "ct_nvfp4"):
            conv = "modelopt" if spec.kind == "modelopt_nvfp4" else "compressed_tensors"
            out[n] = QTensor("nvfp4", c, s, g.reshape(()), (1, 16), shp, dtype, {"convention": conv, "tile": (1, 16)})
        elif spec.kind == "ct_int4":
            gs = spec.group_size
            out[n] = QTensor("int4_g32", unpack_int4_from_int32(c, shp[-1]), s, None, (1, gs), shp, dtype,
                             {"group": gs, "scale_dtype": s.dtype})
        elif spec.kind == "deepseek_fp8_block":
            out[n] = QTensor("fp8_block", c, s, None, spec.block, shp, dtype, {"block": spec.block})
        else:
            block = (-1, -1) if spec.kind == "modelopt_fp8" else spec.block
            sd = torch.float32 if spec.kind == "modelopt_fp8" else s.dtype
            out[n] = QTensor("fp8_channel", c, s.reshape(-1, 1) if s.dim() < 2 else s, None, block, shp, dtype,
                             {"block": block, "scale_dtype": sd, "modelopt_export": spec.kind == "modelopt_fp8"})
    return out


def stored_weights(t: Tensors, code_suffixes) -> list[str]:
    """Names ``P`` of the stored quantized weights: every tensor in a quantized dtype ending in one
    of ``code_suffixes`` and every companion ``P_scale`` / ``P_packed`` / ... names one."""
    found = set()
    for k, (dt, _) in t.meta.items():
        if dt in ("U8", "I32", "F8_E4M3", "F8_E5M2", "F8_E8M0", "I8"):
            for s in code_suffixes:
                if s and k.endswith(s):
                    found.add(k[: -len(s)])
                    break
            else:
                if "" in code_suffixes and _owner(k) is None:
                    found.add(k)
        p = _owner(k)
        if p is not None:
            found.add(p)
    return sorted(found)


def check_unclaimed(t: Tensors, claimed: set[str], scheme: str) -> None:
    """Every tensor in a quantized dtype must belong to a weight that was read."""
    for k, (dt, _) in sorted(t.meta.items()):
        if k not in claimed and dt in ("U8", "I32", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0"):
            raise InputError(f"{k}: a {dt} tensor that is no part of any {scheme} weight (its codes or scales "
                             f"are missing, or it is stored in another layout)", field=k, source=t.src(k))


# ------------------------------------------------------------------------------ GPT-OSS MXFP4
def mxfp4_spec(qc: dict, src: str) -> Spec:
    """GPT-OSS ``quant_method: mxfp4`` (transformers ``Mxfp4Config``): MXFP4 experts, the modules in
    ``modules_to_not_convert`` (``*`` wildcards) left in bf16."""
    extra = sorted(set(qc) - {"quant_method", "modules_to_not_convert", "dequantize"})
    if extra:
        _bad(src, extra[0], f"unknown mxfp4 quantization_config field(s) {extra}")
    m = qc.get("modules_to_not_convert", [])
    if m is not None and not (isinstance(m, list) and all(isinstance(x, str) and x for x in m)):
        _bad(src, "modules_to_not_convert", f"modules_to_not_convert must be a list of module patterns, got {m!r}")
    if not isinstance(qc.get("dequantize", False), bool):
        _bad(src, "dequantize", f"dequantize must be true or false, got {qc.get('dequantize')!r}")
    return Spec("gpt_oss_mxfp4", src, block=(1, 32))


def read_mxfp4(t: Tensors, P: str, dtype) -> dict[str, QTensor]:
    """GPT-OSS experts: ``P_blocks`` uint8 ``[E, out, in/32, 16]`` (E2M1 pairs, low nibble first),
    ``P_scales`` uint8 E8M0 ``[E, out, in/32]`` -> one mxfp4 QTensor ``[out, in]`` per expert
    (transformers' ``convert_moe_packed_tensors`` decodes the same ``[E, out, in]`` matrix, then
    transposes it to the HF ``[E, in, out]`` parameter)."""
    bk, sk = P + "_blocks", P + "_scales"
    blocks = _get(t, bk, (torch.uint8,), "FP4 blocks", P)
    scales = _get(t, sk, (torch.uint8,), "E8M0 scales", P)
    if blocks.dim() != 4 or blocks.shape[-1] != 16:
        _err(t, bk, f"shape {tuple(blocks.shape)}, expected [experts, out, in/32, 16] (32 E2M1 codes per block, "
                    f"two per byte)", bk)
    _expect_shape(t, sk, scales.shape, tuple(blocks.shape[:-1]), "one E8M0 scale per 32-element block")
    nan = scales == 0xFF
    if bool(nan.any()):
        i = int(nan.flatten().nonzero()[0])
        _err(t, sk, f"holds the E8M0 NaN code 0xFF at flat index {i}", sk, i)
    E, out, G, _ = blocks.shape
    return {f"{P}[{e}]": QTensor("mxfp4", blocks[e].reshape(out, G * 16), scales[e].view(torch.float8_e8m0fnu),
                                 None, (1, 32), (out, G * 32), dtype, {"scale_mode": "floor", "base_layout": "in_out"})
            for e in range(E)}
