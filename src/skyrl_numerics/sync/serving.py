"""Weight sync in a serving format: the trainer's bf16 weights quantized at publish time.

``DeltaPublisher(root, weights_format=FMT)`` replaces each selected weight ``P`` of the state by the
tensors a serving checkpoint in ``FMT`` stores for it (:func:`serving_state`), computed by
``skyrl_numerics.quant.checkpoint.quantize_weight_tensors`` (i.e. ``skyrl_numerics.quant.quantize``
with the format's recipe, per 2-D matrix or per expert of a 3-D stack), and then publishes those
tensors like any other: XOR deltas over the raw bytes of the codes and the scales. The receiver thus
holds the serving tensors bit for bit.

=================  =========================================================  ====================
``weights_format``  stored per weight ``P``                                    recipe
=================  =========================================================  ====================
``native``          ``P`` as given (bf16 / fp32 / ...)                         none
``deepseek_fp8``    ``P`` E4M3, ``P_scale_inv`` fp32 ``[ceil(o/128), ceil(i/128)]``  ``fp8_block`` 128x128
``ct_fp8_block``    ``P`` E4M3, ``P_scale`` (weight dtype) 128x128 blocks          ``fp8_channel`` block
``ct_fp8_channel``  ``P`` E4M3, ``P_scale`` ``[o, 1]``                              ``fp8_channel``
``modelopt_fp8``    ``P`` E4M3, ``P_scale`` fp32 scalar                            ``fp8_channel`` tensor
``ct_int4``         ``P_packed`` int32 ``[o, i/8]``, ``P_scale`` ``[o, i/32]``,     ``int4_g32``
                    ``P_shape`` int64                                          (``ct_int4_g128``: 128)
``ct_nvfp4``        ``P_packed`` uint8 ``[o, i/2]``, ``P_scale`` E4M3 ``[o, i/16]``,  ``nvfp4``
                    ``P_global_scale`` fp32 ``[1]``                              compressed_tensors
``modelopt_nvfp4``  ``P`` uint8, ``P_scale`` E4M3, ``P_scale_2`` fp32               ``nvfp4`` modelopt
=================  =========================================================  ====================

(3-D expert stacks ``[E, out, in]``: every stored tensor gets a leading ``E``.)

The format is a manifest field (``weights_format``, covered by the manifest digest and signature):
a receiver refuses a version in another format than the one it expects. After decoding a version the
receiver checks the serving tensors' structure (:func:`check_serving_tensors`): every code tensor
has its scales, dtypes and shapes fit each other, scales are finite — before anything is committed.
"""
from __future__ import annotations

import fnmatch
import re
from typing import Any, Callable, Iterable, Mapping

from skyrl_numerics.errors import InputError

NATIVE = "native"
#: serving formats the publisher can write (the names of ``quant.checkpoint.FORMATS``)
SERVING_FORMATS = ("deepseek_fp8", "ct_fp8_block", "ct_fp8_channel", "modelopt_fp8", "ct_int4",
                   "ct_int4_g128", "ct_nvfp4", "modelopt_nvfp4")
WEIGHTS_FORMATS = (NATIVE,) + SERVING_FORMATS

#: names never quantized by default: embeddings, the LM head, norms, MoE routers
DEFAULT_SKIP = re.compile(r"(embed|lm_head|norm|\.mlp\.gate\.weight$|\.gate\.weight$|router|"
                          r"shared_expert_gate|e_score_correction_bias)")


def check_format(fmt: Any, field: str = "weights_format") -> str:
    if not isinstance(fmt, str) or fmt not in WEIGHTS_FORMATS:
        raise InputError(f"weights_format {fmt!r} is not one of {', '.join(WEIGHTS_FORMATS)}", field=field)
    return fmt


def default_selector(name: str, t) -> bool:
    """Linear projection weights: 2-D floating ``*.weight`` tensors and 3-D fused expert stacks,
    except embeddings, the LM head, norms and routers (what serving checkpoints quantize)."""
    if not t.is_floating_point() or DEFAULT_SKIP.search(name):
        return False
    return (t.dim() == 2 and name.endswith(".weight")) or (t.dim() == 3 and ".experts." in name)


