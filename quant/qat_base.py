"""``qat_check_base``: does the trainer's fake-quant of the bf16 master weights give exactly the
codes and scales a serving checkpoint holds? (``skyrl-numerics qat-check QUANT_DIR --base BASE``)

1. The scheme is read from the quantized checkpoint's own config (:func:`detect_scheme`):

   ============================  ==============================================  ===================
   config                        stored per weight ``P``                          recipe
   ============================  ==============================================  ===================
   compressed-tensors group,     ``P_packed`` int32, ``P_scale``, ``P_shape``     ``int4_g32``
   int 4-bit ``group`` (32/128)                                                   (``group``)
   compressed-tensors            ``P_packed`` uint8, ``P_scale`` E4M3,            ``nvfp4``
   ``nvfp4-pack-quantized``      ``P_global_scale``                               compressed_tensors
   compressed-tensors float      ``P`` E4M3, ``P_scale`` ``[out, 1]`` /           ``fp8_channel``
   8-bit ``channel`` / ``block`` ``[out/br, in/bc]``                              (``block``)
   modelopt ``NVFP4``            ``P`` uint8, ``P_scale`` E4M3, ``P_scale_2``     ``nvfp4`` modelopt
   modelopt ``FP8``              ``P`` E4M3, ``P_scale`` scalar                   ``fp8_channel``
                                                                                  (per tensor)
   ``quant_method: fp8`` +       ``P`` E4M3, ``P_scale_inv``                      ``fp8_block``
   ``weight_block_size``         ``[out/128, in/128]``                            ``(128, 128)``
   (DeepSeek-V3)
   ============================  ==============================================  ===================

   modelopt's config is ``hf_quant_config.json`` (``{"quantization": {"quant_algo": ...}}``) or
   ``config.json``'s ``quantization_config`` with ``quant_method: modelopt``.
2. Each quantized tensor is matched to its bf16 tensor in BASE_DIR: the same name; or, for
   experts, the fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj`` stack against
   per-expert ``experts.{e}.gate_proj/up_proj/down_proj.weight`` (either side fused).
3. The base tensor is quantized with the matched recipe and the checkpoint's **global** scale
   (NVFP4 writers share one global across q/k/v and gate/up, so it is never recomputed per
   tensor); block scales and codes are recomputed and compared bitwise with the stored ones.

compressed-tensors computes statistics in its observer's dtype. For INT4 and FP8 that is the
stored ``weight_scale`` dtype (used as is); for NVFP4 the stored scale is E4M3 and does not tell,
so ``observer="auto"`` tries the base weight's dtype (llm-compressor's flow) and then float32,
keeping the one that matches more tensors (reported as ``observer_dtype``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from skyrl_numerics.errors import InputError

from . import codecs as C
from .api import quantize
from .checkpoint import load_qtensors
from .qtensor import QTensor

SCHEMES = ("ct_int4", "ct_nvfp4", "ct_fp8", "modelopt_nvfp4", "modelopt_fp8", "deepseek_fp8_block")


@dataclass
class Scheme:
    """What the quantized checkpoint's config says: ``kind`` (one of :data:`SCHEMES`), the recipe
    options it fixes, and where it was read."""

    kind: str
    source: str
    groups: list[dict] = field(default_factory=list)   # compressed-tensors weight args per group
    block: tuple[int, int] | None = None               # fp8 block strategies


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {path}: {e}", field=path.name) from None


def _ct_kind(name: str, w: dict, fmt: str | None) -> tuple[str, tuple[int, int] | None]:
    typ, bits, strat = w.get("type"), w.get("num_bits"), w.get("strategy")
    if typ == "int" and bits == 4 and strat == "group" and w.get("symmetric", True):
        gs = w.get("group_size")
        if not isinstance(gs, int) or gs <= 0:
            raise InputError(f"compressed-tensors group {name}: int4 group strategy needs a positive group_size, "
                             f"got {gs!r}", field="quantization_config")
        return "ct_int4", None
    if typ == "float" and bits == 4 and strat == "tensor_group" and w.get("group_size", 16) == 16:
        return "ct_nvfp4", None
    if typ == "float" and bits == 8 and strat in ("channel", "block", "tensor"):
        if strat == "channel":
            return "ct_fp8", (1, -1)
        if strat == "tensor":
            return "ct_fp8", (-1, -1)
        bs = w.get("block_structure")
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise InputError(f"compressed-tensors group {name}: block strategy needs block_structure [r, c], "
                             f"got {bs!r}", field="quantization_config")
        return "ct_fp8", (int(bs[0]), int(bs[1]))
    raise InputError(f"unknown compressed-tensors scheme in group {name} (format {fmt!r}): weights "
                     f"type={typ!r} num_bits={bits!r} strategy={strat!r}; supported: int4 group, nvfp4 "
                     f"tensor_group, fp8 channel/block/tensor", field="quantization_config")


def detect_scheme(quant_dir) -> Scheme:
    """Read the quantization scheme from ``QUANT_DIR``'s own config (see the module doc)."""
    d = Path(quant_dir)
    if not d.is_dir():
        raise InputError(f"{d} is not a directory", field="quant_dir")
    hf = d / "hf_quant_config.json"
    cfg = _read_json(d / "config.json") if (d / "config.json").exists() else {}
    qc = cfg.get("quantization_config")
    if hf.exists():
        h = _read_json(hf)
        algo = (h.get("quantization") or h).get("quant_algo")
        src = "hf_quant_config.json"
    elif isinstance(qc, dict) and qc.get("quant_method") == "modelopt":
        algo = qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo")
        src = "config.json quantization_config"
    elif qc is None:
        raise InputError(f"no quantization config in {d}: config.json has no 'quantization_config' and "
                         f"there is no hf_quant_config.json", field="quantization_config")
    elif not isinstance(qc, dict):
        raise InputError(f"config.json 'quantization_config' must be an object, got {type(qc).__name__}",
                         field="quantization_config")
    else:
        algo = None
        src = "config.json quantization_config"
    if algo is not None or hf.exists() or (isinstance(qc, dict) and qc.get("quant_method") == "modelopt"):
        if algo == "NVFP4":
            return Scheme("modelopt_nvfp4", src)
        if algo == "FP8":
            return Scheme("modelopt_fp8", src)
        raise InputError(f"unknown modelopt quant_algo {algo!r} in {src}; supported: NVFP4, FP8",
                         field="quant_algo")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise InputError("compressed-tensors quantization_config has no config_groups", field="config_groups")
        kinds, args = set(), []
        for gname, g in groups.items():
            w = (g or {}).get("weights")
            if not isinstance(w, dict):
                raise InputError(f"compressed-tensors group {gname} has no weights arguments", field="config_groups")
            kind, block = _ct_kind(gname, w, g.get("format") or qc.get("format"))
            kinds.add(kind)
            args.append({**w, "_kind": kind, "_block": block, "_group": gname})
        if len(kinds) > 1:
            return Scheme("compressed-tensors mixed: " + ", ".join(sorted(kinds)), src, args)
        return Scheme(kinds.pop(), src, args, args[0]["_block"])
    if method == "fp8":
        bs = qc.get("weight_block_size")
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2):
            raise InputError(f"quant_method fp8 without weight_block_size [128, 128] (got {bs!r}); only the "
                             f"DeepSeek-V3 block format is supported", field="weight_block_size")
        return Scheme("deepseek_fp8_block", src, block=(int(bs[0]), int(bs[1])))
    raise InputError(f"unknown quant_method {method!r} in {src}; supported: compressed-tensors, modelopt, fp8",
                     field="quant_method")


