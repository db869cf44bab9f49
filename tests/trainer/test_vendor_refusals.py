"""A vendor-quantized checkpoint with one field of its quantization config corrupted, or one scale
tensor of the wrong shape, is refused with the project's InputError naming the field or the
tensor — never served as other numbers. Each corruption changes what the config says is stored
or how it is served; a config edited into another *valid* scheme whose activations are dynamic
(no stored tensor tells) is out of reach of any reader and is not among them."""
from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vendor_ckpts as V
from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import family_class, from_checkpoint
from skyrl_numerics.invariant.base import iter_checkpoint_tensors

pytestmark = pytest.mark.filterwarnings("ignore")
_N = itertools.count()

W = ("config_groups", "group_0", "weights")
G = ("config_groups", "group_0")
CT = [(("quant_method",), v) for v in ("gptq", "compressed_tensors", None, 7, "fp8", "modelopt")] + \
    [(("format",), v) for v in ("float-quantized", "nvfp4-pack-quantized", "naive-quantized", 5)] + \
    [(("quantization_status",), v) for v in ("frozen", "initialized", None)] + \
    [(W + ("num_bits",), v) for v in (8, 2, "4", True, 4.0)] + \
    [(W + ("type",), v) for v in ("float", "uint", None)] + \
    [(W + ("symmetric",), v) for v in (False, "true", None)] + \
    [(W + ("strategy",), v) for v in ("channel", "tensor", "block", "token", "tensor_group", None)] + \
    [(W + ("group_size",), v) for v in (16, 64, 128, 0, -32, 33, "32", None)] + \
    [(W + ("dynamic",), v) for v in (True, "local")] + \
    [(W + ("actorder",), v) for v in ("group", "weight", True)] + \
    [(W + ("observer",), v) for v in ("mse", 3)] + \
    [(W + ("block_structure",), [128, 128]), (W + ("scale_dtype",), "torch.float8_e4m3fn"),
     (W + ("scale_dtype",), "int8"), (W + ("zp_dtype",), "torch.int8"), (W + ("foo",), 1)] + \
    [(G + ("targets",), v) for v in ([], "Linear", ["Embedding"], [r"re:.*self_attn.*"])] + \
    [(G + ("input_activations",), v) for v in (
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"},
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}, "fp8")] + \
    [(G + ("output_activations",), {"num_bits": 8, "type": "float"}), (G + ("format",), "float-quantized"),
     (G + ("weights",), None), (G + ("bar",), 1)] + \
    [(("ignore", "+"), v) for v in ("model.layers.0.self_attn.q_proj", r"re:.*experts.*", "Linear")] + \
    [(("ignore",), "lm_head"), (("kv_cache_scheme",), {"num_bits": 8, "type": "float", "strategy": "tensor"}),
     (("sparsity_config",), {"format": "sparse-bitmask"}), (("transform_config",), {"config_groups": {}}),
     (("foo",), 1), (("config_groups",), {}), (("config_groups",), None)]

MO = [(("quant_algo",), v) for v in ("FP8", "W4A16_NVFP4", "NVFP4_AWQ", "nvfp4", None)] + \
    [(("quant_method",), v) for v in ("modelopt_fp4", None)] + \
    [(("ignore", "+"), v) for v in ("model.layers.0.self_attn.q_proj", "*experts*", "model.layers.1.mlp.experts.3")] + \
    [(G + ("weights", "num_bits"), 8), (G + ("weights", "group_size"), 32), (G + ("weights", "type"), "int"),
     (G + ("weights", "dynamic"), True), (G + ("input_activations",), None),
     (G + ("input_activations", "num_bits"), 8), (G + ("targets",), ["Embedding"]),
     (("kv_cache_scheme",), {"num_bits": 8, "type": "float"}), (("kv_cache_quant_algo",), "FP8"),
     (("group_size",), 32), (("foo",), 1)]
HF = [(("quantization", "quant_algo"), v) for v in ("FP8", "W4A16_NVFP4", "MXFP8")] + \
    [(("quantization", "group_size"), 32), (("quantization", "kv_cache_quant_algo"), "FP8"),
     (("quantization", "exclude_modules", "+"), "model.layers.0.self_attn.o_proj"), (("quantization", "x"), 1),
     (("quantization",), [])]
DS = [(("fmt",), v) for v in ("e5m2", None, 3)] + \
    [(("activation_scheme",), v) for v in ("static", "tensor", None)] + \
    [(("weight_block_size",), v) for v in ([64, 64], [128], [128, 128, 1], None, "128", [128, 64])] + \
    [(("modules_to_not_convert",), v) for v in (["model.layers.1.mlp.experts"], "x")] + \
    [(("scale_fmt",), "ue8m0"), (("quant_method",), "fp8_block")]
CASES = [("ct", p, v) for p, v in CT] + [("modelopt", p, v) for p, v in MO] + \
    [("modelopt_hf", p, v) for p, v in HF] + [("ds", p, v) for p, v in DS]