def make_selector(quantize: Callable[[str], bool] | Iterable[str] | None) -> Callable[[str, Any], bool]:
    """``quantize``: ``None`` (:func:`default_selector`), a predicate on the name, or fnmatch
    patterns (a weight is quantized when it matches one; non-floating tensors never are)."""
    if quantize is None:
        return default_selector
    if callable(quantize):
        return lambda name, t: t.is_floating_point() and t.dim() in (2, 3) and bool(quantize(name))
    pats = list(quantize)
    if not all(isinstance(p, str) for p in pats):
        raise InputError(f"quantize patterns must be strings, got {pats!r}", field="quantize")
    return lambda name, t: (t.is_floating_point() and t.dim() in (2, 3)
                            and any(fnmatch.fnmatchcase(name, p) for p in pats))


#: projections serving fuses into one GEMM (vLLM's qkv_proj / gate_up_proj / fused_qkv_a_proj)
_FUSED = re.compile(r"^(?P<pre>.*\.)(?:(?P<qkv>q|k|v)_proj|(?P<gu>gate|up)_proj|"
                    r"(?P<mla>q_a_proj|kv_a_proj_with_mqa))(?:\.weight)?$")   # 3-D stacks: no .weight


def fused_group(name: str) -> str | None:
    """The fusion group of a weight name (``<prefix>qkv``, ``<prefix>gate_up``, ``<prefix>qkv_a``)
    or None. NVFP4 writers give every member of a group one per-tensor global, computed from the
    group's amax (modelopt ``preprocess_linear_fusion``: max of the members' amax; llm-compressor
    updates fused layers' global scales the same way), because the fused GEMM has one."""
    m = _FUSED.match(name)
    if m is None:
        return None
    kind = "qkv" if m["qkv"] else "gate_up" if m["gu"] else "qkv_a"
    return m["pre"] + kind


def _group_amax(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """``{name: amax}`` shared within each fusion group (max over the members; per expert for
    3-D stacks); a group whose members are not all 2-D or all stacks of one expert count is left
    alone (each member its own global)."""
    import torch

    groups: dict[str, list[str]] = {}
    for n in names:
        g = fused_group(n)
        if g is not None:
            groups.setdefault(g, []).append(n)
    out = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        if len({(state[n].dim(), state[n].shape[0] if state[n].dim() == 3 else 0)
                for n in members}) != 1:
            continue      # a 2-D and a 3-D member, or stacks of other expert counts
        amax = None
        for n in members:
            t = state[n].detach().float().abs()
            a = t.amax() if t.dim() == 2 else t.flatten(1).amax(1)
            amax = a if amax is None else torch.maximum(amax, a)
        out.update({n: amax for n in members})
    return out


def serving_state(state: Mapping[str, Any], fmt: str, select: Callable[[str, Any], bool] = default_selector
                  ) -> tuple[dict[str, Any], list[str]]:
    """``(tensors, quantized_names)``: ``state`` with each selected weight replaced by its serving
    tensors in ``fmt`` (bitwise what ``quant.quantize`` gives for the format's recipe). NVFP4:
    the members of a fusion group (:func:`fused_group`) share one global, from the group's amax
    (``quantize(w, "nvfp4", global_amax=max amax)``)."""
    import torch

    from skyrl_numerics.quant.checkpoint import quantize_weight_tensors

    check_format(fmt)
    if fmt == NATIVE:
        return dict(state), []
    out: dict[str, Any] = {}
    done: list[str] = []
    shared = {}
    if fmt in ("ct_nvfp4", "modelopt_nvfp4"):
        picked = [n for n, t in state.items() if isinstance(t, torch.Tensor) and select(n, t)
                  and bool(torch.isfinite(t).all())]
        shared = _group_amax(state, picked)
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"expected a torch.Tensor, got {type(t).__name__}", field=name)
        if not select(name, t):
            out[name] = t
            continue
        if t.dim() == 2 and not name.endswith(".weight"):
            raise InputError(f"tensor {name!r}: a 2-D weight to quantize must be named '*.weight'", field=name)
        if not bool(torch.isfinite(t).all()):
            idx = int((~torch.isfinite(t)).flatten().nonzero()[0])
            raise InputError(f"tensor {name!r}: non-finite weight at flat index {idx}: its {fmt} scales "
                             "would not be finite", field=name, index=idx)
        try:
            q = quantize_weight_tensors(name, t.detach().cpu().contiguous(), fmt, shared.get(name))
        except InputError as e:
            raise InputError(f"tensor {name!r} in {fmt}: {e.message}", field=name) from None
        except (ValueError, RuntimeError) as e:
            raise InputError(f"tensor {name!r} with shape {list(t.shape)} cannot be stored as {fmt}: {e}",
                             field=name) from None
        for k, v in q.items():
            if k in state and k != name:
                raise InputError(f"tensor {name!r}: its {fmt} tensor {k!r} clashes with a state tensor",
                                 field=k)
            out[k] = v.contiguous()
        done.append(name)
    if not done:
        raise InputError(f"weights_format {fmt!r}: no tensor of the state was selected for quantization",
                         field="quantize")
    return out, done