# ------------------------------------------------------------------------------------- tensors
class _Lazy:
    """Name -> tensor over every ``*.safetensors`` file of a directory, read on access."""

    def __init__(self, d: Path, what: str):
        from safetensors import safe_open
        self.files = sorted(d.glob("*.safetensors"))
        if not self.files:
            raise InputError(f"no *.safetensors files in {d}", field=what)
        self.where: dict[str, Path] = {}
        for f in self.files:
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():
                    self.where[k] = f

    def __contains__(self, k):
        return k in self.where

    def __getitem__(self, k) -> torch.Tensor:
        from safetensors import safe_open
        with safe_open(str(self.where[k]), "pt") as fh:
            return fh.get_tensor(k)


def _check_scales(name: str, s: torch.Tensor, what: str) -> None:
    v = C.decode(s.view(torch.uint8), C.E4M3) if s.dtype == torch.float8_e4m3fn else s.float()
    if not bool(torch.isfinite(v).all()):
        idx = int((~torch.isfinite(v)).flatten().nonzero()[0])
        raise InputError(f"{name}: {what} holds a non-finite value", field=what, index=idx)
    if bool((v < 0).any()):
        idx = int((v < 0).flatten().nonzero()[0])
        raise InputError(f"{name}: {what} holds a negative value", field=what, index=idx)


