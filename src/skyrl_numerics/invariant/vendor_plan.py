"""Serving a checkpoint a vendor already quantized: its config read into a
:class:`~.numerics.NumericsPlan`, its stored codes + scales loaded straight into the invariant
model's packed storage (no bf16 copy of a quantized weight, ever), on the trainer and in the
invariant vLLM engine alike.

What is read (the config as vLLM reads it: ``config.json``'s ``quantization_config``, else
modelopt's ``hf_quant_config.json``; both present: they must agree)::

    config                                     weight (stored)                    activations
    modelopt NVFP4                             nvfp4: P u8, P_scale E4M3,         nvfp4, static global
                                               P_scale_2 (g = amax/2688)          g = X.input_scale
    modelopt W4A16_NVFP4                       nvfp4                              none (input_scale dropped)
    modelopt FP8                               fp8_tensor_weight: P E4M3,         fp8_tensor, static
                                               P_scale                            X.input_scale
    compressed-tensors pack-quantized          int4_g32 / int4_g128:              none
      int 4-bit group 32 / 128                 P_packed i32, P_scale, P_shape
    compressed-tensors nvfp4-pack-quantized    nvfp4_ct: P_packed u8, P_scale,    none
                                               P_global_scale (G = 2688/amax)
    compressed-tensors float-quantized 8-bit   fp8_tensor_weight / fp8_channel /  input_activations: none,
      tensor / channel / block [128, 128]      fp8_block: P E4M3, P_scale         fp8 token (dynamic),
                                                                                  tensor (static X.input_scale),
                                                                                  group 128 (dynamic)
    quant_method fp8, weight_block_size        fp8_block: P E4M3, P_scale_inv     fp8_group (dynamic 1x128)
      [128, 128] (DeepSeek-V3)

Which linears: modelopt ``exclude_modules`` (vLLM's rule: name, substring or wildcard),
compressed-tensors ``targets`` / ``ignore`` (compressed-tensors' own matching), DeepSeek
``modules_to_not_convert``. The plan has one format per group (attention, dense, shared,
experts): a group the config splits between formats is refused, naming the two linears. Routers,
embeddings, norms and lm-head are served in the model dtype and must be stored so.

Every number as the checkpoint stores it: each linear is decoded with its own stored scales (the
vendor's dequantization, rounded once to the model dtype) and its activations quantized with its
own stored ``input_scale``. vLLM's fused layers reduce these across siblings (the max over q/k/v,
gate/up; FP8 experts: over the layer's experts; modelopt FP8 q/k/v weights requantized to the max
scale): identical where the exporter unified them, as modelopt's export does for input scales and
NVFP4 globals (not for FP8 per-tensor weight scales). Anything else in the config (KV-cache
schemes, asymmetric or GPTQ-ordered weights, NVFP4 or int8 activations, dynamic per-tensor
activations, fused 3-D expert stacks) is refused, naming the field or the tensor.

The loader (:class:`VendorLoader`) takes ``(name, tensor)`` pairs in any order — vLLM's weight
iterator or :func:`.base.iter_checkpoint_tensors` — keeps the parts of a weight until its layout
is complete, validates them with ``qat-check --base``'s readers
(:func:`skyrl_numerics.quant.vendor_check.readers.read_param`: dtypes, shapes, finite scales) and
stores the :class:`~skyrl_numerics.quant.qtensor.QTensor`. Both sides run this one code on the
same tensors, so they hold the same codes and scales and serve bitwise-identical numbers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from skyrl_numerics.errors import InputError

from .numerics import LinearFormat, NumericsPlan, group_of, is_absorbed

CT_TOP = {"quant_method", "format", "quantization_status", "config_groups", "ignore", "kv_cache_scheme",
          "global_compression_ratio", "sparsity_config", "transform_config", "version"}
CT_GROUP = {"targets", "weights", "input_activations", "output_activations", "format"}
MODELOPT = {"producer", "quant_method", "quant_algo", "kv_cache_quant_algo", "group_size",
            "exclude_modules", "ignore", "config_groups", "kv_cache_scheme"}
DEEPSEEK = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}
MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8")


def _bad(where: str, key: str, msg: str):
    from .blocks import UnsupportedConfig

    raise UnsupportedConfig(f"{where}: {msg}", field=key)


def _keys(where: str, d: dict, allowed: set) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        _bad(where, extra[0], f"unknown field(s) {extra}; this reader knows {sorted(allowed)} (a field it "
                              f"does not know could change the stored numbers)")


@dataclass(frozen=True)
class Rule:
    """How one config group's linears are stored and served: the readers' layout ``spec``, the
    plan's ``weight`` / ``act`` format names, ``static`` (activation scale per linear from
    ``X.input_scale``) and ``drop_input_scale`` (a stored ``input_scale`` the format ignores)."""
    spec: object
    weight: str
    act: str = "none"
    static: bool = False
    drop_input_scale: bool = False

    @property
    def where(self) -> str:
        return self.spec.where


# ------------------------------------------------------------------------------------ config
def vendor_quant_config(model_dir=None, hf_config: dict | None = None) -> dict | None:
    """``{"config": …, "source": …}`` of a quantized checkpoint (module doc), or None for a
    checkpoint in floating point. ``hf_config``: ``config.json`` already read."""
    from skyrl_numerics.quant.vendor_check.readers import read_json

    d = Path(model_dir) if model_dir is not None else None
    cfg = hf_config if hf_config is not None else (
        read_json(d / "config.json") if d is not None and (d / "config.json").is_file() else {})
    qc = cfg.get("quantization_config")
    hf = d / "hf_quant_config.json" if d is not None else None
    other = read_json(hf) if hf is not None and hf.is_file() else None
    if qc is None and other is None:
        return None
    if qc is not None and not isinstance(qc, dict):
        _bad("config.json", "quantization_config", f"must be an object, got {type(qc).__name__}")
    out = ({"config": qc, "source": "config.json quantization_config"} if qc is not None
           else {"config": other, "source": "hf_quant_config.json"})
    one = VendorScheme(out)
    if qc is not None and other is not None:        # modelopt writes both: they must say the same
        two = VendorScheme({"config": other, "source": "hf_quant_config.json"})
        if [(r.weight, r.act) for r in one.rules] != [(r.weight, r.act) for r in two.rules]:
            _bad("hf_quant_config.json vs config.json", "quant_algo", "the two quantization configs disagree")
        if one.ignore != two.ignore:
            _bad("hf_quant_config.json vs config.json", "exclude_modules",
                 f"the two quantization configs exclude {two.ignore} and {one.ignore}")
    return out


class VendorScheme:
    """A validated quantization config: its :class:`Rule` s, the compressed-tensors ``targets``
    per rule, and the ``ignore`` patterns (modelopt ``exclude_modules``, DeepSeek
    ``modules_to_not_convert``)."""

    def __init__(self, quant: dict):
        qc, src = quant["config"], quant["source"]
        if not isinstance(qc, dict):
            _bad(src, "quantization_config", f"must be an object, got {type(qc).__name__}")
        self.source = src
        self.rules: list[Rule] = []
        self.targets: list[list[str]] = []
        self.ignore: list[str] = []
        method = "modelopt" if isinstance(qc.get("quantization"), dict) else qc.get("quant_method")
        self.method = method
        if method == "modelopt":
            self._modelopt(qc, src)
        elif method == "compressed-tensors":
            self._ct(qc, src)
        elif method == "fp8":
            self._deepseek(qc, src)
        else:
            _bad(src, "quant_method", f"quant_method {method!r} is not served by the invariant model; "
                                      "supported: modelopt, compressed-tensors, fp8 (DeepSeek block FP8)")

    # ---- per method ---------------------------------------------------------------------
    def _modelopt(self, qc: dict, src: str) -> None:
        from skyrl_numerics.quant.vendor_check.readers import Spec

        if isinstance(qc.get("quantization"), dict):          # hf_quant_config.json
            _keys(src, qc, {"producer", "quantization"})
            q, src = qc["quantization"], src + " quantization"
        else:
            q = qc
        _keys(src, q, MODELOPT)
        algo = q.get("quant_algo")
        if algo not in MODELOPT_ALGOS:
            _bad(src, "quant_algo", f"modelopt quant_algo {algo!r} is not served; supported: {list(MODELOPT_ALGOS)}")
        for k in ("kv_cache_quant_algo", "kv_cache_scheme"):
            if q.get(k) is not None:
                _bad(src, k, f"{k} {q.get(k)!r}: a quantized KV cache from the checkpoint is not served "
                             "(pass kv_cache= to the invariant model instead)")
        nv = algo != "FP8"
        gs = q.get("group_size")
        if gs is not None and (not nv or gs != 16 or isinstance(gs, bool)):
            _bad(src, "group_size", f"group_size {gs!r}: NVFP4 groups are 16, FP8 per-tensor weights have none")
        if q.get("config_groups") is not None:
            self._modelopt_groups(q["config_groups"], src, algo)
        ex, ig = q.get("exclude_modules"), q.get("ignore")
        if ex is not None and ig is not None and ex != ig:
            _bad(src, "exclude_modules", f"exclude_modules {ex!r} and ignore {ig!r} differ")
        ex = ex if ex is not None else (ig if ig is not None else [])
        if not (isinstance(ex, list) and all(isinstance(x, str) and x for x in ex)):
            _bad(src, "exclude_modules", f"must be a list of module names / wildcards, got {ex!r}")
        self.ignore = list(ex)
        spec = Spec("modelopt_nvfp4" if nv else "modelopt_fp8", src)
        self.rules = [Rule(spec, "nvfp4", "nvfp4", static=True) if algo == "NVFP4" else
                      Rule(spec, "nvfp4", drop_input_scale=True) if algo == "W4A16_NVFP4" else
                      Rule(spec, "fp8_tensor_weight", "fp8_tensor", static=True)]

    @staticmethod
    def _modelopt_groups(groups, src: str, algo: str) -> None:
        """config.json's ct-shaped echo of the algo (modelopt >= 0.31): it must say the same."""
        if not (isinstance(groups, dict) and len(groups) == 1):
            _bad(src, "config_groups", f"expected one group, got {groups!r}")
        (gname, g), = groups.items()
        where = f"{src} config_groups.{gname}"
        if not isinstance(g, dict):
            _bad(where, "config_groups", f"must be an object, got {g!r}")
        _keys(where, g, {"weights", "input_activations", "targets"})
        if g.get("targets", ["Linear"]) != ["Linear"]:
            _bad(where, "targets", f"modelopt quantizes Linear modules, got {g.get('targets')!r}")
        bits = 8 if algo == "FP8" else 4
        want = {"weights": {"num_bits": bits, "type": "float", "dynamic": False},
                "input_activations": None if algo == "W4A16_NVFP4" else {"num_bits": bits, "type": "float",
                                                                         "dynamic": False}}
        for part, w in want.items():
            got = g.get(part)
            if w is None or got is None:
                if (w is None) != (got is None):
                    _bad(where, part, f"{part} {got!r} does not match quant_algo {algo}")
                continue
            if not isinstance(got, dict):
                _bad(where, part, f"must be an object, got {got!r}")
            _keys(f"{where}.{part}", got, {"num_bits", "type", "dynamic", "group_size"})
            for k, v in w.items():
                if got.get(k) != v or isinstance(got.get(k), bool) != isinstance(v, bool):
                    _bad(f"{where}.{part}", k, f"{k} {got.get(k)!r} does not match quant_algo {algo} ({v!r})")
            if got.get("group_size") != (16 if bits == 4 else None):
                _bad(f"{where}.{part}", "group_size", f"group_size {got.get('group_size')!r} does not match "
                                                      f"quant_algo {algo}")

    def _ct(self, qc: dict, src: str) -> None:
        from skyrl_numerics.quant.vendor_check.readers import ct_top_level, ct_weights_spec

        _keys(src, qc, CT_TOP)
        ct_top_level(qc, src)
        if qc.get("kv_cache_scheme") is not None:
            _bad(src, "kv_cache_scheme", "a quantized KV cache from the checkpoint is not served (pass "
                                         "kv_cache= to the invariant model instead)")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            _bad(src, "config_groups", "compressed-tensors quantization_config has no config_groups")
        for gname, g in groups.items():
            where = f"{src} config_groups.{gname}"
            if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
                _bad(where, "weights", "no weights arguments")
            _keys(where, g, CT_GROUP)
            tg = g.get("targets")
            if not (isinstance(tg, list) and tg and all(isinstance(x, str) and x for x in tg)):
                _bad(where, "targets", f"targets must be a non-empty list of module names / 're:' patterns, got {tg!r}")
            if g.get("output_activations") is not None:
                _bad(where, "output_activations", "output quantization is not served")
            fmt = g["format"] if g.get("format") is not None else qc.get("format")
            spec = ct_weights_spec(where, g["weights"], fmt)
            act, static = _ct_act(where, g.get("input_activations"))
            self.rules.append(Rule(spec, _ct_weight_format(spec), act, static))
            self.targets.append(list(tg))
        self.ignore = list(qc.get("ignore") or [])

    def _deepseek(self, qc: dict, src: str) -> None:
        from skyrl_numerics.quant.vendor_check.readers import deepseek_spec

        _keys(src, qc, DEEPSEEK)
        spec = deepseek_spec(qc, src)
        if spec.block != (128, 128):
            _bad(src, "weight_block_size", f"block FP8 weights are served in 128x128 blocks, got {list(spec.block)}")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            _bad(src, "activation_scheme", "static activation scales for block FP8 are not served (DeepSeek-V3 "
                                           "quantizes activations per token and 128 columns)")
        m = qc.get("modules_to_not_convert") or []
        if not (isinstance(m, list) and all(isinstance(x, str) and x for x in m)):
            _bad(src, "modules_to_not_convert", f"must be a list of module patterns, got {m!r}")
        self.ignore = list(m)
        self.rules = [Rule(spec, "fp8_block", "fp8_group")]

    # ---- which linear -------------------------------------------------------------------
    def rule_for(self, name: str) -> tuple[Rule | None, str]:
        """(the rule serving weight ``name``, or None: model dtype; the config field deciding)."""
        from skyrl_numerics.quant.vendor_check.check import excluded_by
        from skyrl_numerics.quant.vendor_check.schemes import ct_group_of, not_converted

        if self.method == "modelopt":
            pat = excluded_by(name, self.ignore)
            return (None, f"exclude_modules entry {pat!r}") if pat is not None else (self.rules[0], "quant_algo")
        if self.method == "fp8":
            pat = not_converted(name, self.ignore)
            return (None, f"modules_to_not_convert entry {pat!r}") if pat else (self.rules[0], "quant_method")
        gi, why = ct_group_of(name, ("Linear",), self)
        if gi is None:
            return None, (f"ignore entry {why[7:]!r}" if why else "no config group's targets")
        return self.rules[gi], f"{self.rules[gi].where} targets {why!r}"


