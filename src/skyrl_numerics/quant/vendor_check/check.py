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
   ``quant_method: mxfp4``       ``P_blocks`` uint8 ``[E, out, in/32, 16]``,       ``mxfp4`` (floor |
   (GPT-OSS experts)             ``P_scales`` E8M0 ``[E, out, in/32]``            rceil, found)
   ============================  ==============================================  ===================

   Several compressed-tensors groups: each weight goes to the group whose ``targets`` match it
   under compressed-tensors' own rules, ``ignore`` respected (:func:`.schemes.ct_group_of`).
   Every field and tensor is validated first (:mod:`.readers`).

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

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from skyrl_numerics.errors import InputError

from .. import codecs as C
from ..api import quantize
from ..qtensor import QTensor
from .readers import (ALL_SUFFIXES, LAYOUTS, Spec, Tensors, check_unclaimed, ct_top_level, ct_weights_spec,
                      deepseek_spec, modelopt_spec, mxfp4_spec, read_json, read_param, stored_weights)
from .schemes import (ct_group_of, fusion_group, global_matches, modelopt_fp8_quantize, module_of,
                      not_converted, nvfp4_global_candidates)

LINEAR = ("Linear",)       # class of a stored weight's module: a Linear layer (or a fused expert stack)
SCHEMES = ("ct_int4", "ct_nvfp4", "ct_fp8", "modelopt_nvfp4", "modelopt_fp8", "deepseek_fp8_block", "gpt_oss_mxfp4")


@dataclass
class Scheme:
    """What the quantized checkpoint's config says: ``kind`` (one of :data:`SCHEMES`), the
    validated per-group :class:`~.readers.Spec` s, where it was read, and for compressed-tensors
    each group's ``targets`` and the ``ignore`` list (modelopt: ``exclude_modules``)."""

    kind: str
    source: str
    specs: list[Spec] = field(default_factory=list)
    targets: list[list[str]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)

    @property
    def block(self) -> tuple[int, int] | None:
        return self.specs[0].block if self.specs else None


def detect_scheme(quant_dir) -> Scheme:
    """Read and validate the quantization scheme from ``QUANT_DIR``'s own config (module doc)."""
    d = Path(quant_dir)
    if not d.is_dir():
        raise InputError(f"{d} is not a directory", field="quant_dir")
    hf = d / "hf_quant_config.json"
    cfg = read_json(d / "config.json") if (d / "config.json").exists() else {}
    qc = cfg.get("quantization_config")
    if hf.exists():
        h = read_json(hf)
        q = h.get("quantization", h)
        spec = modelopt_spec(q, "hf_quant_config.json quantization")
        return Scheme(spec.kind, "hf_quant_config.json", [spec], ignore=list(q.get("exclude_modules") or []))
    if qc is None:
        raise InputError(f"no quantization config in {d}: config.json has no 'quantization_config' and "
                         f"there is no hf_quant_config.json", field="quantization_config")
    if not isinstance(qc, dict):
        raise InputError(f"config.json 'quantization_config' must be an object, got {type(qc).__name__}",
                         field="quantization_config")
    src = "config.json quantization_config"
    method = qc.get("quant_method")
    if method == "modelopt":
        q = qc.get("quantization", qc) if isinstance(qc.get("quantization"), dict) else qc
        spec = modelopt_spec(q, src)
        return Scheme(spec.kind, src, [spec], ignore=list(q.get("exclude_modules") or q.get("ignore") or []))
    if method == "compressed-tensors":
        ct_top_level(qc, src)
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise InputError(f"{src}: compressed-tensors quantization_config has no config_groups",
                             field="config_groups")
        specs, targets = [], []
        for gname, g in groups.items():
            where = f"{src} config_groups.{gname}"
            if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
                raise InputError(f"{where} has no weights arguments", field="weights")
            tg = g.get("targets")
            if not (isinstance(tg, list) and tg and all(isinstance(x, str) and x for x in tg)):
                raise InputError(f"{where}: targets must be a non-empty list of module class names / 're:' "
                                 f"patterns, got {tg!r}", field="targets")
            fmt = g["format"] if g.get("format") is not None else qc.get("format")     # the group's wins
            specs.append(ct_weights_spec(where, g["weights"], fmt))
            targets.append(list(tg))
        kinds = sorted({sp.kind for sp in specs})
        kind = kinds[0] if len(kinds) == 1 and len(specs) == 1 else "compressed-tensors groups: " + ", ".join(kinds)
        return Scheme(kind, src, specs, targets, list(qc.get("ignore") or []))
    if method == "mxfp4":
        spec = mxfp4_spec(qc, src)
        return Scheme("gpt_oss_mxfp4", src, [spec], ignore=list(qc.get("modules_to_not_convert") or []))
    if method == "fp8":
        return Scheme("deepseek_fp8_block", src, [deepseek_spec(qc, src)])
    raise InputError(f"unknown quant_method {method!r} in {src}; supported: compressed-tensors, modelopt, fp8",
                     field="quant_method")