def _fp8_qtensors(tensors: _Lazy, scheme: Scheme, dtype) -> dict[str, QTensor]:
    suffix = "_scale_inv" if scheme.kind == "deepseek_fp8_block" else "_scale"
    out: dict[str, QTensor] = {}
    for k in sorted(tensors.where):
        if k + suffix not in tensors:
            continue
        w = tensors[k]
        if w.dtype != torch.float8_e4m3fn:
            continue                                     # e.g. an input_scale / k_scale's owner
        s = tensors[k + suffix]
        if not s.is_floating_point() or s.dtype.itemsize == 1:
            raise InputError(f"{k}: {k + suffix} must be a float32/bfloat16 scale tensor, got {s.dtype}",
                             field=k + suffix)
        _check_scales(k, s, k + suffix)
        mats = [(k, w, s)] if w.dim() <= 2 else [(f"{k}[{e}]", w[e], s[e] if s.dim() == w.dim() else s)
                                                  for e in range(w.shape[0])]
        for n, we, se in mats:
            if scheme.kind == "deepseek_fp8_block":
                recipe, opts = "fp8_block", {"block": scheme.block}
            elif scheme.kind == "modelopt_fp8":
                recipe, opts = "fp8_channel", {"block": (-1, -1), "scale_dtype": torch.float32}
            else:
                recipe, opts = "fp8_channel", {"block": scheme.block, "scale_dtype": se.dtype}
            out[n] = QTensor(recipe, we, se, None, opts["block"], tuple(we.shape), dtype, opts)
    return out


