"""Checkpoints written by modelopt's own HF export (``mtq.quantize`` + ``export_hf_checkpoint``, on
CPU) checked with ``qat-check --base``: NVFP4 on a tiny Qwen3-MoE (its fused transformers-5
experts are exported per expert; q/k/v and gate/up share one ``weight_scale_2``) and per-tensor FP8
on a tiny Llama. modelopt is installed ``--no-deps``; its export needs omegaconf, pulp, nvidia-ml-py
and scipy, which the Makefile installs into ``.venv/modelopt-export-deps`` — only the export child
process puts them on its path."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from skyrl_numerics.cli import main
from skyrl_numerics.quant.vendor_check import qat_check_base

DEPS = Path(sys.prefix) / "modelopt-export-deps"
pytestmark = pytest.mark.filterwarnings("ignore")

EXPORT = textwrap.dedent("""
    import sys, warnings, torch
    warnings.filterwarnings("ignore")
    sys.path.insert(0, sys.argv[1])
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from qmodels import tiny_qwen3_moe
    from transformers import LlamaConfig, LlamaForCausalLM
    def export(kind, algo, out, seed):
        seed = int(seed)
        if kind == "moe":
            m, vocab = tiny_qwen3_moe(seed).to(torch.bfloat16), 512
        else:
            torch.manual_seed(seed)
            m, vocab = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                max_position_embeddings=64, tie_word_embeddings=False)).to(torch.bfloat16).eval(), 256
        m.save_pretrained(out + "/base")
        if algo != "none":
            ids = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(0))
            def fwd(model):
                with torch.no_grad():
                    model(ids)
            mtq.quantize(m, getattr(mtq, algo), forward_loop=fwd)
            # dtype given: transformers 5 keeps config.dtype as a string, which export_hf_checkpoint
            # would hand to Tensor.to() ("Invalid device string: 'bfloat16'")
            export_hf_checkpoint(m, dtype=torch.bfloat16, export_dir=out + "/quant")
    for job in sys.argv[2:]:
        export(*job.split(","))
""")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One child process: (kind, modelopt config, seed) -> DIR/base (bf16) and DIR/quant (export)."""
    if not DEPS.is_dir():
        pytest.skip(f"modelopt's export dependencies are not installed in {DEPS} (make venv installs them)")
    pytest.importorskip("modelopt")
    root = tmp_path_factory.mktemp("modelopt")
    jobs = {"moe": ("moe", "NVFP4_DEFAULT_CFG", 0), "llama": ("llama", "FP8_DEFAULT_CFG", 0),
            "moe_seed1": ("moe", "none", 1)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEPS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = subprocess.run([sys.executable, "-c", EXPORT, str(Path(__file__).parents[1]),  # tests/: qmodels.py
                        *(f"{k},{a},{root / n},{s}" for n, (k, a, s) in jobs.items())],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {n: root / n for n in jobs}
    out["moe_seed1"] = out["moe_seed1"] / "base"
    return out


def test_modelopt_nvfp4_moe_export_passes(exported, capsys):
    q = exported["moe"] / "quant"
    h = json.loads((q / "hf_quant_config.json").read_text())["quantization"]
    assert h["quant_algo"] == "NVFP4" and h["group_size"] == 16 and "lm_head" in h["exclude_modules"]
    t = load_file(str(q / "model.safetensors"))
    p = "model.layers.0.self_attn."
    assert t[p + "q_proj.weight"].dtype == torch.uint8 and t[p + "q_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(t[p + "q_proj.weight_scale_2"], t[p + "k_proj.weight_scale_2"])   # one global for qkv
    assert p + "q_proj.input_scale" in t
    rep = qat_check_base(q, exported["moe"] / "base")
    assert rep.ok and rep.scheme == "modelopt_nvfp4" and len(rep.rows) == 2 * (4 + 8 * 3), rep.to_text()
    assert main(["qat-check", str(q), "--base", str(exported["moe"] / "base")]) == 0
    assert "OK, 56 of 56 tensors exact" in capsys.readouterr().out
    assert not qat_check_base(q, exported["moe_seed1"]).ok


def test_modelopt_fp8_export_passes(exported):
    q = exported["llama"] / "quant"
    assert json.loads((q / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    rep = qat_check_base(q, exported["llama"] / "base")
    assert rep.ok and rep.scheme == "modelopt_fp8" and len(rep.rows) == 14, rep.to_text()


@pytest.mark.parametrize("which,key", [("moe", "model.layers.1.mlp.experts.5.up_proj.weight_scale"),
                                       ("moe", "model.layers.0.self_attn.v_proj.weight_scale_2"),
                                       ("llama", "model.layers.1.self_attn.o_proj.weight_scale")])
def test_modelopt_export_edit_fails_naming_the_tensor(exported, tmp_path, which, key, capsys):
    import shutil
    q = tmp_path / "q"
    shutil.copytree(exported[which] / "quant", q)
    t = load_file(str(q / "model.safetensors"))
    s = t[key].clone()
    if s.dtype == torch.float8_e4m3fn:
        b = s.view(torch.uint8)
        b[3, 1] += 1                                   # the next E4M3 value
    else:
        s = (s.view(torch.int32) + 1).view(torch.float32)          # one ulp: a finite edit
    t[key] = s
    save_file(t, str(q / "model.safetensors"))
    name = key[: key.rindex(".weight") + len(".weight")]
    rc = main(["qat-check", str(q), "--base", str(exported[which] / "base")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith(f"first mismatching tensor: {name} ") and "1 of" in last, last
