"""The doctor's W4A4 / W8A8 rows against the real vLLM CPU engine: the invariant engine serves a
numerics plan (packed quantized weights, per-token quantized activations); a stock bf16 trainer,
the published fake-quant trainer and the invariant trainer with the same plan are measured on its
rollouts. The bitwise rows are 0 / 100 %; simulating the formats closes part of the gap."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from skyrl_numerics.cli import main

pytestmark = pytest.mark.vllm

KINDS = ("stock trainer", "+ fake-quant matched", "batch-invariant")


def _doctor(out, family_args, scenarios, prompts=4, max_tokens=24):
    rows = [f"{sc}: {k}" for sc in scenarios for k in KINDS]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["doctor", *family_args, "--prompts", str(prompts), "--max-tokens",
                   str(max_tokens), "--out", str(out), "--no-progress",
                   *[a for r in rows for a in ("--row", r)]])
    assert rc == 0, buf.getvalue()[-3000:]
    return json.loads((out / "report.json").read_text()), buf.getvalue()


# one engine start each (the doctor starts the scenario's own invariant engine and closes it once
# sampled): W4A4 on the tiny Qwen3-MoE, W8A8 on the tiny DeepSeek-V3 (MLA absorbed on both sides,
# shared experts, dense first layers); tests/doctor/test_doctor_serving_plans.py checks both plans
# on both families without an engine
CASES = [("qwen3_moe", "W4A4 serving", {"attention", "experts"}),
         ("deepseek_v3", "W8A8 serving", {"attention", "experts", "shared", "dense"})]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{sc.split()[0]}" for f, sc, _ in CASES])
def served(request, tmp_path_factory):
    family, sc, groups = request.param
    d = request.getfixturevalue("qwen_moe_dir" if family == "qwen3_moe" else "deepseek_v3_dir")
    rep, printed = _doctor(tmp_path_factory.mktemp("serving"), ["--model", str(d)], (sc,))
    return sc, groups, rep, printed


def test_serving_rows_split_the_gap(served):
    sc, _, rep, printed = served
    rows = {r["name"]: r for r in rep["rows"]}
    stock, fq, bw = (rows[f"{sc}: {k}"] for k in KINDS)
    for r in (stock, fq, bw):
        assert r["status"] == "measured" and r["scenario"] == sc, r
        assert r["summary"]["n_tokens"] == 4 * 24
    # bitwise: every sampled token, its top-20 and its whole logits row (digest)
    s = bw["summary"]
    assert s["mean_abs"] == 0.0 and s["max_abs"] == 0.0 and s["frac_bitwise_equal"] == 1.0
    assert bw["top-20 dist. bitwise ="] == "100%" and bw["full distribution bitwise ="] == "100%"
    # the formats' rounding is a cause of the gap: simulating them (weights on the served grid,
    # activations quantized per token) leaves less of it
    assert 0 < fq["summary"]["mean_abs"] < stock["summary"]["mean_abs"], (stock, fq)
    # the size of each cause: what each row closes of the one before it
    q, k = fq["cause"], bw["cause"]
    assert q["cause"] == "quantization" and q["vs"] == stock["name"]
    assert q["closed"] == pytest.approx(stock["summary"]["mean_abs"] - fq["summary"]["mean_abs"])
    assert k["cause"] == "kernels + formulation" and k["closed"] == fq["summary"]["mean_abs"]
    assert fq["cause closed (mean |Δ|)"].startswith("quantization: ")
    assert f"{sc}: batch-invariant" in printed and "cause closed" in printed


def test_serving_plan_and_trainer_copies_in_the_report(served):
    sc, groups, rep, _ = served
    fm = rep["settings"]["scenarios"][sc]["numerics"]["formats"]
    assert set(fm) == groups                       # the groups the model lacks are dropped
    want = {g: ("fp8_channel", "fp8_token") for g in groups} if sc.startswith("W8A8") else {
        g: ("nvfp4", "nvfp4") if g == "experts" else ("fp8_tensor_weight", "fp8_token") for g in groups}
    assert {g: (f["weight"], f["act"]) for g, f in fm.items()} == want
    mem = rep["settings"]["memory"]
    copies = mem["trainer_copies"]
    assert {"HF stored dtype", f"HF stored dtype + QAT plan of {sc}",
            f"invariant + plan of {sc}"} <= set(copies), copies
    assert all(v["mode"] in ("together", "alone") for v in mem["rows"].values()), mem["rows"]