def quantized_tensors(quant_dir, scheme: Scheme, dtype=torch.bfloat16) -> dict[str, QTensor]:
    """The stored quantized weights of ``quant_dir`` as QTensors, per the detected scheme."""
    d = Path(quant_dir)
    if scheme.kind in ("ct_fp8", "modelopt_fp8", "deepseek_fp8_block"):
        qts = _fp8_qtensors(_Lazy(d, "quant_dir"), scheme, dtype)
    elif scheme.kind.startswith("compressed-tensors mixed"):
        raise InputError(f"{scheme.kind}: one scheme per checkpoint is supported", field="config_groups")
    else:
        want = {"ct_int4": "int4_g32", "ct_nvfp4": "nvfp4", "modelopt_nvfp4": "nvfp4"}[scheme.kind]
        conv = {"ct_nvfp4": "compressed_tensors", "modelopt_nvfp4": "modelopt"}.get(scheme.kind)
        qts = {n: q for n, q in load_qtensors(d, dtype).items()
               if q.recipe == want and (conv is None or q.opts.get("convention") == conv)}
        for n, q in qts.items():
            _check_scales(n, q.scales, "scale")
            if q.global_scale is not None:
                g = q.global_scale
                if not bool(torch.isfinite(g)) or float(g) <= 0:
                    raise InputError(f"{n}: global scale {float(g)} must be finite and > 0", field="global_scale")
            if scheme.kind == "ct_int4" and scheme.groups:
                gs = scheme.groups[0].get("group_size")
                if q.scales.shape[-1] != -(-q.shape[-1] // gs):
                    raise InputError(f"{n}: {q.scales.shape[-1]} scales per row do not fit group_size {gs} over "
                                     f"{q.shape[-1]} columns", field="group_size")
                q.opts["group"], q.block = gs, (1, gs)        # a row shorter than a group: one padded group
    if not qts:
        raise InputError(f"no quantized weights of scheme {scheme.kind} (from {scheme.source}) in {d}",
                         field="quant_dir")
    return qts


_EXPERT = re.compile(r"(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(?P<pre>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)\[(?P<e>\d+)\]")


def _base_tensor(name: str, base: _Lazy) -> tuple[str, torch.Tensor]:
    """The base tensor matching quantized tensor ``name`` (``P`` or ``P[e]``) -> (base name, tensor)."""
    m = re.fullmatch(r"(.*)\[(\d+)\]", name)
    p, e = (m.group(1), int(m.group(2))) if m else (name, None)
    if p in base:
        t = base[p]
        if e is None:
            return p, t
        if t.dim() != 3 or e >= t.shape[0]:
            raise InputError(f"{name}: base tensor {p} has shape {tuple(t.shape)}, expected a 3-D expert stack "
                             f"with more than {e} experts", field=name)
        return f"{p}[{e}]", t[e]
    m = _EXPERT.fullmatch(name)
    if m:                                             # per-expert quantized, fused base
        pre, e, proj = m.group("pre"), int(m.group("e")), m.group("proj")
        fused = f"{pre}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if fused in base:
            t = base[fused]
            if t.dim() != 3 or e >= t.shape[0]:
                raise InputError(f"{name}: base tensor {fused} has shape {tuple(t.shape)}, expected [E, out, in] "
                                 f"with more than {e} experts", field=name)
            t = t[e]
            if proj == "down_proj":
                return f"{fused}[{e}]", t
            half = t.shape[0] // 2
            return (f"{fused}[{e}][:{half}]", t[:half]) if proj == "gate_proj" else (f"{fused}[{e}][{half}:]", t[half:])
    m = _FUSED.fullmatch(name)
    if m:                                             # fused quantized, per-expert base
        pre, e, proj = m.group("pre"), int(m.group("e")), m.group("proj")
        if proj == "down_proj" and f"{pre}.{e}.down_proj.weight" in base:
            return f"{pre}.{e}.down_proj.weight", base[f"{pre}.{e}.down_proj.weight"]
        g, u = f"{pre}.{e}.gate_proj.weight", f"{pre}.{e}.up_proj.weight"
        if proj == "gate_up_proj" and g in base and u in base:
            return f"cat({g}, {u})", torch.cat([base[g], base[u]], 0)
    raise InputError(f"base tensor for quantized weight {name} is missing from the base checkpoint", field=name)


def _code_bits(q: QTensor) -> torch.Tensor:
    if q.recipe == "nvfp4":
        return C.unpack_fp4(q.codes)
    c = q.codes
    return c.view(torch.uint8) if c.dtype.itemsize == 1 and c.is_floating_point() else c


def _scale_bits(s: torch.Tensor) -> torch.Tensor:
    return s.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[s.dtype.itemsize])


def _requantize_from_base(q: QTensor, w: torch.Tensor, observer) -> QTensor:
    if q.recipe == "nvfp4":
        opts = {"convention": q.opts["convention"], "global_scale": q.global_scale}
        if q.opts["convention"] == "compressed_tensors":
            opts["stats_dtype"] = observer
        return quantize(w, "nvfp4", **opts)
    if q.recipe == "int4_g32":
        return quantize(w, "int4_g32", group=q.opts["group"], scale_dtype=q.scales.dtype)
    if q.recipe == "fp8_block":
        return quantize(w, "fp8_block", block=q.opts["block"])
    return quantize(w, "fp8_channel", block=q.opts["block"], scale_dtype=q.opts["scale_dtype"])


@dataclass
class QATBaseReport:
    """Per-tensor rows of ``qat_check_base``; ``ok`` when every code and scale is bitwise equal."""

    quant_dir: str
    base_dir: str
    scheme: str
    observer_dtype: str | None = None
    rows: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r["exact"] for r in self.rows)

    @property
    def first_mismatch(self) -> dict | None:
        return next((r for r in self.rows if not r["exact"]), None)

    def summary(self) -> dict:
        return {"tensors": len(self.rows), "exact": sum(r["exact"] for r in self.rows),
                "code_mismatches": sum(r["code_mismatches"] for r in self.rows),
                "scale_mismatches": sum(r["scale_mismatches"] for r in self.rows)}

    def to_dict(self) -> dict:
        return {"quant_dir": self.quant_dir, "base_dir": self.base_dir, "scheme": self.scheme,
                "observer_dtype": self.observer_dtype, "ok": self.ok, "summary": self.summary(),
                "first_mismatch": self.first_mismatch, "rows": self.rows}

    def to_text(self) -> str:
        s = self.summary()
        head = (f"qat-check {self.quant_dir} --base {self.base_dir}: scheme {self.scheme}"
                + (f" (observer {self.observer_dtype})" if self.observer_dtype else "")
                + f": {'OK' if self.ok else 'MISMATCH'}, {s['exact']} of {s['tensors']} tensors exact")
        lines = [head]
        for r in self.rows:
            lines.append(f"  {r['name']:<60} {r['recipe']:<11} {'exact' if r['exact'] else 'DIFF '} "
                         f"codes {r['code_mismatches']}/{r['codes']}  scales {r['scale_mismatches']}/{r['scales']}")
        f = self.first_mismatch
        if f is not None:
            lines.append(f"first mismatching tensor: {f['name']} (base {f['base_name']}): {f['code_mismatches']} of "
                         f"{f['codes']} codes and {f['scale_mismatches']} of {f['scales']} scales differ; "
                         f"{s['tensors'] - s['exact']} of {s['tensors']} tensors mismatch")
        return "\n".join(lines)


