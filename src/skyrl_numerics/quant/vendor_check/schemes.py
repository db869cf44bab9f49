"""Scheme details of ``qat-check --base`` beyond one tensor: which stored weights share an NVFP4
global scale (fused projections), and the globals a writer can have stored for them.

NVFP4 writers give projections that serving fuses one global (modelopt's export unifies the amax
of q/k/v and of gate/up; vLLM takes one scale for a fused layer), so a stored global must be the
value of the tensor's own amax or of its fusion group's: ``g = fl(A / 2688)`` (modelopt,
``weight_scale_2``) or ``G = fl(2688 / A)`` (compressed-tensors ``weight_global_scale``, in float32,
or in the observer's dtype: llm-compressor divides in bf16 for bf16 weights). Checking codes and
block scales alone cannot see a global edited by an ulp: the block scales and codes recomputed
with the edited global usually come out the same.
"""
from __future__ import annotations

import re

import torch

from skyrl_numerics.errors import InputError

_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_PROJ = re.compile(r"(?P<pre>.*\.)(?P<p>q_proj|k_proj|v_proj|gate_proj|up_proj)(?P<post>\.weight)")


def fusion_group(name: str, names) -> list[str]:
    """The stored weights that share ``name``'s global: its q/k/v or gate/up siblings present in
    ``names`` (``name`` alone otherwise; a fused ``gate_up_proj[e]`` is already one matrix)."""
    m = _PROJ.fullmatch(name)
    if not m:
        return [name]
    sib = next(g for g in _SIBLINGS if m.group("p") in g)
    return [n for n in (f"{m.group('pre')}{p}{m.group('post')}" for p in sib) if n == name or n in names]


def nvfp4_global_candidates(convention: str, amaxes, weight_dtype) -> list[torch.Tensor]:
    """float32 0-d globals a writer stores for a tensor whose own / fusion-group amax is in
    ``amaxes`` (float32 0-d)."""
    f32 = torch.float32
    out = []
    for A in amaxes:
        A = A.to(f32).reshape(())
        if float(A) == 0:
            out.append(torch.zeros((), dtype=f32))                 # all-zero tensor (recipes_nvfp4)
        if convention == "modelopt":
            out.append(A / 2688.0)
            continue
        for dt in dict.fromkeys((f32, weight_dtype)):
            a = A.to(dt)
            g = (2688.0 / torch.clamp(a, min=torch.finfo(dt).tiny)).to(f32)
            out.append(torch.where(torch.isfinite(g), g, torch.ones((), dtype=f32)))
    return out


def global_matches(stored: torch.Tensor, candidates) -> bool:
    s = stored.to(torch.float32).reshape(()).view(torch.int32)
    return any(bool(s == c.reshape(()).view(torch.int32)) for c in candidates)


# ------------------------------------------------------------ compressed-tensors targets / ignore
def module_of(P: str) -> str:
    """The module a stored weight belongs to (``X.weight`` -> ``X``; a fused stack param is its own)."""
    return P[: -len(".weight")] if P.endswith(".weight") else P


def _name_match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        try:
            return re.match(target[3:], name) is not None
        except re.error as e:
            raise InputError(f"target {target!r} is not a valid regex: {e}", field="targets") from None
    return target == name


def ct_targets_match(name: str, classes, targets) -> list[str]:
    """compressed-tensors ``match_targets``: the targets matching module ``name`` of class names
    ``classes``, most specific first — exact names and ``re:`` patterns (sorted: plain names before
    patterns, then alphabetically), then class names."""
    ordered = sorted(targets, key=lambda x: ("re:" in x, x))
    hits = [t for t in ordered if _name_match(name, t)]
    return hits + [t for t in ordered if t in classes and t not in hits]


def ct_group_of(P: str, classes, scheme) -> tuple[int | None, str | None]:
    """(index of the config group that quantizes weight ``P``, the target that decided it) under
    compressed-tensors' rules (``apply_quantization_config``): a module named in ``ignore`` (name,
    ``re:`` pattern or class) is left alone; otherwise every target string maps to the *last* group
    listing it, and the most specific matching target picks the group. ``(None, None)``: no group
    (or ignored: then the target is ``"ignore:<entry>"``)."""
    mod = module_of(P)
    for ig in scheme.ignore:
        if _name_match(mod, ig) or ig in classes:
            return None, f"ignore:{ig}"
    owner = {}
    for i, tg in enumerate(scheme.targets):
        for t in tg:
            owner[t] = i
    hits = ct_targets_match(mod, classes, list(owner))
    return (owner[hits[0]], hits[0]) if hits else (None, None)


def not_converted(P: str, patterns) -> str | None:
    """The ``modules_to_not_convert`` entry that keeps ``P``'s module in bf16, by transformers'
    ``should_convert_module``: the pattern ``re.match``-es the module name (as a prefix), or the
    name ends with it. ``P``'s module is its name without the last component."""
    for name in (P.rsplit(".", 1)[0], P):
        for k in patterns:
            try:
                if re.match(f"{k}\\.", name) or re.match(k, name) or name.endswith(k):
                    return k
            except re.error as e:
                raise InputError(f"modules_to_not_convert entry {k!r} is not a valid regex: {e}",
                                 field="modules_to_not_convert") from None
    return None


def modelopt_fp8_quantize(w: torch.Tensor):
    """FP8 per-tensor weights as modelopt 0.47's HF export writes them (``to_quantized_weight``):
    ``s = fl(amax / 448)`` (float32 0-d, ``weight_scale``) and ``codes = (w / s).to(e4m3)`` with
    torch's promotion rules: a 0-d float32 scale does not promote a bf16 weight, so the quotient is
    rounded to bf16 before the FP8 cast (a float32 division differs in a few % of the codes of a
    bf16 weight)."""
    from ..api import quantize
    q = quantize(w, "fp8_channel", block=(-1, -1), scale_dtype=torch.float32)
    q.codes = (w / q.scales.reshape(())).to(torch.float8_e4m3fn)
    q.opts["modelopt_export"] = True
    return q
