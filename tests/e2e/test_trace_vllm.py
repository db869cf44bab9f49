"""The layer-by-layer tracer against the real vLLM CPU engine (the session engines on the tiny
Qwen3-MoE): the bitwise pair (invariant engine vs invariant trainer) shows no divergence in any
module, prefill and decode; a one-ulp change planted in the trainer's layer 1 is named there;
the HF trainer against stock vLLM parts at a first module, with vLLM's schedule recorded."""
from __future__ import annotations

import pytest

from skyrl_numerics.doctor.trace import Side, planted, run_trace
from skyrl_numerics.invariant import from_checkpoint

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def invariant_trainer(qwen_moe_dir):
    return from_checkpoint(qwen_moe_dir)


def test_bitwise_pair_shows_no_divergence_prefill_and_decode(vllm_qwen_invariant, qwen_moe_dir,
                                                             invariant_trainer):
    r = run_trace(qwen_moe_dir, [Side("invariant", model=invariant_trainer),
                                 Side("vllm-invariant", model=vllm_qwen_invariant)],
                  per_op=True, keep_tensors=True, decode=3)
    assert r.first is None, r.table()
    compared = [m for m in r.comparison.modules if m.rows]
    names = {m.name for m in compared}
    assert {"embed", "L0.attn", "L1.router_ids", "L1.mlp", "L1.layer", "norm", "logits"} <= names
    assert all(m.max_abs_delta == 0 and m.frac_elements_differing == 0 for m in compared)
    # every sequence: 16 prompt + 3 decode positions compared, the engine's tokens included
    assert all(len(s) == 19 for s in r.sequences)
    assert {m.name: m.rows for m in compared}["L1.layer"] == 4 * 19
    sched = r.comparison.b.info()["vllm_schedule"]
    assert sched["prefill"] == 4 and sched["decode"] == 4 * 3
    assert r.comparison.b.steps[0][0][1:] == [0, 16, "prefill"]


def test_a_planted_ulp_in_the_trainer_is_named_against_the_engine(vllm_qwen_invariant,
                                                                  qwen_moe_dir):
    planted_trainer = from_checkpoint(qwen_moe_dir)
    planted(planted_trainer.w("model.layers.1.self_attn.o_proj.weight"))
    sides = [Side("invariant", "planted trainer", planted_trainer),
             Side("vllm-invariant", model=vllm_qwen_invariant)]
    assert run_trace(qwen_moe_dir, sides).first.name == "L1.layer"
    r = run_trace(qwen_moe_dir, sides, per_op=True)
    assert r.first.name == "L1.attn"
    assert all(m.status == "equal" for m in r.comparison.modules if m.name.startswith("L0."))


def test_hf_against_stock_vllm_parts_at_a_first_module(vllm_qwen, qwen_moe_dir, tmp_path):
    r = run_trace(qwen_moe_dir, ["hf", Side("vllm", model=vllm_qwen)], per_op=True,
                  out_dir=tmp_path)
    f = r.first
    assert f is not None and f.name.startswith("L0."), r.table()
    by = {m.name: m for m in r.comparison.modules}
    # the same embedding rows and the same first RMSNorm, bit for bit, before it
    assert by["embed"].status == "equal" and by["L0.attn_norm"].status == "equal"
    # vLLM computes the logits of the sampled (last) positions only: 4 rows compared
    assert by["logits"].rows == 4 and by["L1.layer"].rows == 64
    assert by["L0.router_ids"].status == "only hf"      # vLLM's fused MoE picks them inside
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "trace.png").is_file()
    assert r.comparison.b.info()["vllm_schedule"]["prefill"] == 4