def _ct_weight_format(spec) -> str:
    if spec.kind == "ct_int4":
        if spec.group_size not in (32, 128):
            _bad(spec.where, "group_size", f"int4 groups of {spec.group_size} are not served (32 or 128)")
        return f"int4_g{spec.group_size}"
    if spec.kind == "ct_nvfp4":
        return "nvfp4_ct"
    fmt = {(1, -1): "fp8_channel", (-1, -1): "fp8_tensor_weight", (128, 128): "fp8_block"}.get(spec.block)
    if fmt is None:
        _bad(spec.where, "block_structure", f"FP8 blocks {list(spec.block)} are not served (128x128 only)")
    return fmt


def _ct_act(where: str, a) -> tuple[str, bool]:
    """(activation format, static) of a compressed-tensors ``input_activations`` block."""
    from skyrl_numerics.quant.vendor_check.readers import CT_WEIGHT_KEYS

    if a is None:
        return "none", False
    where = f"{where}.input_activations"
    if not isinstance(a, dict):
        _bad(where, "input_activations", f"must be an object, got {a!r}")
    _keys(where, a, CT_WEIGHT_KEYS)
    if (a.get("type"), a.get("num_bits")) != ("float", 8) or isinstance(a.get("num_bits"), bool):
        _bad(where, "num_bits", f"only FP8 activations are served (int8 and NVFP4 activations are not), got "
                                f"type {a.get('type')!r} num_bits {a.get('num_bits')!r}")
    if a.get("symmetric", True) is not True:
        _bad(where, "symmetric", f"asymmetric activations are not served, got {a.get('symmetric')!r}")
    if a.get("scale_dtype") not in (None, "torch.float32", "float32"):
        _bad(where, "scale_dtype", f"activation scales are float32, got {a.get('scale_dtype')!r}")
    for k in ("actorder", "zp_dtype", "block_structure"):
        if a.get(k) is not None:
            _bad(where, k, f"{k} {a.get(k)!r} is not served for activations")
    if a.get("observer_kwargs") not in (None, {}):
        _bad(where, "observer_kwargs", f"observer_kwargs {a.get('observer_kwargs')!r} are not served")
    strat, dyn, gs = a.get("strategy"), a.get("dynamic"), a.get("group_size")
    if strat == "token" and dyn is True and gs is None:
        return "fp8_token", False
    if strat == "tensor" and dyn is False and gs is None:
        return "fp8_tensor", True
    if strat == "group" and dyn is True and gs == 128 and not isinstance(gs, bool):
        return "fp8_group", False
    if strat == "tensor" and dyn is True:
        _bad(where, "dynamic", "dynamic per-tensor activation scales depend on the whole batch (no token's bits "
                               "would be its own): not served")
    _bad(where, "strategy", f"FP8 activations served: dynamic token, static tensor, dynamic group 128; got "
                            f"strategy {strat!r} dynamic {dyn!r} group_size {gs!r}")


