"""Several compressed-tensors config groups in one checkpoint (INT4 W4A16 experts by ``re:``
targets, FP8 channel on the remaining ``Linear`` modules, an ``ignore`` list), written by
compressed-tensors itself (``QuantizationConfig``, ``apply_quantization_config``,
``calculate_qparams``, ``ModelCompressor``) from a small module tree with per-expert Linear layers,
and checked by ``qat-check --base``. The weight -> group assignment is compared with the schemes
compressed-tensors itself attached to each module."""
import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from skyrl_numerics.cli import main
from skyrl_numerics.errors import InputError
from skyrl_numerics.quant.vendor_check import qat_check_base
from skyrl_numerics.quant.vendor_check.schemes import ct_group_of

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.filterwarnings("ignore")
EXPERTS = r"re:.*mlp\.experts\.\d+\..*"


def _lin(i, o):
    return nn.Linear(i, o, bias=False)


class _Attn(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = _lin(h, h), _lin(h, h // 2), _lin(h, h // 2), _lin(h, h)


class _Expert(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _lin(h, i), _lin(h, i), _lin(i, h)


class _MoE(nn.Module):
    def __init__(self, h, i, e):
        super().__init__()
        self.gate = _lin(h, e)
        self.experts = nn.ModuleList(_Expert(h, i) for _ in range(e))


class _Layer(nn.Module):
    def __init__(self, h, i, e):
        super().__init__()
        self.self_attn, self.mlp = _Attn(h), _MoE(h, i, e)


class _Inner(nn.Module):
    def __init__(self, h, i, e, n):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, h)
        self.layers = nn.ModuleList(_Layer(h, i, e) for _ in range(n))


class TinyMoE(nn.Module):
    """HF-style names (``model.layers.N.mlp.experts.E.gate_proj``) with per-expert Linear layers."""

    def __init__(self, seed=0, h=128, i=64, e=4, n=2):
        super().__init__()
        torch.manual_seed(seed)
        self.model, self.lm_head = _Inner(h, i, e, n), _lin(h, 64)


def _config(groups, ignore):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    mk = {"int4": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
          "int4_g64": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64),
          "fp8": dict(num_bits=8, type="float", symmetric=True, strategy="channel")}
    return QuantizationConfig(config_groups={g: QuantizationScheme(targets=t, weights=QuantizationArgs(**mk[w]))
                                             for g, (t, w) in groups.items()}, ignore=ignore)


MIXED = {"group_0": ([EXPERTS], "int4"), "group_1": (["Linear"], "fp8")}
IGNORE = ["lm_head", r"re:.*mlp\.gate$"]


def _ct_write(out, groups=MIXED, ignore=IGNORE, seed=0):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    m = TinyMoE(seed).to(torch.bfloat16)
    apply_quantization_config(m, _config(groups, ignore))
    for _, mod in m.named_modules():
        if not hasattr(mod, "weight_scale"):
            continue
        args, w = mod.quantization_scheme.weights, mod.weight.data
        if args.strategy == "group":
            g = w.reshape(w.shape[0], -1, args.group_size)
            mn, mx = g.amin(-1), g.amax(-1)
        else:
            mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        s, zp = calculate_qparams(mn, mx, args)
        mod.weight_scale.data.copy_(s.to(mod.weight_scale.dtype))
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data.copy_(zp.to(mod.weight_zero_point.dtype))
    comp = ModelCompressor.from_pretrained_model(m, quantization_format=None)
    comp.compress_model(m)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "tiny_moe"}))
    comp.update_config(str(out))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("groups")
    out = {}
    for seed, name in ((0, "base"), (1, "seed1")):
        (root / name).mkdir()
        sd = TinyMoE(seed).to(torch.bfloat16).state_dict()
        save_file({k: v.contiguous() for k, v in sd.items()}, str(root / name / "model.safetensors"))
    out.update(base=root / "base", seed1=root / "seed1", mixed=_ct_write(root / "mixed"))
    return out