@pytest.fixture(scope="module")
def bases(tmp_path_factory, qwen_moe_dir):
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.engine.serving_checkpoint import write_int4_checkpoint

    root = tmp_path_factory.mktemp("vendor_bad")
    ds = build_tiny_model("deepseek_v3", q_lora_rank=128, moe_intermediate_size=128)
    out = {"ct": write_int4_checkpoint(qwen_moe_dir, experts=True, out_dir=root / "int4e"),
           "ds": V.ours(ds, root / "dsfp8", "deepseek_fp8"), "root": root}
    mo = V.modelopt_export(root, algos=("NVFP4_DEFAULT_CFG",))
    if mo is not None:
        out["modelopt"] = out["modelopt_hf"] = mo["NVFP4_DEFAULT_CFG"]
    return out


def _mutate(obj, path, value):
    obj = copy.deepcopy(obj)
    cur = obj
    for k in path[:-1]:
        if path[-1] == "+" and k == path[-2]:
            break
        cur = cur[k]
    if path[-1] == "+":
        cur[path[-2]] = list(cur[path[-2]]) + [value]
    else:
        cur[path[-1]] = value
    return obj


def _keys_of(obj) -> set:
    if isinstance(obj, dict):
        return set(obj) | set().union(*(_keys_of(v) for v in obj.values())) if obj else set()
    if isinstance(obj, list):
        return set().union(*(_keys_of(v) for v in obj)) if obj else set()
    return set()


def _refused(d, fields: set) -> InputError:
    with pytest.raises(InputError) as e:
        from_checkpoint(d)
    f = e.value.field
    assert f is not None and (f in fields or f.startswith(("model.", "formats."))), (f, str(e.value))
    return e.value


def _engine_refuses(d) -> None:
    """The engine refuses the same checkpoint: before it starts, or in its loader (the same code)."""
    from transformers import AutoConfig

    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    hf = json.loads((d / "config.json").read_text())
    try:
        over = engine_overrides(hf, model_dir=d)
    except InputError:
        return
    cfg = AutoConfig.from_pretrained(str(d))
    cfg.update(over)
    with pytest.raises(InputError):
        m = family_class(hf["architectures"][0]).from_config(cfg, numerics=cfg.skyrl_numerics, pack=True)
        m.load_named(iter_checkpoint_tensors(d))


@pytest.mark.parametrize("kind,path,value", CASES,
                         ids=[f"{k}:{'.'.join(map(str, p))}={v!r}"[:80] for k, p, v in CASES])
def test_any_single_config_field_corruption_is_refused_naming_it(bases, kind, path, value):
    if kind not in bases:
        pytest.skip("modelopt's export does not run here")
    d = bases[kind]
    name = "hf_quant_config.json" if kind == "modelopt_hf" else "config.json"
    full = json.loads((d / name).read_text())
    qc = full if kind == "modelopt_hf" else full["quantization_config"]
    bad = _mutate(qc, path, value)
    out = bases["root"] / f"bad{next(_N)}"
    out.mkdir()
    for f in d.iterdir():
        if f.name == name:
            (out / name).write_text(json.dumps(bad if kind == "modelopt_hf" else {**full, "quantization_config": bad}))
        else:
            (out / f.name).symlink_to(f)
    fields = _keys_of(qc) | _keys_of(bad) | {"quantization_config", "exclude_modules", "quant_algo", "quant_method",
                                             "hf_quant_config.json", "config.json"}
    _refused(out, fields)
    _engine_refuses(out)


def _distort(t: torch.Tensor, how: str):
    if t.dtype.itemsize == 1 and t.is_floating_point():        # (cat of float8: via its bytes)
        return _distort(t.view(torch.uint8), how).view(t.dtype)
    if t.dim() == 0 or how == "grow":
        return torch.cat([t.reshape(-1), t.reshape(-1)[:1]]) if t.dim() <= 1 else torch.cat([t, t[:1]], 0)
    if how == "drop_col":
        return t[..., :-1].contiguous() if t.shape[-1] > 1 else torch.cat([t, t], -1)
    if how == "flatten":
        return t.reshape(-1).contiguous() if t.dim() >= 2 and t.shape[0] > 1 else torch.cat([t, t], 0)
    return t.t().contiguous() if t.dim() == 2 and t.shape[0] != t.shape[1] else torch.cat([t, t], 0)


SCALES = ("_scale", "_scale_2", "_scale_inv", "_global_scale", "input_scale", "_shape")


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["ct", "modelopt", "ds"]), pick=st.integers(0, 10 ** 6),
       how=st.sampled_from(["grow", "drop_col", "flatten", "transpose"]))
def test_a_scale_tensor_of_the_wrong_shape_is_refused_naming_it(bases, kind, pick, how):
    if kind not in bases:
        pytest.skip("modelopt's export does not run here")
    d = bases[kind]
    tensors = dict(iter_checkpoint_tensors(d))
    names = sorted(n for n in tensors if n.endswith(SCALES))
    key = names[pick % len(names)]
    bad = _distort(tensors[key], how)
    assert tuple(bad.shape) != tuple(tensors[key].shape)
    out = V.copy_with(d, bases["root"] / f"shape{next(_N)}", tensors={**tensors, key: bad})
    e = _refused(out, set())
    assert e.field == key, (key, str(e))
    _engine_refuses(out)