# ------------------------------------------------------------------------------------ the plan
def planned_linears(names) -> list[str]:
    return [n for n in names if group_of(n)]


def scheme_plan(scheme: VendorScheme, names) -> tuple[NumericsPlan, dict]:
    """The plan of a model with weights ``names`` under ``scheme`` and ``{weight: Rule}`` of its
    quantized linears. One format per group: a group the config splits is refused, naming both
    linears (MLA's absorbed ``kv_b_proj`` takes the group's weight format only)."""
    field = {"compressed-tensors": "ignore", "modelopt": "exclude_modules"}.get(scheme.method,
                                                                             "modules_to_not_convert")
    seen: dict[str, dict] = {}       # group -> {"weight": (value, linear, why), "act": (...)}
    rules = {}
    for n in planned_linears(names):
        r, why = scheme.rule_for(n)
        if r is not None:
            rules[n] = r
        g = seen.setdefault(group_of(n), {})
        parts = {"weight": r.weight if r else None}
        if not is_absorbed(n):
            parts["act"] = (r.act, r.static) if r else ("none", False)
        for k, v in parts.items():
            first = g.setdefault(k, (v, n, why))
            if first[0] != v:
                _bad(scheme.source, field if k == "weight" and None in (first[0], v) else "config_groups",
                     f"group {group_of(n)!r}: {first[1]} is served {first[0] or 'unquantized'} ({first[2]}) but "
                     f"{n} {v or 'unquantized'} ({why}); the invariant plan serves one format per group")
    formats = {}
    for g, d in seen.items():
        weight = d["weight"][0]
        act, _ = d.get("act", (("none", False),))[0]
        if weight is not None:
            formats[g] = LinearFormat(weight=weight, act=act, act_scale=1.0 if act == "fp8_tensor" else None)
    return NumericsPlan(formats=formats), rules


