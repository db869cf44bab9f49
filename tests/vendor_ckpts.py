"""Tiny vendor-quantized checkpoints for the vendor-plan tests, each written by a vendor's own
writer where one runs on CPU here:

* ``modelopt_export``: nvidia-modelopt 0.47's ``mtq.quantize`` + ``export_hf_checkpoint`` (NVFP4
  W4A4 and FP8 W8A8, static input scales) on transformers' tiny Qwen3-MoE, in a child process
  (its export dependencies live in ``.venv/modelopt-export-deps``, as in test_modelopt_export.py);
* ``ct_compressor``: compressed-tensors 0.17's qparams + ``ModelCompressor`` (INT4 g32 and NVFP4
  on the attention projections; the fused bf16 experts saved per expert, the invariant layout);
* ``ours``: the project's ``write_quantized_checkpoint`` (INT4 / NVFP4 / FP8 layouts checked
  bitwise against compressed-tensors' and modelopt's functions in tests/quant).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent      # qmodels.py, for modelopt's export child
DEPS = Path(sys.prefix) / "modelopt-export-deps"

EXPORT = textwrap.dedent("""
    import sys, warnings, torch
    warnings.filterwarnings("ignore")
    sys.path.insert(0, sys.argv[1])
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from qmodels import tiny_qwen3_moe
    for job in sys.argv[2:]:
        algo, out = job.split(",")
        m = tiny_qwen3_moe(0).to(torch.bfloat16)
        m.save_pretrained(out + ".base")                     # the bf16 model it quantizes
        ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(0))
        def fwd(model):
            with torch.no_grad():
                model(ids)
        mtq.quantize(m, getattr(mtq, algo), forward_loop=fwd)
        export_hf_checkpoint(m, dtype=torch.bfloat16, export_dir=out)
""")


def modelopt_export(root: Path, algos=("NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG")) -> dict | None:
    """``{algo: DIR}`` exported by modelopt itself (the bf16 model beside it in ``DIR.base``), or
    None when its export cannot run here."""
    import importlib.util

    if not DEPS.is_dir() or importlib.util.find_spec("modelopt") is None:
        return None
    out = {a: root / a.split("_")[0].lower() for a in algos}
    todo = [a for a, d in out.items() if not (d / "config.json").exists()]
    if todo:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEPS), *filter(None, [os.environ.get("PYTHONPATH")])]))
        with open(root / "modelopt_export.log", "w") as log:
            r = subprocess.run([sys.executable, "-c", EXPORT, str(TESTS), *(f"{a},{out[a]}" for a in todo)],
                               env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
        assert r.returncode == 0, (root / "modelopt_export.log").read_text()[-3000:]
    return out


def _unfuse_experts(state: dict) -> dict:
    """transformers-5 fused ``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` -> the
    per-expert ``experts.{e}.{gate,up,down}_proj.weight`` the invariant models load."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :half].contiguous()
                out[f"{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, half:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def ct_compressor(out: Path, fmt: str) -> Path:
    """compressed-tensors' own writer (qparams from min/max, ``ModelCompressor``): ``fmt`` int4 (W4A16
    g32) or nvfp4 on the attention projections of transformers' tiny Qwen3-MoE."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from qmodels import tiny_qwen3_moe
    from safetensors.torch import save_file

    if (out / "config.json").exists():
        return out
    m = tiny_qwen3_moe(0).to(torch.bfloat16)
    if fmt == "int4":
        args, cfmt = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32), \
            "pack-quantized"
    else:
        args, cfmt = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                                      group_size=16, scale_dtype=torch.float8_e4m3fn), "nvfp4-pack-quantized"
    apply_quantization_config(m, QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=[r"re:.*self_attn\.[qkvo]_proj$"], weights=args)}))
    for _, mod in m.named_modules():
        if not hasattr(mod, "weight_scale"):
            continue
        w = mod.weight.data
        g = w.reshape(w.shape[0], -1, args.group_size)
        G = None
        if fmt == "nvfp4":
            G = generate_gparam(w.amin(), w.amax())
            mod.weight_global_scale.data.copy_(G)
        s, zp = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=G)
        mod.weight_scale.data.copy_(s.to(mod.weight_scale.dtype))
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data.copy_(zp.to(mod.weight_zero_point.dtype))
    comp = ModelCompressor.from_pretrained_model(m, quantization_format=cfmt)
    comp.compress_model(m)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(_unfuse_experts({k: v.contiguous() for k, v in m.state_dict().items()}), str(tmp / "model.safetensors"))
    m.config.to_json_file(str(tmp / "config.json"))
    comp.update_config(str(tmp))
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(cfg))
    tmp.rename(out)
    return out


def planned(name: str) -> bool:
    from skyrl_numerics.invariant.numerics import group_of

    return group_of(name) is not None


def ours(src: Path, out: Path, fmt: str) -> Path:
    """The project's writer: every linear the invariant plan covers stored in ``fmt``."""
    from skyrl_numerics.quant.checkpoint import write_quantized_checkpoint

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    write_quantized_checkpoint(src, tmp, fmt, planned)
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and not (tmp / extra.name).exists():
            shutil.copy2(extra, tmp / extra.name)
    tmp.rename(out)
    return out


def copy_with(src: Path, out: Path, config=None, tensors=None) -> Path:
    """A copy of checkpoint ``src`` with ``config.json`` replaced by ``config`` (a dict) and/or the
    tensors replaced by ``tensors`` (a dict); unchanged safetensors files are linked."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors" and tensors is not None:
            save_file(tensors, str(out / f.name))
        elif f.name == "config.json" and config is not None:
            (out / f.name).write_text(json.dumps(config))
        else:
            os.symlink(f, out / f.name)
    return out
