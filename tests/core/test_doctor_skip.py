"""Which doctor rows apply to which checkpoint (no engine): skip reasons name the cause."""
from __future__ import annotations

import pytest

from skyrl_numerics import doctor
from skyrl_numerics.doctor import ROWS, DoctorContext, skip_reason
from skyrl_numerics.models import build_tiny_model

pytest.importorskip("vllm")  # inspect_checkpoint reads vLLM's model registry (no engine)


def _ctx(path, family=None):
    from skyrl_numerics.model_check import inspect_checkpoint

    info = inspect_checkpoint(path, count_params=False)
    return DoctorContext(model_dir=info.path, family=family or info.model_type, info=info)


def _reasons(ctx):
    return {r.name: skip_reason(r, ctx) for r in ROWS if r.default}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = tmp_path_factory.mktemp("dense") / "llama"
    cfg = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def test_dense_model_skips_moe_rows(dense_dir):
    why = _reasons(_ctx(dense_dir))
    assert why["baseline: HF trainer, bf16"] is None and why["HF trainer, fp32 weights"] is None
    assert why["top-p 0.95 only: + support replay"] is None
    assert why["top-p/top-k: + support replay"] is None
    for name in ("+ R3 (router replay)", "top-p/top-k: + support replay + R3",
                 "top-p 0.95 only: + support replay + R3"):
        assert why[name].startswith("dense model: no MoE router"), (name, why[name])
    assert why["nvfp4 experts: + fake-quant matched"].startswith("dense model")
    assert "no batch-invariant family" in why["+ batch-invariant (trainer and vLLM)"]
    assert "LlamaForCausalLM" in why["+ batch-invariant (trainer and vLLM)"]


def test_tiny_qwen3_moe_runs_every_generic_row(qwen_moe_dir):
    why = _reasons(_ctx(qwen_moe_dir))
    generic = [r.name for r in ROWS if r.default and r.families == doctor._GENERIC_FAMILIES]
    assert generic and all(why[n] is None for n in generic), {n: why[n] for n in generic if why[n]}


def test_mixtral_skips_invariant_and_fake_quant_serving():
    why = _reasons(_ctx(build_tiny_model("mixtral")))
    assert why["+ R3 (router replay)"] is None  # MixtralTopKRouter has a replay
    assert "no per-expert weights named *.mlp.experts" in why["int4 experts: plain bf16 trainer"]
    assert "MixtralForCausalLM" in why["+ batch-invariant (trainer and vLLM)"]


def test_family_specific_rows_name_their_family(qwen_moe_dir):
    ctx = _ctx(qwen_moe_dir)
    specific = [r for r in ROWS if "deepseek_v3" in r.families and "qwen3_moe" not in r.families
                and not r.scenario.startswith("batch-invariant")]
    assert specific, "expected DeepSeek-only rows"
    assert all(skip_reason(r, ctx) == "a row for deepseek_v3 only" for r in specific)