def _hf_names(hf_config: dict, kv_cache=None) -> list[str]:
    from types import SimpleNamespace

    from . import architecture_of, family_class

    cfg = SimpleNamespace(**hf_config)
    cls = family_class(architecture_of(cfg))
    with torch.device("meta"):
        return cls(**cls.config_parts(cfg, kv_cache=kv_cache)).hf_names()


def merge_lora(plan: NumericsPlan, numerics) -> NumericsPlan:
    """The vendor plan with the LoRA of ``numerics`` (a plan or its JSON); formats ``numerics``
    names must be the checkpoint's."""
    user = NumericsPlan.from_json(numerics)
    if user is None:
        return plan
    for g, f in user.formats.items():
        if plan.formats.get(g, LinearFormat()) != f:
            _bad("numerics", f"formats.{g}", f"the checkpoint is quantized and serves {g!r} as "
                                            f"{plan.formats.get(g)}; the plan asks for {f}")
    return replace(plan, lora_rank=user.lora_rank, lora_alpha=user.lora_alpha,
                   lora_targets=user.lora_targets, seed=user.seed)


def vendor_numerics(hf_config: dict, quant: dict, numerics=None, kv_cache=None) -> NumericsPlan:
    """The plan serving checkpoint config ``hf_config`` quantized as ``quant``
    (:func:`vendor_quant_config`), with the LoRA of ``numerics``."""
    plan, _ = scheme_plan(VendorScheme(quant), _hf_names(hf_config, kv_cache))
    return merge_lora(plan, numerics)