# ---- receiver-side structure check ---------------------------------------------------------------
def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _finite_positive(name: str, field_name: str, t) -> None:
    import torch

    v = t.float()
    bad = ~torch.isfinite(v) | (v < 0)
    if bool(bad.any()):
        idx = int(bad.flatten().nonzero()[0])
        raise InputError(f"tensor {name!r}: scale value {float(v.flatten()[idx])} at flat index {idx} is not a "
                         "finite non-negative number", field=field_name, index=idx)


def check_serving_tensors(tensors: Mapping[str, Any], fmt: str, source: str | None = None) -> list[str]:
    """Check the structure of a state in serving format ``fmt``; return the quantized parameter
    names. ``InputError`` naming the tensor (``field``) for: a code tensor without its scales (or
    the reverse), a wrong dtype, packed or scale shapes that do not fit, an ``_shape`` that does not
    match, non-finite or negative scales."""
    import torch

    check_format(fmt)
    if fmt == NATIVE:
        return []

    def bad(name, msg):
        return InputError(f"tensor {name!r} ({fmt}): {msg}", field=name, source=source)

    def want(name, t, dtype, shape=None, what=""):
        if t.dtype != dtype:
            raise bad(name, f"{what}dtype {str(t.dtype).removeprefix('torch.')}, expected "
                            f"{str(dtype).removeprefix('torch.')}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise bad(name, f"{what}shape {list(t.shape)}, expected {list(shape)}")

    e4m3 = torch.float8_e4m3fn
    params: list[str] = []
    if fmt in ("deepseek_fp8", "ct_fp8_block", "ct_fp8_channel", "modelopt_fp8"):
        sfx = "_scale_inv" if fmt == "deepseek_fp8" else "_scale"
        for n, t in tensors.items():
            if t.dtype == e4m3 and n + sfx not in tensors:
                raise bad(n, f"FP8 codes without their scales {n + sfx!r}")
        for n, s in tensors.items():
            if not n.endswith(sfx):
                continue
            p = n[: -len(sfx)]
            c = tensors.get(p)
            if c is None:
                raise bad(n, f"scales without their codes {p!r}")
            if c.dtype != e4m3 or c.dim() not in (2, 3):
                raise bad(p, f"codes must be 2-D or 3-D float8_e4m3fn, got {str(c.dtype).removeprefix('torch.')}"
                             f"{list(c.shape)}")
            lead, (o, i) = tuple(c.shape[:-2]), tuple(c.shape[-2:])
            if fmt in ("deepseek_fp8", "ct_fp8_block"):
                shape = (*lead, _ceil(o, 128), _ceil(i, 128))
            elif fmt == "ct_fp8_channel":
                shape = (*lead, o, 1)
            else:
                shape = lead
            if fmt == "deepseek_fp8" or fmt == "modelopt_fp8":
                want(n, s, torch.float32, shape, "scale ")
            else:
                if not s.is_floating_point() or s.dtype.itemsize < 2:
                    raise bad(n, f"scale dtype {str(s.dtype).removeprefix('torch.')} is not a float type")
                if tuple(s.shape) != shape:
                    raise bad(n, f"scale shape {list(s.shape)}, expected {list(shape)}")
            _finite_positive(p, n, s)
            params.append(p)
    elif fmt in ("ct_int4", "ct_int4_g128"):
        group = 128 if fmt == "ct_int4_g128" else 32
        for n, t in tensors.items():
            if n.endswith("_packed") and (n[:-7] + "_scale" not in tensors or n[:-7] + "_shape" not in tensors):
                raise bad(n, f"packed INT4 codes without {n[:-7] + '_scale'!r} / {n[:-7] + '_shape'!r}")
        for n, t in tensors.items():
            if not n.endswith("_packed"):
                continue
            p = n[:-7]
            s, shp = tensors[p + "_scale"], tensors[p + "_shape"]
            want(p + "_shape", shp, torch.int64, None, "")
            if shp.dim() != 1 or shp.numel() not in (2, 3):
                raise bad(p + "_shape", f"shape {list(shp.shape)}, expected [2] or [3]")
            logical = tuple(int(x) for x in shp.tolist())
            if any(x <= 0 for x in logical):
                raise bad(p + "_shape", f"weight shape {list(logical)} is not positive")
            want(n, t, torch.int32, (*logical[:-1], _ceil(logical[-1], 8)), "packed ")
            if not s.is_floating_point() or s.dtype.itemsize < 2:
                raise bad(p + "_scale", f"scale dtype {str(s.dtype).removeprefix('torch.')} is not a float type")
            if tuple(s.shape) != (*logical[:-1], _ceil(logical[-1], group)):
                raise bad(p + "_scale", f"scale shape {list(s.shape)}, expected "
                                        f"{[*logical[:-1], _ceil(logical[-1], group)]} (group {group})")
            _finite_positive(p, p + "_scale", s)
            params.append(p)
        for n in tensors:
            for sfx in ("_scale", "_shape"):
                if n.endswith(sfx) and n[: -len(sfx)] + "_packed" not in tensors:
                    raise bad(n, f"no packed codes {n[: -len(sfx)] + '_packed'!r}")
    else:  # NVFP4
        ct = fmt == "ct_nvfp4"
        csfx, gsfx = ("_packed", "_global_scale") if ct else ("", "_scale_2")
        for n, g in tensors.items():
            if not n.endswith(gsfx):
                continue
            p = n[: -len(gsfx)]
            codes, s = tensors.get(p + csfx), tensors.get(p + "_scale")
            if codes is None or s is None:
                raise bad(n, f"global scale without {p + csfx!r} / {p + '_scale'!r}")
            if codes.dtype != torch.uint8 or codes.dim() not in (2, 3):
                raise bad(p + csfx, f"packed codes must be 2-D or 3-D uint8, got "
                                    f"{str(codes.dtype).removeprefix('torch.')}{list(codes.shape)}")
            want(p + "_scale", s, e4m3, (*codes.shape[:-1], _ceil(codes.shape[-1] * 2, 16)), "scale ")
            want(n, g, torch.float32, None, "")
            n_glob = codes.shape[0] if codes.dim() == 3 else 1
            if g.numel() != n_glob:
                raise bad(n, f"{g.numel()} global scales, expected {n_glob}")
            _finite_positive(p, p + "_scale", s)
            _finite_positive(p, n, g)
            params.append(p)
        for n, t in tensors.items():
            if n.endswith("_scale") and n[:-6] + gsfx not in tensors and t.dtype == e4m3:
                raise bad(n, f"block scales without {n[:-6] + gsfx!r}")
    return params

