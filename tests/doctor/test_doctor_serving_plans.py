"""The doctor's quantized-serving scenarios (W4A4 / W8A8, no engine): the plan each builds for a
model, how the engine and trainer copies are planned, and that the "fake-quant matched" trainer
holds the engine's weight grid exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from skyrl_numerics.doctor import rows as DR
from skyrl_numerics.invariant.numerics import NumericsPlan

SERVING = ("W4A4 serving", "W8A8 serving")


def test_plans_drop_the_groups_a_model_lacks(qwen_moe_dir, deepseek_v3_dir):
    qwen = {sc: NumericsPlan.from_json(DR.serving_plan(sc, qwen_moe_dir)) for sc in SERVING}
    ds = {sc: NumericsPlan.from_json(DR.serving_plan(sc, deepseek_v3_dir)) for sc in SERVING}
    assert set(qwen["W4A4 serving"].formats) == {"attention", "experts"}     # no shared / dense
    assert set(ds["W4A4 serving"].formats) == {"attention", "experts", "shared", "dense"}
    w4 = ds["W4A4 serving"].formats
    assert (w4["experts"].weight, w4["experts"].act) == ("nvfp4", "nvfp4")
    assert all((w4[g].weight, w4[g].act) == ("fp8_tensor_weight", "fp8_token")
               for g in ("attention", "shared", "dense"))
    assert all((f.weight, f.act) == ("fp8_channel", "fp8_token")
               for f in ds["W8A8 serving"].formats.values())
    assert not any(p.lora or p.lora_targets for p in (*qwen.values(), *ds.values()))
    # the engine argument resolves to the same JSON; the scenario's engine is its own
    from skyrl_numerics.doctor.engines import engine_kinds

    for sc in SERVING:
        spec = DR.SCENARIOS[sc]
        args = spec.engine_for(qwen_moe_dir)
        assert args["batch_invariant"] and args["numerics"] == DR.serving_plan(sc, qwen_moe_dir)
        assert json.loads(args["numerics"])["lora_rank"] == 0
        assert engine_kinds(spec) == (False, True)


def test_rows_declare_their_trainer_copies():
    from skyrl_numerics.doctor.trainer_memory import copy_name, trainer_key

    rows = {r.name: r for r in DR.ROWS}
    for sc in SERVING:
        stock, fq, bw = (rows[f"{sc}: {k}"] for k in ("stock trainer", "+ fake-quant matched",
                                                         "batch-invariant"))
        assert trainer_key(stock) == (None, None)                     # the baseline's HF copy
        assert trainer_key(fq) == (None, ("plan", sc))
        assert trainer_key(bw) == ("invariant", None, sc)
        assert copy_name(trainer_key(fq)) == f"HF stored dtype + QAT plan of {sc}"
        assert copy_name(trainer_key(bw)) == f"invariant + plan of {sc}"
        assert fq.closes == ("quantization", stock.name)
        assert bw.closes == ("kernels + formulation", fq.name) and "batch-invariant" in bw.name
        assert all(r.default and r.scenario == sc for r in (stock, fq, bw))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_matched_rules_hold_the_engines_weight_grid(family, request):
    """The matched trainer's QAT rules put every planned weight on the grid the engine serves:
    with the plan's weight formats alone, in float32 (where HF and the invariant forward agree to
    ~1e-7 without quantization), the HF trainer under ``plan_qat_rules`` and the invariant
    forward under the plan give the same logprobs to 1e-5 — MLA's ``kv_a_proj_with_mqa`` included,
    which the published rules' ``self_attn.*_proj`` does not name."""
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.quant import apply_qat
    from skyrl_numerics.rollout import Rollout
    from skyrl_numerics.invariant import from_checkpoint
    from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs
    from skyrl_numerics.trainer.logprobs import trainer_logprobs

    d = request.getfixturevalue("qwen_moe_dir" if family == "qwen3_moe" else "deepseek_v3_dir")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, 500, size=40).tolist() for _ in range(3)]
    ro = Rollout.from_lists([s[:12] for s in seqs], [s[12:] for s in seqs], [[0.0] * 28] * 3)
    plan = NumericsPlan.from_json(DR.serving_plan("W4A4 serving", d))
    weights = NumericsPlan(formats={g: {"weight": f.weight} for g, f in plan.formats.items()})
    inv = invariant_trainer_logprobs(from_checkpoint(d, dtype=torch.float32, numerics=weights),
                                     ro).logprobs
    plain = trainer_logprobs(load_hf_model(d, dtype="float32"), ro).logprobs
    hf = load_hf_model(d, dtype="float32")
    done = apply_qat(hf, DR.plan_qat_rules(hf, weights.to_json()))
    if family == "deepseek_v3":
        assert any(n.endswith("kv_a_proj_with_mqa") for n in done)
    got = trainer_logprobs(hf, ro).logprobs
    assert np.abs(np.asarray(plain) - inv).mean() > 1e-3          # the grid moves the logprobs
    assert np.abs(np.asarray(got) - inv).max() < 1e-5