def vendor_overrides(quant: dict) -> dict:
    """``hf_overrides`` for the invariant engine on a vendor checkpoint: vLLM's own quantization
    is switched off (the invariant model reads the stored tensors itself)."""
    return {"skyrl_vendor": json.dumps(quant, sort_keys=True), "quantization_config": None}


# ------------------------------------------------------------------------------------ loading
def install(model, vendor) -> None:
    """Give a model built from a vendor plan its :class:`VendorLoader` (``vendor``: the
    :func:`vendor_quant_config` dict or its JSON). The model's plan must be the scheme's."""
    quant = json.loads(vendor) if isinstance(vendor, str) else vendor
    scheme = VendorScheme(quant)
    plan, rules = scheme_plan(scheme, model.hf_names())
    have = model.numerics.formats if model.numerics is not None else {}
    if dict(have) != dict(plan.formats):
        _bad("skyrl_vendor", "skyrl_numerics", f"the model's plan {have} is not the checkpoint's {plan.formats}")
    missing = [n for n in rules if n not in model._packed]
    if missing:
        _bad("skyrl_vendor", missing[0], "a quantized weight the model holds unpacked (build it with pack=True)")
    model._vendor = VendorLoader(rules)


_LAYOUT = {"modelopt_nvfp4": ("", "_scale", "_scale_2"), "ct_nvfp4": ("_packed", "_scale", "_global_scale"),
           "ct_int4": ("_packed", "_scale", "_shape"), "ct_fp8": ("", "_scale"), "modelopt_fp8": ("", "_scale"),
           "deepseek_fp8_block": ("", "_scale_inv")}
