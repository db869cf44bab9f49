"""qat-check on corrupted checkpoints (hypothesis): any single-field corruption of a valid
checkpoint's quantization config, or of one of its stored tensors (a scale, a global, ``P_shape``,
the packed codes: a value, its dtype, its shape, or the tensor deleted) is refused (``InputError``,
exit 2, one line, no --json file written) or reported as a mismatch (exit 1) by ``qat-check --base``
— never OK. Without --base, every structural corruption and every non-finite or negative scale is
refused as well (finite scale edits pass there by construction: tests/quant/test_checkpoint.py)."""
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from qmodels import tiny_qwen3_moe

from skyrl_numerics.cli import main
from skyrl_numerics.errors import InputError
from skyrl_numerics.quant import codecs as C
from skyrl_numerics.quant.checkpoint import qat_check, write_quantized_checkpoint
from skyrl_numerics.quant.vendor_check import qat_check_base
from skyrl_numerics.quant.vendor_check.readers import MINMAX_OBSERVERS

FMTS = ["modelopt_nvfp4", "ct_nvfp4", "ct_int4", "ct_fp8_channel", "ct_fp8_block", "modelopt_fp8", "deepseek_fp8"]
SELF = ["modelopt_nvfp4", "ct_nvfp4", "ct_int4"]                # the formats the self-consistency check reads
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])  # capsys: read per call


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A small base (two attention projections and a fused 3-D stack of two experts) and one
    pristine quantized checkpoint per format, each passing ``qat-check --base``."""
    root = tmp_path_factory.mktemp("bad")
    sd = tiny_qwen3_moe(0).to(torch.bfloat16).state_dict()
    base = {k: sd[k].contiguous() for k in ("model.layers.0.self_attn.q_proj.weight",
                                            "model.layers.0.self_attn.k_proj.weight")}
    base["model.layers.0.mlp.experts.down_proj"] = sd["model.layers.0.mlp.experts.down_proj"][:2].contiguous()
    (root / "base").mkdir()
    save_file(base, str(root / "base" / "model.safetensors"))
    (root / "base" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    out = {"base": root / "base"}
    for fmt in FMTS:
        write_quantized_checkpoint(root / "base", root / fmt, fmt, lambda k: True)
        rep = qat_check_base(root / fmt, root / "base")
        assert rep.ok and len(rep.rows) == 4, rep.to_text()
        out[fmt] = root / fmt
    return out


# ------------------------------------------------------------------------------ tensor corruptions
def _next_bits(x: torch.Tensor) -> torch.Tensor:
    iv = {4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[x.element_size()]
    return (x.view(iv) + 1).view(x.dtype) if x.dtype.itemsize > 1 or x.dtype == torch.uint8 else x


@st.composite
def tensor_edit(draw, names):
    """-> (key, how, fn): fn(tensor dict) applies one corruption to tensor ``key``."""
    key = draw(st.sampled_from(names))
    how = draw(st.sampled_from(["value", "dtype", "shape", "delete"]))
    i = draw(st.integers(0, 10**6))
    pick = draw(st.integers(0, 9))

    def fn(t):
        x = t[key]
        if how == "delete":
            del t[key]
            return None
        if how == "dtype":
            opts = [d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
                                torch.uint8, torch.int32, torch.int64) if d != x.dtype
                    and not (key.endswith("_shape") and d == torch.int32)]        # int32 shapes are as good
            d = opts[pick % len(opts)]
            y = x.float().to(d) if d.is_floating_point and x.dtype.is_floating_point else x.to(torch.float32).to(d)
            t[key] = y
            return y
        if how == "shape":
            cands = []
            if x.dim() >= 1 and x.shape[-1] > 1:
                cands.append(x[..., :-1])                                  # one column short: wrong length
            if x.dim() >= 1 and x.shape[0] > 1:
                cands.append(x[1:])
            if x.dim() >= 1:
                cands.append(torch.cat([x, x[:1]], 0))
            cands.append(x.unsqueeze(0))
            if x.dim() >= 2:
                cands.append(x.flatten())
                if x.shape[-1] != x.shape[-2]:
                    cands.append(x.transpose(-1, -2))
            y = cands[pick % len(cands)].contiguous()
            scalar = {(), (1,)}
            assume(not (tuple(x.shape) in scalar and tuple(y.shape) in scalar))   # () and (1,): one scale
            t[key] = y
            return y
        y = x.clone()
        flat = y.view(-1)
        j = i % flat.numel()
        if y.dtype in (torch.uint8, torch.float8_e4m3fn):
            b = flat.view(torch.uint8)
            b[j] = (int(b[j]) + 1 + pick * 37 % 255) % 256
        elif y.dtype in (torch.int32, torch.int64):
            flat[j] = [flat[j] + 1, flat[j] - 1, 0, -1, flat[j] * 2, flat[j] ^ 0x10, 7, 1 << 20, flat[j] + 8,
                       -flat[j]][pick]
        else:
            v = float(flat[j])
            new = [math.nan, math.inf, -math.inf, 0.0, -v, v * 2, v * 0.5, None, 1e30, 1e-30][pick]
            if new is None:
                flat[j:j + 1] = _next_bits(flat[j:j + 1].clone())
            else:
                flat[j] = new
        t[key] = y
        return y

    return key, how, fn


def _apply(src: Path, dst: Path, fn):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(str(f))
    old = {k: v.clone() for k, v in t.items()}
    fn(t)
    changed = set(old) != set(t) or any(
        old[k].dtype != t[k].dtype or old[k].shape != t[k].shape or not torch.equal(
            old[k].view(torch.uint8) if old[k].dtype.itemsize == 1 else old[k], t[k].view(torch.uint8)
            if t[k].dtype.itemsize == 1 else t[k]) for k in t)
    assume(changed)
    save_file(t, str(f))


def _refused_or_mismatch(qdir, base, json_path, capsys):
    """Run the CLI: exit 1 (a mismatch, --json written) or 2 (one line, no --json file)."""
    rc = main(["qat-check", str(qdir), *(["--base", str(base)] if base else []), "--json", str(json_path)])
    cap = capsys.readouterr()
    assert rc in (1, 2), cap.out
    if rc == 2:
        assert len(cap.err.strip().splitlines()) == 1 and cap.err.startswith("error: ") and not json_path.exists()
        assert not json_path.parent.exists() or not list(json_path.parent.iterdir())       # no temp left
    else:
        assert not json.loads(json_path.read_text())["ok"]
    return rc


def _names(d):
    return sorted(load_file(str(d / "model.safetensors")))


@pytest.mark.parametrize("fmt", FMTS)
@SETTINGS
@given(data=st.data())
def test_base_check_never_ok_on_a_corrupted_tensor(ckpts, fmt, data, capsys):
    key, how, fn = data.draw(tensor_edit(_names(ckpts[fmt])))
    with tempfile.TemporaryDirectory() as tmp:
        q = Path(tmp) / "q"
        _apply(ckpts[fmt], q, fn)
        _refused_or_mismatch(q, ckpts["base"], Path(tmp) / "out" / "r.json", capsys)


@pytest.mark.parametrize("fmt", SELF)
@SETTINGS
@given(data=st.data())
def test_self_check_refuses_structural_corruption(ckpts, fmt, data, capsys):
    key, how, fn = data.draw(tensor_edit(_names(ckpts[fmt])))
    with tempfile.TemporaryDirectory() as tmp:
        q = Path(tmp) / "q"
        holder = {}

        def fn2(t):
            holder["y"] = fn(t)
        _apply(ckpts[fmt], q, fn2)
        y = holder["y"]
        if how == "value":           # finite edits keep dequantize -> re-encode a fixed point: only
            vals = C.decode(y.view(torch.uint8), C.E4M3) if y.dtype == torch.float8_e4m3fn else y.float()
            assume(key.endswith("_shape") or (key.endswith(("_scale", "_scale_2", "_global_scale")) and   # these
                   bool((~torch.isfinite(vals)).any() or torch.signbit(vals).any())))                   # count
        if how == "dtype" and fmt == "ct_int4" and key.endswith("_scale"):    # INT4 group scales may be any of
            assume(y.dtype not in (torch.float32, torch.bfloat16, torch.float16))  # these (the observer dtype)
        try:
            rep = qat_check(q)
        except InputError as e:
            assert len(str(e).splitlines()) == 1
            return
        assert not rep.ok, (key, how, rep.to_text())


# ------------------------------------------------------------------------------ config corruptions
POOL = [None, True, False, 0, 1, -1, 2, 3, 4, 7, 8, 16, 31, 33, 64, 100, 2.5, "", "int", "float", "group",
        "channel", "tensor", "block", "tensor_group", "token", "pack-quantized", "float-quantized",
        "nvfp4-pack-quantized", "naive-quantized", "mxfp4-pack-quantized", "dense", "mse", "minmax",
        "torch.float32", "torch.bfloat16", "torch.float8_e4m3fn", "e5m2", "NVFP4", "FP8", "W4A16_AWQ",
        "compressed-tensors", "modelopt", "fp8", "frozen", [], [64, 64], [32, 128], [128], [128, 64], [16, 16], {},
        {"x": 1}]
CT_W = ["num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
        "observer", "scale_dtype", "zp_dtype", "observer_kwargs", "bogus_field"]


def _paths(qc):
    if qc["quant_method"] == "compressed-tensors":
        return ([("config_groups", "group_0", "weights", k) for k in CT_W] + [("config_groups", "group_0", "format"),
                ("quant_method",), ("format",), ("quantization_status",), ("config_groups", "group_0", "targets"),
                ("ignore",)])
    if qc["quant_method"] == "modelopt":
        return [("quant_method",), ("quant_algo",), ("group_size",)]
    return [("quant_method",), ("weight_block_size",), ("fmt",)]


def _equivalent(qc, path, new, scale_dtype) -> bool:
    """The corruption does not change what the config means for the stored bits (defaults)."""
    k = path[-1]
    grp = qc.get("config_groups", {}).get("group_0", {})
    fp8 = grp.get("weights", {}).get("num_bits") == 8
    return ((k == "observer" and new in MINMAX_OBSERVERS) or (k == "dynamic" and new in (False, None))
            or (k == "actorder" and new in (None, False)) or (k in ("zp_dtype",) and new is None)
            or (k == "scale_dtype" and new in (None, scale_dtype)) or (k == "symmetric" and new is True)
            or (k == "observer_kwargs" and new in ({}, None))
            or (k == "format" and fp8 and new in ("float-quantized", "naive-quantized"))
            or (path == ("format",) and "format" in grp)
            # a group without its own format takes the global one: setting it to that is no change
            or (k == "format" and len(path) > 1 and "format" not in grp and new == qc.get("format"))
            or (path[-1] == "format" and len(path) > 1 and new is None and qc.get("format") == grp.get("format",
                                                                                                   qc.get("format"))) or (k == "quantization_status" and new == "compressed")
            or (k == "block_structure" and new is None and grp.get("weights", {}).get("strategy") != "block")
            or (k == "group_size" and new is None and fp8) or (k == "group_size" and new == 16 and "quant_algo" in qc)
            or (k == "fmt" and new == "e4m3") or (k == "targets" and new == ["Linear"])
            or (path == ("ignore",) and new in (None, []) and not qc.get("ignore")))


@pytest.mark.parametrize("fmt", FMTS)
@SETTINGS
@given(data=st.data())
def test_base_check_never_ok_on_a_corrupted_config(ckpts, fmt, data, capsys):
    cfg = json.loads((ckpts[fmt] / "config.json").read_text())
    qc = cfg["quantization_config"]
    path = data.draw(st.sampled_from(_paths(qc)))
    delete = data.draw(st.booleans()) and path[-1] in ("num_bits", "type", "strategy", "group_size", "quant_method",
                                                        "quant_algo", "weight_block_size", "targets") \
        and not (path == ("group_size",) and "quant_algo" in qc)           # modelopt: absent means 16
    node = qc
    for p in path[:-1]:
        node = node[p]
    old = node.get(path[-1], "<absent>")
    new = "<absent>" if delete else data.draw(st.sampled_from(POOL))
    assume(new != old and not (old == "<absent>" and new is None))
    sd = {"ct_int4": "torch.bfloat16", "ct_fp8_channel": "torch.bfloat16", "ct_fp8_block": "torch.bfloat16",
          "ct_nvfp4": "torch.float8_e4m3fn"}.get(fmt)
    assume(delete or not _equivalent(qc, path, new, sd))
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = new
    with tempfile.TemporaryDirectory() as tmp:
        q = Path(tmp) / "q"
        shutil.copytree(ckpts[fmt], q)
        (q / "config.json").write_text(json.dumps(cfg))
        _refused_or_mismatch(q, ckpts["base"], Path(tmp) / "out" / "r.json", capsys)


# ------------------------------------------------------------------------------ named cases
def _edit(src, dst, fn):
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    fn(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


Q = "model.layers.0.self_attn.q_proj.weight"
CASES = [
    ("ct_int4", lambda t: t.update({Q + "_packed": t[Q + "_packed"][:, :-1].contiguous()}), Q + "_packed", "shape"),
    ("ct_nvfp4", lambda t: t.update({Q + "_scale": t[Q + "_scale"].float()}), Q + "_scale", "float8_e4m3fn"),
    ("modelopt_nvfp4", lambda t: t.pop(Q + "_scale_2"), Q + "_scale_2", "missing"),
    ("ct_nvfp4", lambda t: t.update({Q + "_global_scale": torch.tensor([1.0, 2.0])}), Q + "_global_scale", "shape"),
    ("ct_nvfp4", lambda t: t.update({Q + "_global_scale": torch.tensor([math.nan])}), Q + "_global_scale",
     "non-finite"),
    ("ct_int4", lambda t: t.update({Q + "_shape": torch.tensor([128, 120])}), Q + "_packed", "weight_shape"),
    ("ct_fp8_block", lambda t: t.update({Q + "_scale": t[Q + "_scale"].reshape(1)}), Q + "_scale", "shape"),
    ("deepseek_fp8", lambda t: t.update({Q + "_scale_inv": t[Q + "_scale_inv"].to(torch.bfloat16)}),
     Q + "_scale_inv", "float32"),
    ("modelopt_fp8", lambda t: t.pop(Q + "_scale"), Q + "_scale", "missing"),
    ("ct_fp8_channel", lambda t: t.update({Q + "_scale": t[Q + "_scale"] * math.inf}), Q + "_scale", "non-finite"),
]


@pytest.mark.parametrize("fmt,fn,field,words", CASES, ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_named_bad_tensor_is_refused_naming_it(ckpts, tmp_path, fmt, fn, field, words, capsys):
    q = _edit(ckpts[fmt], tmp_path / "q", fn)
    with pytest.raises(InputError, match=words) as ei:
        qat_check_base(q, ckpts["base"])
    assert ei.value.field == field and ei.value.source == "model.safetensors", str(ei.value)
    assert _refused_or_mismatch(q, ckpts["base"], tmp_path / "out" / "r.json", capsys) == 2


@pytest.mark.parametrize("pattern", ["model.layers.0.self_attn.q_proj", "model.layers.*.self_attn.*",
                                     "self_attn.k_proj", "model.layers.0"])
def test_modelopt_excluded_module_stored_quantized_exit_2(ckpts, tmp_path, pattern):
    """vLLM's is_layer_excluded (name, substring, fnmatch wildcard) would load it unquantized."""
    d = tmp_path / "q"
    shutil.copytree(ckpts["modelopt_nvfp4"], d)
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", pattern]}}))
    with pytest.raises(InputError, match="exclude_modules") as ei:
        qat_check_base(d, ckpts["base"])
    assert ei.value.field == "exclude_modules" and repr(pattern) in str(ei.value)
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "model.layers.0.mlp.gate"]}}))
    assert qat_check_base(d, ckpts["base"]).ok


