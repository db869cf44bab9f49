"""Which doctor rows apply to which checkpoint (no engine): skip reasons name the cause."""
from __future__ import annotations

import pytest

from skyrl_numerics import doctor
from skyrl_numerics.doctor import ROWS, DoctorContext, skip_reason
from skyrl_numerics.models import build_tiny_model

pytest.importorskip("vllm")  # inspect_checkpoint reads vLLM's model registry (no engine)


def _ctx(path, family=None):
    from skyrl_numerics.doctor.model_check import inspect_checkpoint

    info = inspect_checkpoint(path, count_params=False)
    return DoctorContext(model_dir=info.path, family=family or info.model_type, info=info)


def _reasons(ctx):
    return {r.name: skip_reason(r, ctx) for r in ROWS if r.default}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
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
    # the dense family runs it; its engine is asked for no routes (a dense model has no router)
    assert why["+ batch-invariant (trainer and vLLM)"] is None
    assert "capture_routes" not in doctor.SCENARIOS["batch-invariant"].engine_for(dense_dir)


def test_tiny_qwen3_moe_runs_every_generic_row(qwen_moe_dir):
    why = _reasons(_ctx(qwen_moe_dir))
    generic = [r.name for r in ROWS if r.default and r.families == doctor.GENERIC_FAMILIES]
    assert generic and all(why[n] is None for n in generic), {n: why[n] for n in generic if why[n]}


def test_mixtral_runs_r3_and_invariant_but_skips_fake_quant_serving():
    why = _reasons(_ctx(build_tiny_model("mixtral")))
    assert why["+ R3 (router replay)"] is None  # MixtralTopKRouter has a replay
    assert "no per-expert weights named *.mlp.experts" in why["int4 experts: plain bf16 trainer"]
    assert why["+ batch-invariant (trainer and vLLM)"] is None       # the mixtral family
    assert why["+ batch-invariant, FP8 KV (trainer simulates the cache)"] is None
    # a window shorter than the context: refused before any engine, naming the field
    short = _reasons(_ctx(build_tiny_model("mixtral", sliding_window=256)))
    assert "'sliding_window'" in short["+ batch-invariant (trainer and vLLM)"]


def test_glm4_moe_runs_the_stock_r3_and_invariant_rows():
    """GLM-4.5's router (Glm4MoeTopkRouter) has a replay; the glm4_moe family runs the bitwise
    rows, FP8 KV included (a GQA [K | V] cache row)."""
    why = _reasons(_ctx(build_tiny_model("glm4_moe")))
    for name in ("baseline: HF trainer, bf16", "+ R3 (router replay)",
                 "top-p/top-k: + support replay + R3", "+ batch-invariant (trainer and vLLM)",
                 "+ batch-invariant, FP8 KV (trainer simulates the cache)"):
        assert why[name] is None, (name, why[name])


def test_family_specific_rows_name_their_family(qwen_moe_dir):
    ctx = _ctx(qwen_moe_dir)
    specific = [r for r in ROWS if "deepseek_v3" in r.families and "qwen3_moe" not in r.families
                and not r.scenario.startswith("batch-invariant")]
    assert specific, "expected DeepSeek-only rows"
    assert all(skip_reason(r, ctx) == "a row for deepseek_v3 only" for r in specific)


def test_served_in_place_restores_the_engine_after_a_failed_load(tmp_path, monkeypatch):
    """Fault injection into the weight load: when loading the served weights fails part-way, the
    original weights are loaded back before the error propagates (the shared engine must not
    serve a mix); a successful scenario loads them back on exit. (The engine is a stand-in: only
    the calls are observed; the real engine round trip is tests/e2e/test_doctor.py.)"""
    import torch
    from safetensors.torch import save_file

    from skyrl_numerics import doctor
    from skyrl_numerics.engine import weight_update as sync_vllm

    base, served = tmp_path / "base", tmp_path / "served"
    for d, v in ((base, 1.0), (served, 2.0)):
        d.mkdir()
        save_file({"model.layers.0.mlp.experts.0.up_proj.weight": torch.full((4, 4), v),
                   "model.norm.weight": torch.ones(4)}, str(d / "model.safetensors"))
    calls = []

    def fake_update(engine, tensors, changed):
        calls.append(float(tensors["model.layers.0.mlp.experts.0.up_proj.weight"][0, 0]))
        if len(calls) == 1 and engine == "failing":
            raise RuntimeError("worker died mid-load")
    monkeypatch.setattr(sync_vllm, "update_vllm_weights", fake_update)
    sip = doctor.ServedInPlace("failing", base, served)
    assert sip.changed == ["model.layers.0.mlp.experts.0.up_proj.weight"]
    with pytest.raises(RuntimeError, match="mid-load"):
        with sip:
            pass
    assert calls == [2.0, 1.0]
    calls.clear()
    with doctor.ServedInPlace("ok", base, served):
        assert calls == [2.0]
    assert calls == [2.0, 1.0]


def test_multi_turn_scenarios_size_the_cache_for_every_turn():
    """A multi-turn scenario's longest sequence: the prompt, every turn, the observations between."""
    from skyrl_numerics.doctor.rows import SCENARIOS
    from skyrl_numerics.engine.multiturn import KeyValueEnv

    sc = SCENARIOS["multi-turn tool use"]
    env = KeyValueEnv()
    env.reset([1, 2, 3])
    obs = len(env.step([0]).observation)                 # the tool's reply to a known key
    assert sc.max_seq_len(16, 8) == 16 + sc.turns * 8 + (sc.turns - 1) * obs
    assert SCENARIOS["full"].max_seq_len(16, 8) == 24