_COMPANION = ("_scale", "_scale_2", "_packed", "_global_scale", "_shape", "_scale_inv", "_zero_point",
              "input_scale", "input_global_scale", "_g_idx", "k_scale", "v_scale")


class _Parts:
    """The tensors of one weight, with the interface ``readers.read_param`` reads."""

    def __init__(self, parts: dict):
        self.parts = parts

    def __contains__(self, k):
        return k in self.parts

    def __getitem__(self, k):
        return self.parts[k]

    def src(self, k):
        return None


class VendorLoader:
    """Streams a vendor checkpoint's tensors into a model's packed storage (module doc)."""

    def __init__(self, rules: dict):
        self.rules = rules
        self.owner: dict[str, tuple[str, str]] = {}     # tensor name -> (weight, role)
        self.static: set[str] = set()
        for P, r in rules.items():
            for sfx in _LAYOUT[r.spec.kind]:
                self.owner[P + sfx] = (P, "part")
            x = P[: -len(".weight")] + ".input_scale"
            if r.static and not is_absorbed(P):
                self.owner[x], _ = (P, "act"), self.static.add(P)
            elif r.static or r.drop_input_scale:
                self.owner[x] = (P, "drop")
        self.pending: dict[str, dict] = {}
        self.scales: dict[str, float] = {}

    def names(self) -> tuple[set, set]:
        """(tensor names the checkpoint must hold for the packed weights, names it may hold)."""
        return ({n for n, (_, role) in self.owner.items() if role != "drop"},
                {n for n, (_, role) in self.owner.items() if role == "drop"})

    def take(self, model, named):
        """The pairs of ``named`` that are not a packed weight's parts (those are consumed)."""
        for name, t in named:
            hit = self.owner.get(name)
            if name in self.rules and t.is_floating_point() and t.dtype.itemsize > 1:
                raise InputError(f"weight {name!r} is served from the checkpoint's stored codes + scales "
                                 f"({self.rules[name].where}); a {t.dtype} value for it would be requantized "
                                 "by other rules than the vendor's: send its stored parts", field=name)
            if hit is None:
                if (name.endswith(_COMPANION) or t.dtype in (torch.uint8, torch.int8, torch.int32)
                        or t.dtype.itemsize == 1):
                    raise InputError(f"tensor {name!r} ({t.dtype}) is stored quantized, but the quantization "
                                     "config serves its weight in the model dtype (or it belongs to no weight)",
                                     field=name)
                yield name, t
                continue
            P, role = hit
            if role == "part":
                self.pending.setdefault(P, {})[name] = t.clone()
                if all(P + s in self.pending[P] for s in _LAYOUT[self.rules[P].spec.kind]):
                    self._build(model, P)
            else:
                v = _scalar_scale(name, t)
                if role == "act":
                    self.scales[P] = v
                    proj = model._proj[P]
                    proj.fmt = replace(proj.fmt, **({"act_scale": v} if proj.fmt.act == "fp8_tensor"
                                                    else {"act_global": v}))

    def _build(self, model, P: str) -> None:
        from skyrl_numerics.quant.vendor_check.readers import read_param

        parts = self.pending.pop(P)
        if parts[P + _LAYOUT[self.rules[P].spec.kind][0]].dim() != 2:
            raise InputError(f"{P}: a {parts[P + _LAYOUT[self.rules[P].spec.kind][0]].dim()}-D stack; the "
                             "invariant model loads one 2-D matrix per linear (per-expert names)", field=P)
        q = read_param(_Parts(parts), P, self.rules[P].spec, model.dtype)[P]
        if -1 in q.block:            # FP8 per tensor / channel: the block the quant API resolves
            from skyrl_numerics.quant.blocks import resolve_block

            q.block = resolve_block(torch.Size(q.shape), q.block)[2:]
        if tuple(q.shape) != tuple(model._packed_shapes[P]):
            raise InputError(f"{P}: the stored codes hold a {tuple(q.shape)} weight, the model's is "
                             f"{tuple(model._packed_shapes[P])}", field=P)
        model._packed[P] = q

    def finish(self, model) -> None:
        """After a load: every packed weight and static activation scale is there, no weight's
        parts are left half-read (errors name the first missing tensor)."""
        for P, parts in sorted(self.pending.items()):
            miss = [P + s for s in _LAYOUT[self.rules[P].spec.kind] if P + s not in parts]
            raise InputError(f"{P}: {miss[0]} is missing (the weight's other parts were loaded)", field=miss[0])
        for P in sorted(self.rules):
            if model._packed.get(P) is None:
                miss = P + _LAYOUT[self.rules[P].spec.kind][0]
                raise InputError(f"{P}: quantized by the config ({self.rules[P].where}), but its codes "
                                 f"{miss} were never loaded", field=miss)
        for P in sorted(self.static - set(self.scales)):
            x = P[: -len(".weight")] + ".input_scale"
            raise InputError(f"{P}: static activations ({self.rules[P].where}) need {x}, never loaded", field=x)


