"""The execution contract computed inside real vLLM CPU workers (``skyrl_contract``, through
``collective_rpc``) against the trainer's: the same configuration passes with one fingerprint; a
trainer with another KV format, numerics plan, LoRA or kernel build is refused naming the field —
by the loop's check (:class:`~skyrl_numerics.trainer.loop_contract.ContractWatch`) and by the
doctor's bitwise rows. The session's two engines (invariant and stock) only; no engine of its own.
(The server side, ``GET /skyrl_contract``: tests/e2e/test_remote_generator.py and
test_server_sync.py.)"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from contract_child import child_process_fields

from skyrl_numerics.errors import ContractMismatch
from skyrl_numerics.invariant import contract as C
from skyrl_numerics.invariant.numerics import NumericsPlan
from skyrl_numerics.trainer.loop_contract import ContractWatch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PLAN = NumericsPlan(formats={"experts": {"weight": "nvfp4", "act": "nvfp4"}})
LORA = NumericsPlan(lora_rank=4, lora_targets=("attention",))


@pytest.fixture(scope="module")
def engine_contract(vllm_qwen_invariant):
    return vllm_qwen_invariant.contract()


def _trainer(model_dir, **kw):
    from skyrl_numerics.invariant import from_checkpoint

    return from_checkpoint(model_dir, **kw)


def test_the_invariant_engine_reports_the_trainers_contract(vllm_qwen_invariant, engine_contract,
                                                            qwen_moe_dir):
    from skyrl_numerics.trainer.invariant_trainer import InvariantTrainer

    trainer = C.of_model(InvariantTrainer(str(qwen_moe_dir)).model)
    assert engine_contract == trainer and engine_contract.fingerprint() == trainer.fingerprint()
    assert engine_contract.forward == "invariant" and engine_contract.kv_format.startswith('{"format":"auto"')
    assert vllm_qwen_invariant.engine_host["pid"] != os.getpid()    # computed in the worker
    watch = ContractWatch("bitwise", trainer.to_dict(), refuse=True)
    watch.compare(engine_contract.to_dict(), "before the first step")
    watch.compare(vllm_qwen_invariant.contract().to_dict(), "at sync 1")    # asked again
    rec = watch.record()
    assert rec["equal"] and rec["diff"] == [] and rec["checks"] == 2 and rec["engine_changed_at"] == []
    assert rec["trainer"]["fingerprint"] == rec["engine"]["fingerprint"] == trainer.fingerprint()


@pytest.mark.parametrize("kw, field", [({"kv_cache": "fp8"}, "kv_format"),
                                       ({"numerics": PLAN}, "numerics"),
                                       ({"numerics": LORA}, "lora")], ids=["kv", "plan", "lora"])
def test_a_bitwise_run_against_an_engine_of_another_kv_format_or_plan_is_refused(
        engine_contract, qwen_moe_dir, kw, field):
    trainer = C.of_model(_trainer(qwen_moe_dir, **kw)).to_dict()
    with pytest.raises(ContractMismatch) as e:
        ContractWatch("bitwise", trainer, refuse=True).compare(engine_contract.to_dict(),
                                                               "before the first step")
    assert e.value.fields == [field]
    assert str(e.value).startswith(f"field '{field}': execution contract (config 'bitwise', "
                                   "before the first step): trainer vs engine differ in " + field)
    # a configuration that is not bitwise records the difference and goes on
    watch = ContractWatch("aligned", trainer, refuse=False)
    watch.compare(engine_contract.to_dict(), "before the first step")
    assert [d["field"] for d in watch.record()["diff"]] == [field] and not watch.record()["equal"]


def test_a_trainer_of_another_kernel_build_is_refused(engine_contract, qwen_moe_dir):
    """The trainer process runs without the compiled C kernels (``SKYRL_NUMERICS_NATIVE=0``, a
    fresh process), the engine's worker with them: refused naming ``kernel_build``."""
    model = C.of_model(_trainer(qwen_moe_dir))
    trainer = dataclasses.replace(model, **child_process_fields(SKYRL_NUMERICS_NATIVE="0"))
    with pytest.raises(ContractMismatch, match="differ in kernel_build ") as e:
        C.check(trainer, engine_contract, what="config 'bitwise', before the first step")
    assert e.value.fields == ["kernel_build"]


def test_the_stock_engine_reports_its_own_forward(vllm_qwen, engine_contract):
    stock = vllm_qwen.contract()
    assert stock.forward == "vllm" and stock.family == "Qwen3MoeForCausalLM"
    assert stock.kv_format == '{"format":"auto"}' and stock.kernel_build.startswith("vllm _C")
    assert stock.torch == engine_contract.torch and stock.isa == engine_contract.isa
    with pytest.raises(ContractMismatch) as e:
        C.check(engine_contract, stock)
    assert e.value.fields[0] == "forward"


def test_the_doctors_bitwise_rows_compare_before_running(vllm_qwen_invariant, qwen_moe_dir):
    """The doctor keeps the engine's contract with each rollout; a bitwise row whose trainer
    computes another KV format than the engine's is refused before its forward (status
    ``refused: ...``); the rows that match, or are not bitwise, are measured with both
    contracts in the report."""
    from skyrl_numerics.doctor import ROWS, DoctorContext, engine_contract, score_rows
    from skyrl_numerics.doctor.model_check import inspect_checkpoint
    from skyrl_numerics.rollout.prompts import make_prompts

    ro = vllm_qwen_invariant.generate(make_prompts(2, 6, 512, 0), max_tokens=6, seed=0)
    ro.meta["engine_contract"] = engine_contract(vllm_qwen_invariant)
    ckpt = inspect_checkpoint(qwen_moe_dir)
    ctx = DoctorContext(model_dir=ckpt.path, family=ckpt.model_type, info=ckpt, dtype=None)
    names = ["+ batch-invariant (trainer and vLLM)",
             "+ batch-invariant, FP8 KV (trainer simulates the cache)",   # expects an FP8 engine
             "FP8 KV engine: trainer without KV simulation"]              # not a bitwise row
    selected = [next(r for r in ROWS if r.name == n) for n in names]
    # the FP8 scenario's rollout comes from the engine that stores its cache as bf16 (auto)
    rollouts = {"batch-invariant": ro, "batch-invariant, FP8 KV": ro}
    out, _ = score_rows(selected, ctx, rollouts, {n: None for n in names}, {})
    bitwise, refused, recorded = (r.extra for r in out)
    assert bitwise["status"] == "measured" and bitwise["_contract"]["diff"] == []
    assert out[0].report.summary()["max_abs"] == 0.0
    assert refused["status"].startswith("refused: field 'kv_format': execution contract"), refused
    assert [d["field"] for d in refused["_contract"]["diff"]] == ["kv_format"]
    assert refused["_contract"]["refuses"] is True
    assert recorded["status"] == "measured" and recorded["_contract"]["refuses"] is False
    assert np.isfinite(out[2].report.summary()["mean_abs"])


def test_the_invariant_mla_engine_reports_the_trainers_contract(vllm_deepseek_invariant,
                                                                deepseek_v3_dir):
    """DeepSeek-V3 (absorbed MLA, YaRN RoPE, the model type overridden for vLLM): the worker's
    config digest (its dims and RoPE from vLLM's config) equals the trainer's."""
    engine = vllm_deepseek_invariant.contract()
    trainer = C.of_model(_trainer(deepseek_v3_dir))
    assert engine.diff(trainer) == [] and engine.family == "DeepseekV3ForCausalLM"