def excluded_by(P: str, patterns: list[str]) -> str | None:
    """The modelopt ``exclude_modules`` entry that leaves ``P``'s module unquantized, as vLLM's
    ``ModelOptQuantConfigBase.is_layer_excluded`` decides: the name, a substring of the module
    name, or an ``fnmatch`` wildcard."""
    import fnmatch
    mod = module_of(P)
    return next((pat for pat in patterns if pat == mod or pat in mod or fnmatch.fnmatch(mod, pat)), None)


def _spec_for(P: str, scheme: Scheme, t: Tensors) -> Spec:
    """The config group that quantizes stored weight ``P``: compressed-tensors by its ``targets`` /
    ``ignore`` (:func:`.schemes.ct_group_of`), else the one scheme (modelopt: not excluded)."""
    if scheme.targets:
        gi, why = ct_group_of(P, LINEAR, scheme)
        if gi is None and why:
            raise InputError(f"{P}: stored quantized, but {scheme.source} ignore entry {why[7:]!r} leaves module "
                             f"{module_of(P)} unquantized", field="ignore", source=t.src(P) or t.src(P + "_packed"))
        if gi is None:
            raise InputError(f"{P}: stored quantized, but no config group's targets match module {module_of(P)} "
                             f"({scheme.source})", field="targets", source=t.src(P) or t.src(P + "_packed"))
        return scheme.specs[gi]
    if (scheme.kind.startswith("modelopt") or scheme.kind == "gpt_oss_mxfp4") and scheme.ignore:
        pat = excluded_by(P, scheme.ignore) if scheme.kind.startswith("modelopt") else not_converted(P, scheme.ignore)
        if pat is not None:
            raise InputError(f"{P}: stored quantized, but the pattern {pat!r} ({scheme.source}) "
                             f"says its module stays unquantized", source=t.src(P),
                             field="exclude_modules" if scheme.kind.startswith("modelopt") else "modules_to_not_convert")
    return scheme.specs[0]


def _check_unquantized_targets(t: Tensors, scheme: Scheme, claimed: set[str]) -> None:
    """A Linear weight (2-D float ``X.weight``, embeddings aside) that a compressed-tensors group
    targets and ``ignore`` does not list must be stored quantized: a loader (vLLM) would look for
    its packed tensors."""
    for k, (dt, shape) in sorted(t.meta.items()):
        if k in claimed or not k.endswith(".weight") or len(shape) != 2 or dt not in ("BF16", "F16", "F32") \
                or "embed" in k:
            continue
        gi, why = ct_group_of(k, LINEAR, scheme)
        if gi is not None:
            raise InputError(f"{k}: stored in {dt}, but config group {scheme.specs[gi].where.split('.')[-1]} "
                             f"targets module {module_of(k)} and ignore does not list it", field="ignore",
                             source=t.src(k))