def _rows(qts: dict[str, QTensor], base: _Lazy, observer) -> list[dict]:
    rows = []
    for name in sorted(qts):
        q = qts[name]
        bname, w = _base_tensor(name, base)
        if not w.is_floating_point():
            raise InputError(f"{name}: base tensor {bname} is {w.dtype}, expected a floating-point weight", field=name)
        if tuple(w.shape) != tuple(q.shape):
            raise InputError(f"{name}: base tensor {bname} has shape {tuple(w.shape)}, the quantized checkpoint "
                             f"holds {tuple(q.shape)}", field=name)
        r = _requantize_from_base(q, w, observer)
        ours_s, theirs_s = r.scales, q.scales
        if ours_s.numel() != theirs_s.numel():
            raise InputError(f"{name}: stored scales have shape {tuple(theirs_s.shape)}, the recipe gives "
                             f"{tuple(ours_s.shape)}", field=name)
        theirs_s = theirs_s.reshape(ours_s.shape)
        if ours_s.dtype != theirs_s.dtype:
            ours_s = ours_s.to(theirs_s.dtype)
        cm = int((_code_bits(r) != _code_bits(q)).sum())
        sm = int((_scale_bits(ours_s) != _scale_bits(theirs_s)).sum())
        rows.append({"name": name, "base_name": bname, "recipe": q.recipe, "shape": list(q.shape),
                     "codes": int(_code_bits(q).numel()), "code_mismatches": cm,
                     "scales": int(theirs_s.numel()), "scale_mismatches": sm, "exact": cm == 0 and sm == 0})
    return rows


def qat_check_base(quant_dir, base_dir, observer: str = "auto") -> QATBaseReport:
    """Fake-quantize BASE_DIR's weights with QUANT_DIR's scheme and compare codes and scales
    bitwise (module doc). ``observer`` (compressed-tensors NVFP4 only): ``"auto"``, ``"weight"``
    (statistics in the base weight's dtype) or ``"float32"``."""
    if observer not in ("auto", "weight", "float32"):
        raise InputError(f"observer must be auto, weight or float32, got {observer!r}", field="observer")
    scheme = detect_scheme(quant_dir)
    bdir = Path(base_dir)
    if not bdir.is_dir():
        raise InputError(f"{bdir} is not a directory", field="base_dir")
    base = _Lazy(bdir, "base_dir")
    qts = quantized_tensors(quant_dir, scheme)
    rep = QATBaseReport(str(quant_dir), str(base_dir), scheme.kind)
    if scheme.kind != "ct_nvfp4":
        rep.rows = _rows(qts, base, None)
        return rep
    first = next(iter(sorted(qts)))
    wdtype = _base_tensor(first, base)[1].dtype
    tries = {"weight": [wdtype], "float32": [torch.float32], "auto": [wdtype, torch.float32]}[observer]
    best = None
    for dt in dict.fromkeys(tries):
        rows = _rows(qts, base, dt)
        n_ok = sum(r["exact"] for r in rows)
        if best is None or n_ok > best[0]:
            best = (n_ok, dt, rows)
        if n_ok == len(rows):
            break
    rep.rows, rep.observer_dtype = best[2], str(best[1]).replace("torch.", "")
    return rep