def _scalar_scale(name: str, t: torch.Tensor) -> float:
    if not t.is_floating_point() or t.dtype.itemsize == 1 or t.numel() != 1 or t.dim() > 1:
        raise InputError(f"tensor {name!r}: an input scale is one float, got {t.dtype} of shape "
                         f"{tuple(t.shape)}", field=name)
    v = float(t.float().reshape(()))
    if not (v > 0 and v != float("inf")):
        raise InputError(f"tensor {name!r}: an input scale must be finite and > 0, got {v}", field=name)
    return v


def from_vendor_checkpoint(cls, model_dir, quant: dict, *, kv_cache=None, dtype=torch.bfloat16, numerics=None):
    """The trainer side of :meth:`.base.InvariantCausalLM.from_checkpoint` for a quantized
    checkpoint: the vendor plan (plus the LoRA of ``numerics``), packed weights filled from the
    stored codes + scales; names missing or left over are refused, naming the first."""
    from transformers import AutoConfig

    from .base import checkpoint_tensor_names, iter_checkpoint_tensors

    cfg = AutoConfig.from_pretrained(str(model_dir))
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    plan = vendor_numerics(hf, quant, numerics, kv_cache=kv_cache)
    cfg.skyrl_vendor = json.dumps(quant, sort_keys=True)
    model = cls.from_config(cfg, dtype=dtype, kv_cache=kv_cache, numerics=plan, pack=True)
    need, may = model._vendor.names()
    plain = {n for n in model.hf_names() if n not in model._packed and n not in model.adapter_names()}
    stored = set(checkpoint_tensor_names(model_dir))
    missing = sorted((need | plain) - stored)
    if missing:
        q = [missing[0] + s for s in ("_packed", "_scale", "_scale_inv") if missing[0] + s in stored]
        raise InputError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}" + (
            f" ({q[0]} is stored: the checkpoint holds {missing[0]} quantized, its config says it is not)"
            if q else ""), source=str(model_dir), field=missing[0])
    extra = sorted(n for n in stored if n not in need | plain | may and not model.ignored_weight(n))
    if extra:
        raise InputError(f"checkpoint has {len(extra)} tensors the invariant {type(model).__name__} does not "
                         f"serve, e.g. {extra[:3]}", source=str(model_dir), field=extra[0])
    model.load_named(iter_checkpoint_tensors(model_dir, names=need | plain | may))
    return model.eval()