def test_mixed_groups_written_by_compressed_tensors_pass(ckpts, capsys):
    qc = json.loads((ckpts["mixed"] / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2
    rep = qat_check_base(ckpts["mixed"], ckpts["base"])
    assert rep.ok, rep.to_text()
    recipes = {r["name"]: r["recipe"] for r in rep.rows}
    assert len(recipes) == 2 * 4 * 3 + 2 * 4                     # experts INT4, attention FP8
    assert recipes["model.layers.1.mlp.experts.3.down_proj.weight"] == "int4_g32"
    assert recipes["model.layers.0.self_attn.k_proj.weight"] == "fp8_channel"
    assert not [n for n in recipes if "mlp.gate" in n or "lm_head" in n]
    assert "ct_fp8" in rep.scheme and "ct_int4" in rep.scheme
    assert main(["qat-check", str(ckpts["mixed"]), "--base", str(ckpts["base"])]) == 0
    assert "OK, 32 of 32 tensors exact" in capsys.readouterr().out
    assert not qat_check_base(ckpts["mixed"], ckpts["seed1"]).ok


@pytest.mark.parametrize("key", ["model.layers.1.mlp.experts.2.up_proj.weight_scale",
                                 "model.layers.0.self_attn.v_proj.weight_scale"])
def test_mixed_groups_scale_edit_names_the_tensor(ckpts, tmp_path, key, capsys):
    d = tmp_path / "q"
    shutil.copytree(ckpts["mixed"], d)
    t = load_file(str(d / "model.safetensors"))
    s = t[key].clone()
    s[5, 0] = s[5, 0] * 2
    t[key] = s
    save_file(t, str(d / "model.safetensors"))
    rc = main(["qat-check", str(d), "--base", str(ckpts["base"])])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    name = key[: -len("_scale")]
    assert rc == 1 and last.startswith(f"first mismatching tensor: {name} ") and "1 of 32 tensors mismatch" in last


def _with_qc(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_ignore_and_targets_inconsistent_with_the_tensors_exit_2(ckpts, tmp_path, capsys):
    cases = [
        # lm_head stays bf16 but "Linear" now claims it
        (lambda qc: qc["ignore"].remove("lm_head"), "lm_head.weight", "ignore"),
        # the experts are stored INT4 but ignored
        (lambda qc: qc["ignore"].append("re:.*experts.*"), "model.layers.0.mlp.experts.0.down_proj.weight", "ignore"),
        # the INT4 group targets nothing: "Linear" (FP8) claims the packed experts
        (lambda qc: next(g for g in qc["config_groups"].values() if g["weights"]["num_bits"] == 4)
         .update(targets=["re:nothing"]), "model.layers.0.mlp.experts.0.down_proj.weight", None),
    ]
    for i, (edit, name, field) in enumerate(cases):
        d = _with_qc(ckpts["mixed"], tmp_path / f"q{i}", edit)
        with pytest.raises(InputError) as ei:
            qat_check_base(d, ckpts["base"])
        assert name in str(ei.value) and (field is None or ei.value.field == field), str(ei.value)
        assert main(["qat-check", str(d), "--base", str(ckpts["base"])]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and name in err


def test_group_assignment_matches_compressed_tensors():
    """For every Linear module, ``ct_group_of`` picks the group whose scheme compressed-tensors'
    ``apply_quantization_config`` attached (exact names over regexes over class names; a target
    listed by two groups belongs to the later one; ``ignore`` by name, regex or class)."""
    from compressed_tensors.quantization import apply_quantization_config
    groups = {"g_fp8": (["Linear"], "fp8"),
              "g_gu": ([r"re:.*experts\.\d+\.(gate|up)_proj$", "model.layers.1.self_attn.o_proj"], "int4"),
              "g_down": ([r"re:.*down_proj$", "model.layers.1.self_attn.q_proj", r"re:.*experts\.1\.gate_proj$"],
                         "int4_g64"),
              "g_late": (["model.layers.1.self_attn.o_proj"], "int4_g64")}
    ignore = ["lm_head", r"re:.*mlp\.gate$", "model.layers.0.mlp.experts.3.down_proj", "Embedding"]
    cfg = _config(groups, ignore)
    m = TinyMoE(0)
    apply_quantization_config(m, cfg)
    scheme = types.SimpleNamespace(targets=[g.targets for g in cfg.config_groups.values()], ignore=ignore)
    names = list(cfg.config_groups)
    seen = set()
    for name, mod in m.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        gi, _ = ct_group_of(name + ".weight", ("Linear",), scheme)
        theirs = getattr(mod, "quantization_scheme", None)
        ours = None if gi is None else cfg.config_groups[names[gi]]
        assert (theirs is None) == (ours is None), name
        if ours is not None:
            assert theirs.targets == ours.targets and theirs.weights == ours.weights, name
            seen.add(names[gi])
    assert seen == set(names)                     # every rule above decided at least one module


# ---- targets / ignore corruption, judged by compressed-tensors itself ------------------------------
POOL = ["Linear", "Embedding", "re:.*", r"re:.*mlp\.experts\.\d+\..*", r"re:.*mlp\.gate$", "lm_head",
        "model.layers.0.mlp.gate", r"re:.*self_attn\..*", r"re:.*down_proj$", "model.layers.1.self_attn.q_proj",
        r"re:.*experts\.2\..*", "model.layers.0.mlp.experts.1.up_proj", "re:[", r"re:.*\.(q|k)_proj$"]


def _assignment(qc):
    """{Linear module: (targets, weights) | None} as compressed-tensors' apply_quantization_config
    decides it for ``qc``; None when it refuses the config."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    try:
        cfg = QuantizationConfig.model_validate(qc)
        m = TinyMoE(0)
        apply_quantization_config(m, cfg)
    except Exception:                                  # noqa: BLE001 - any refusal by the vendor
        return None
    out = {}
    for name, mod in m.named_modules():
        if isinstance(mod, nn.Linear):
            s = getattr(mod, "quantization_scheme", None)
            out[name] = None if s is None else s.weights.model_dump_json()   # what decides the stored bits
    return out


from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_targets_or_ignore_corruption_is_refused_or_a_mismatch(ckpts, data, capsys):
    """One entry of a group's targets or of ignore replaced, deleted or added: whenever
    compressed-tensors would quantize the modules differently than the checkpoint holds (or
    refuses the config), qat-check refuses it or reports a mismatch; never OK."""
    import copy
    import tempfile
    from pathlib import Path
    cfg = json.loads((ckpts["mixed"] / "config.json").read_text())
    qc = cfg["quantization_config"]
    lists = [("ignore",)] + [("config_groups", g, "targets") for g in qc["config_groups"]]
    where = data.draw(st.sampled_from(lists))
    new = copy.deepcopy(qc)
    node = new
    for p in where[:-1]:
        node = node[p]
    lst = node[where[-1]]
    op = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if op == "add" or not lst:
        lst.insert(data.draw(st.integers(0, len(lst))), data.draw(st.sampled_from(POOL)))
    elif op == "delete":
        del lst[data.draw(st.integers(0, len(lst) - 1))]
    else:
        lst[data.draw(st.integers(0, len(lst) - 1))] = data.draw(st.sampled_from(POOL))
    theirs = _assignment(new)
    assume(theirs != _assignment(qc))                  # a change that compressed-tensors can see
    cfg["quantization_config"] = new
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "q"
        shutil.copytree(ckpts["mixed"], d)
        (d / "config.json").write_text(json.dumps(cfg))
        rc = main(["qat-check", str(d), "--base", str(ckpts["base"])])
        capsys.readouterr()
        assert rc in (1, 2), f"{where} {op}: ignore {new.get('ignore')} targets " \
            f"{[g['targets'] for g in new['config_groups'].values()]}"
