"""The execution contract (``invariant/contract.py``): the fingerprint covers every field, a diff
names exactly the fields that differ, the refusal names them in one line, and the contracts of
real invariant models differ exactly where their KV format, numerics plan, LoRA or kernel build
differ (the engine side, computed in vLLM's worker: ``tests/e2e/test_contract_vllm.py``)."""
from __future__ import annotations

import dataclasses
import json

import pytest
from contract_child import child_process_fields
from hypothesis import given, strategies as st

from skyrl_numerics.errors import ContractMismatch, InputError
from skyrl_numerics.invariant import contract as C
from skyrl_numerics.invariant.numerics import NumericsPlan

FIELDS = [f.name for f in dataclasses.fields(C.ExecutionContract)]
# a plan that runs on the tiny Qwen3-MoE (dims multiples of 16/32)
PLAN = NumericsPlan(formats={"experts": {"weight": "nvfp4", "act": "nvfp4"}})
LORA = NumericsPlan(lora_rank=4, lora_targets=("attention",))


@pytest.fixture(scope="module")
def base(qwen_moe_dir):
    """The contract of the tiny Qwen3-MoE's HF config (no model load: milliseconds)."""
    cfg = json.loads((qwen_moe_dir / "config.json").read_text())
    return C.of_hf(cfg, dtype="bfloat16")


@pytest.fixture(scope="module")
def invariant(qwen_moe_dir):
    """``kv/plan -> contract`` of the invariant Qwen3-MoE built from the checkpoint's config
    (weights are not part of the contract; from_config builds the same model without them)."""
    from transformers import AutoConfig

    from skyrl_numerics.invariant import family_class

    cfg = AutoConfig.from_pretrained(str(qwen_moe_dir))

    def of(kv=None, plan=None):
        model = family_class("Qwen3MoeForCausalLM").from_config(cfg, kv_cache=kv, numerics=plan)
        return C.of_model(model)
    return of


@given(field=st.sampled_from(FIELDS), value=st.text(min_size=1, max_size=40))
def test_any_one_field_changes_the_fingerprint_and_the_diff_names_it(base, field, value):
    if field == "forward":
        value = "invariant" if base.forward != "invariant" else "vllm"
    if value == getattr(base, field):
        value += "x"
    other = dataclasses.replace(base, **{field: value})
    assert other.fingerprint() != base.fingerprint()
    assert [d[0] for d in base.diff(other)] == [field]
    assert base.diff(other) == [(field, getattr(base, field), value)]
    with pytest.raises(ContractMismatch) as e:
        C.check(base, other, what="a test")
    assert e.value.fields == [field] and e.value.field == field
    assert f"differ in {field} " in str(e.value) and "\n" not in str(e.value)
    C.check(other, dataclasses.replace(base, **{field: value}))    # equal: no error


@given(fields=st.lists(st.sampled_from([f for f in FIELDS if f != "forward"]), min_size=1,
                       unique=True))
def test_a_diff_lists_every_differing_field_in_field_order(base, fields):
    other = dataclasses.replace(base, **{f: f"other-{f}" for f in fields})
    assert [d[0] for d in base.diff(other)] == [f for f in FIELDS if f in fields]
    with pytest.raises(ContractMismatch) as e:
        C.check(base, other)
    assert e.value.fields == [f for f in FIELDS if f in fields]
    assert isinstance(e.value, InputError)    # the CLI prints it as one line, exit 2


def test_the_fingerprint_is_the_sha256_of_the_canonical_json(base):
    import hashlib

    canon = json.dumps(dataclasses.asdict(base), sort_keys=True, separators=(",", ":"))
    assert base.canonical() == canon
    assert base.fingerprint() == hashlib.sha256(canon.encode()).hexdigest()[:32]
    assert C.ExecutionContract.from_dict(json.loads(json.dumps(base.to_dict()))) == base


def test_bad_contracts_are_refused_naming_the_field(base):
    d = base.to_dict()
    with pytest.raises(InputError, match="field 'fingerprint'"):
        C.ExecutionContract.from_dict({**d, "fingerprint": "0" * 32}, source="engine")
    with pytest.raises(InputError, match="field 'kv_format'"):
        C.ExecutionContract.from_dict({k: v for k, v in d.items() if k != "kv_format"})
    with pytest.raises(InputError, match="field 'dtype'"):
        C.ExecutionContract.from_dict({**d, "dtype": 16})
    with pytest.raises(InputError, match="field 'forward'"):
        dataclasses.replace(base, forward="trt")
    with pytest.raises(InputError, match="field 'contract'"):
        C.ExecutionContract.from_dict(["not", "a", "dict"])


def test_a_long_value_is_cut_in_the_message(base):
    other = dataclasses.replace(base, numerics="y" * 500)
    msg = str(pytest.raises(ContractMismatch, C.check, base, other).value)
    assert "'" + "y" * 76 + "..." in msg and "y" * 77 not in msg and len(msg) < 300


def test_invariant_models_differ_exactly_in_kv_format_numerics_and_lora(invariant):
    auto = invariant()
    assert auto == invariant() and auto.forward == "invariant"
    assert auto.family == "Qwen3MoeForCausalLM" and auto.dtype == "bfloat16"
    assert [d[0] for d in auto.diff(invariant(kv="fp8"))] == ["kv_format"]
    assert [d[0] for d in auto.diff(invariant(kv={"format": "fp8", "k_scale": 0.5}))] == ["kv_format"]
    assert [d[0] for d in auto.diff(invariant(plan=PLAN))] == ["numerics"]
    assert [d[0] for d in auto.diff(invariant(plan=LORA))] == ["lora"]
    assert json.loads(invariant(plan=PLAN).numerics)["experts"]["weight"] == "nvfp4"
    # the HF config of the same checkpoint is another forward, recorded with its own digest
    assert auto.mode_ops != "off" and auto.kernel_build != "torch"


def test_a_config_change_changes_the_config_field(qwen_moe_dir, invariant):
    from transformers import AutoConfig

    from skyrl_numerics.invariant import family_class

    cfg = AutoConfig.from_pretrained(str(qwen_moe_dir))
    cfg.rms_norm_eps = cfg.rms_norm_eps * 2
    other = C.of_model(family_class("Qwen3MoeForCausalLM").from_config(cfg))
    assert [d[0] for d in invariant().diff(other)] == ["config"]


def test_the_native_kernels_switched_off_change_kernel_build_alone(invariant):
    """A process with ``SKYRL_NUMERICS_NATIVE=0`` (the torch specifications instead of the
    compiled C kernels) runs another kernel build: its contract differs in ``kernel_build``
    alone (a fresh process: a library once loaded stays in use)."""
    here = invariant()
    there = dataclasses.replace(here, **child_process_fields(SKYRL_NUMERICS_NATIVE="0"))
    assert [d[0] for d in here.diff(there)] == ["kernel_build"]   # ISA, versions: the same


def test_the_op_table_names_every_overridden_op():
    from skyrl_numerics.kernels.mode import op_table, registered_ops

    table = op_table("cpu")
    assert set(registered_ops("cpu")) <= set(table)
    assert table["mm"].startswith("skyrl_numerics.kernels.")
    assert any(k.startswith("row_local:") for k in table)