def test_base_tensor_missing_or_other_shape(ckpts, tmp_path):
    b = _edit(ckpts["base"], tmp_path / "b", lambda t: t.pop(Q))
    with pytest.raises(InputError, match="missing from the base") as ei:
        qat_check_base(ckpts["ct_int4"], b)
    assert ei.value.field == Q
    b2 = _edit(ckpts["base"], tmp_path / "b2", lambda t: t.update({Q: t[Q][:, :64].contiguous()}))
    with pytest.raises(InputError, match=r"has shape \(128, 64\)") as ei:
        qat_check_base(ckpts["ct_nvfp4"], b2)
    assert ei.value.field == Q


@pytest.mark.parametrize("fmt", ["ct_int4", "modelopt_nvfp4", "deepseek_fp8"])
def test_non_finite_base_weight_is_refused_naming_it(ckpts, tmp_path, fmt):
    def nan(t):
        w = t[Q].clone()
        w[3, 7] = math.nan
        t[Q] = w
    b = _edit(ckpts["base"], tmp_path / "b", nan)
    with pytest.raises(InputError, match="must be finite") as ei:
        qat_check_base(ckpts[fmt], b)
    assert ei.value.field == Q and ei.value.index == 3 * 128 + 7


def test_json_is_written_atomically_and_refused_paths(ckpts, tmp_path, capsys):
    assert main(["qat-check", str(ckpts["ct_int4"]), "--base", str(ckpts["base"]), "--json", str(tmp_path)]) == 2
    assert "--json" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main(["qat-check", str(ckpts["ct_int4"]), "--base", str(ckpts["base"]), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ok"] and [p.name for p in tmp_path.iterdir()] == ["r.json"]