def test_a_model_without_a_family_skips_the_serving_rows(tmp_path):
    """A checkpoint the invariant engine cannot run: the rows say so (no engine starts)."""
    pytest.importorskip("vllm")  # inspect_checkpoint reads vLLM's model registry
    from skyrl_numerics.doctor import DoctorContext, skip_reason
    from skyrl_numerics.doctor.model_check import inspect_checkpoint
    from skyrl_numerics.models import build_tiny_model

    # (a Mixtral whose sliding window is shorter than its context: no family reproduces it)
    info = inspect_checkpoint(build_tiny_model("mixtral", sliding_window=256), count_params=False)
    ctx = DoctorContext(model_dir=info.path, family=info.model_type, info=info)
    for r in DR.ROWS:
        if r.scenario in SERVING:
            why = skip_reason(r, ctx, load=False)
            assert why.startswith("batch-invariant: ") and "'sliding_window'" in why, why


def test_serving_scenarios_need_a_planned_server():
    from types import SimpleNamespace

    from skyrl_numerics.doctor.remote import _scenario_skip

    remote = SimpleNamespace(batch_invariant=True, kv_cache=None, url="http://x", max_logprobs=20)
    for sc in SERVING:
        assert "numerics plan" in _scenario_skip(DR.SCENARIOS[sc], remote, sampling_mask=False)


def test_matched_rules_quantize_the_experts_down_proj_input_as_the_engine_does(qwen_moe_dir,
                                                                             monkeypatch):
    """With the whole W4A4 plan (weights and activations) in float32 the HF trainer and the
    invariant forward are not bitwise (a last-bit difference before a quantizer becomes a whole
    FP4 step), but the matched rules quantize every GEMM input the engine quantizes: the fused
    experts' ``down_proj`` input too. Leaving it out (the token hook only) is a systematic
    mismatch — at least 1.5x the gap here (measured 2.4e-02 vs 1.1e-02)."""
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.quant import hf_experts
    from skyrl_numerics.quant import apply_qat
    from skyrl_numerics.rollout import Rollout
    from skyrl_numerics.invariant import from_checkpoint
    from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs
    from skyrl_numerics.trainer.logprobs import trainer_logprobs

    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, 500, size=44).tolist() for _ in range(6)]
    ro = Rollout.from_lists([s[:12] for s in seqs], [s[12:] for s in seqs], [[0.0] * 32] * 6)
    pj = DR.serving_plan("W4A4 serving", qwen_moe_dir)
    inv = np.asarray(invariant_trainer_logprobs(
        from_checkpoint(qwen_moe_dir, dtype=torch.float32, numerics=NumericsPlan.from_json(pj)),
        ro).logprobs)

    def gap():
        hf = load_hf_model(qwen_moe_dir, dtype="float32")
        done = apply_qat(hf, DR.plan_qat_rules(hf, pj))
        return np.abs(np.asarray(trainer_logprobs(hf, ro).logprobs) - inv).mean(), done

    both, done = gap()
    assert done["model.layers.0.mlp.experts"][-1] == "input:nvfp4"
    monkeypatch.setattr(hf_experts, "standard_experts", lambda m: False)
    tokens_only, done = gap()
    assert done["model.layers.0.mlp.experts"][-1] == "input:nvfp4 (gate_up only)"
    assert both * 1.5 < tokens_only, (both, tokens_only)