def quantized_tensors(quant_dir, scheme: Scheme, dtype=torch.bfloat16) -> dict[str, QTensor]:
    """The stored quantized weights of ``quant_dir`` as QTensors, each read with its config
    group's layout and validated (:mod:`.readers`)."""
    d = Path(quant_dir)
    t = Tensors(d, "quant_dir")
    qts: dict[str, QTensor] = {}
    claimed: set[str] = set()
    for P in stored_weights(t, tuple(sorted({LAYOUTS[sp.kind][0] for sp in scheme.specs}))):
        spec = _spec_for(P, scheme, t)
        for n, q in read_param(t, P, spec, dtype).items():
            q.opts["_group"] = spec.where
            qts[n] = q
        claimed |= {P + s for s in ALL_SUFFIXES} | {P}
    check_unclaimed(t, claimed, scheme.kind)
    if scheme.targets:
        _check_unquantized_targets(t, scheme, claimed)
    if not qts:
        raise InputError(f"no quantized weights of scheme {scheme.kind} (from {scheme.source}) in {d}",
                         field="quant_dir")
    return qts


_EXPERT = re.compile(r"(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(?P<pre>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)\[(?P<e>\d+)\]")


def _base_tensor(name: str, base: Tensors) -> tuple[str, torch.Tensor]:
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
    if q.recipe in ("nvfp4", "mxfp4"):
        return C.unpack_fp4(q.codes)
    c = q.codes
    return c.view(torch.uint8) if c.dtype.itemsize == 1 and c.is_floating_point() else c


def _scale_bits(s: torch.Tensor) -> torch.Tensor:
    return s.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[s.dtype.itemsize])


def _requantize_from_base(q: QTensor, w: torch.Tensor, observer) -> QTensor:
    """``observer``: compressed-tensors NVFP4 statistics dtype, or the MXFP4 scale mode."""
    if q.recipe == "mxfp4":
        return quantize(w, "mxfp4", scale_mode=observer)
    if q.recipe == "nvfp4":
        opts = {"convention": q.opts["convention"], "global_scale": q.global_scale}
        if q.opts["convention"] == "compressed_tensors":
            opts["stats_dtype"] = observer
        return quantize(w, "nvfp4", **opts)
    if q.recipe == "int4_g32":
        return quantize(w, "int4_g32", group=q.opts["group"], scale_dtype=q.scales.dtype)
    if q.opts.get("modelopt_export"):
        return modelopt_fp8_quantize(w)
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
    mx_scale_mode: str | None = None
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
                "scale_mismatches": sum(r["scale_mismatches"] for r in self.rows),
                "global_mismatches": sum(r.get("global_mismatch", False) for r in self.rows)}

    def to_dict(self) -> dict:
        return {"quant_dir": self.quant_dir, "base_dir": self.base_dir, "scheme": self.scheme,
                "observer_dtype": self.observer_dtype, "mx_scale_mode": self.mx_scale_mode, "ok": self.ok, "summary": self.summary(),
                "first_mismatch": self.first_mismatch, "rows": self.rows}

    def to_text(self) -> str:
        s = self.summary()
        head = (f"qat-check {self.quant_dir} --base {self.base_dir}: scheme {self.scheme}"
                + (f" (observer {self.observer_dtype})" if self.observer_dtype else "")
                + (f" (scale mode {self.mx_scale_mode})" if self.mx_scale_mode else "")
                + f": {'OK' if self.ok else 'MISMATCH'}, {s['exact']} of {s['tensors']} tensors exact")
        lines = [head]
        for r in self.rows:
            lines.append(f"  {r['name']:<60} {r['recipe']:<11} {'exact' if r['exact'] else 'DIFF '} "
                         f"codes {r['code_mismatches']}/{r['codes']}  scales {r['scale_mismatches']}/{r['scales']}"
                         + ("  global DIFF" if r.get("global_mismatch") else ""))
        f = self.first_mismatch
        if f is not None:
            lines.append(f"first mismatching tensor: {f['name']} (base {f['base_name']}): {f['code_mismatches']} of "
                         f"{f['codes']} codes and {f['scale_mismatches']} of {f['scales']} scales differ"
                         f"{' (and the global scale)' if f.get('global_mismatch') else ''}; "
                         f"{s['tensors'] - s['exact']} of {s['tensors']} tensors mismatch")
        return "\n".join(lines)


def _rows(qts: dict[str, QTensor], base: Tensors, observer) -> list[dict]:
    rows = []
    for name in sorted(qts):
        q = qts[name]
        bname, w = _base_tensor(name, base)
        if q.opts.get("base_layout") == "in_out" and w.dim() == 2:      # HF GptOss: [in, out] per expert
            bname, w = f"{bname}.T", w.transpose(0, 1)
        if not w.is_floating_point():
            raise InputError(f"{name}: base tensor {bname} is {w.dtype}, expected a floating-point weight", field=name)
        if tuple(w.shape) != tuple(q.shape):
            raise InputError(f"{name}: base tensor {bname} has shape {tuple(w.shape)}, the quantized checkpoint "
                             f"holds {tuple(q.shape)}", field=name)
        bad = ~torch.isfinite(w)
        if bool(bad.any()):
            i = int(bad.flatten().nonzero()[0])
            raise InputError(f"{name}: base tensor {bname} holds {float(w.flatten()[i])} at flat index {i}; a "
                             f"master weight must be finite", field=bname.split("[")[0], index=i)
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
        gok = True
        if q.recipe == "nvfp4":                   # the stored global itself: own or fusion-group amax
            group = fusion_group(name, qts)
            amaxes = [w.float().abs().amax()]
            if len(group) > 1:
                amaxes.append(torch.stack([_base_tensor(n, base)[1].float().abs().amax() for n in group]).amax())
            gok = global_matches(q.global_scale, nvfp4_global_candidates(q.opts["convention"], amaxes, w.dtype))
        rows.append({"name": name, "base_name": bname, "recipe": q.recipe, "shape": list(q.shape),
                     "group": q.opts.get("_group"),
                     "codes": int(_code_bits(q).numel()), "code_mismatches": cm,
                     "scales": int(theirs_s.numel()), "scale_mismatches": sm, "global_mismatch": not gok,
                     "exact": cm == 0 and sm == 0 and gok})
    return rows


MX_SCALE_MODES = ("floor", "rceil")


def qat_check_base(quant_dir, base_dir, observer: str = "auto", mx_scale_mode: str = "auto") -> QATBaseReport:
    """Fake-quantize BASE_DIR's weights with QUANT_DIR's scheme and compare codes and scales
    bitwise (module doc). ``observer`` (compressed-tensors NVFP4 only): ``"auto"``, ``"weight"``
    (statistics in the base weight's dtype) or ``"float32"``."""
    if observer not in ("auto", "weight", "float32"):
        raise InputError(f"observer must be auto, weight or float32, got {observer!r}", field="observer")
    if mx_scale_mode != "auto" and mx_scale_mode not in MX_SCALE_MODES:
        raise InputError(f"mx_scale_mode must be auto or one of {MX_SCALE_MODES}, got {mx_scale_mode!r}",
                         field="mx_scale_mode")
    scheme = detect_scheme(quant_dir)
    bdir = Path(base_dir)
    if not bdir.is_dir():
        raise InputError(f"{bdir} is not a directory", field="base_dir")
    base = Tensors(bdir, "base_dir")
    qts = quantized_tensors(quant_dir, scheme)
    rep = QATBaseReport(str(quant_dir), str(base_dir), scheme.kind)
    if scheme.kind == "gpt_oss_mxfp4":
        modes = [mx_scale_mode] if mx_scale_mode != "auto" else list(MX_SCALE_MODES)
        best = max(((sum(r["exact"] for r in rows), -i, m, rows) for i, m in enumerate(modes)
                    for rows in [_rows(qts, base, m)]), key=lambda b: b[:2])
        rep.rows, rep.mx_scale_mode = best[3], best[2]
        return rep
    if all(sp.kind != "ct_nvfp4" for sp in scheme.specs):
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
