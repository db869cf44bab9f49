"""`skyrl-numerics doctor` against the real vLLM CPU engine: table, report.json, PNG."""
from __future__ import annotations

import json

import pytest

from skyrl_numerics.cli import main

pytestmark = pytest.mark.vllm


def test_doctor_writes_ablation_report(tmp_path, vllm_qwen, capsys):
    out = tmp_path / "doctor"
    rows = ["baseline: HF trainer, bf16", "+ R3 (router replay)",
            "top-p/top-k: HF trainer, full-vocab", "top-p/top-k: + support replay"]
    rc = main(["doctor", "--prompts", "4", "--max-tokens", "24", "--out", str(out),
               "--no-progress", *[a for r in rows for a in ("--row", r)]])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "vllm (cpu) 0.32.0" in printed and "baseline" in printed
    rep = json.loads((out / "report.json").read_text())
    assert rep["engine"] == "vllm (cpu)" and rep["engine_version"] == "0.32.0"
    rows = {r["name"]: r for r in rep["rows"]}
    base = rows["baseline: HF trainer, bf16"]["summary"]
    assert base["n_tokens"] == 4 * 24 and 0 < base["mean_abs"] < 0.05
    # top-p/top-k sampling with a full-vocab trainer: every token is off by log(kept mass) > 0
    trunc = rows["top-p/top-k: HF trainer, full-vocab"]["summary"]
    assert trunc["mean_abs"] > 10 * base["mean_abs"]
    # support replay removes that bias: back to the baseline's order of magnitude
    replay = rows["top-p/top-k: + support replay"]["summary"]
    assert replay["mean_abs"] < 5 * base["mean_abs"] and replay["F_2"] == 0.0
    assert (out / "gap.png").read_bytes()[:4] == b"\x89PNG"
    # where it ran: the trainer's host and kernel build, and the engine worker's own report (its
    # process loaded the build the detector names; same torch CPU capability: no mismatch)
    from skyrl_numerics.host import assumed_build

    h, eh = rep["host"], rep["engine_host"]
    assert h["torch_cpu_capability"] and h["vllm_kernels"]["build"] in ("_C", "_C_AVX512", "_C_AVX2")
    assert eh["pid"] != h["pid"] and eh["vllm_build_loaded"] in ("_C", "_C_AVX512", "_C_AVX2")
    if assumed_build() is None:
        assert eh["vllm_build_loaded"] == h["vllm_kernels"]["build"]
    assert eh["torch_cpu_capability"] == h["torch_cpu_capability"] and rep["isa_mismatch"] is False
    # the written rollout is a complete dump: `gap FILE` reproduces the baseline row
    assert main(["gap", str(out / "rollout-full.safetensors"), "--out", str(tmp_path / "g")]) == 0
    again = json.loads((tmp_path / "g" / "report.json").read_text())
    assert again["engine_version"] == "0.32.0"
    assert again["summary"]["mean_abs"] == base["mean_abs"]


def test_doctor_fake_quant_rows(tmp_path, vllm_qwen, capsys):
    """vLLM serves experts on the NVFP4 grid; a bf16 trainer is off, apply_qat matches it."""
    out = tmp_path / "fq"
    rows = ["nvfp4 experts: plain bf16 trainer", "nvfp4 experts: + fake-quant matched"]
    assert main(["doctor", "--prompts", "4", "--max-tokens", "32", "--out", str(out),
                 "--no-progress", *[a for r in rows for a in ("--row", r)]]) == 0
    rep = {r["name"]: r["summary"] for r in json.loads((out / "report.json").read_text())["rows"]}
    plain, matched = rep[rows[0]], rep[rows[1]]
    # measured: 2.5e-2 -> 5.2e-3 mean |Δ| (8x64 tokens)
    assert matched["mean_abs"] < 0.5 * plain["mean_abs"], (plain, matched)
    assert matched["kl_k3"] < plain["kl_k3"]


def test_doctor_serves_fake_quant_weights_in_place_like_a_fresh_engine(tmp_path, vllm_qwen):
    """The fake-quant scenarios load their weights into the shared engine in place (no engine
    start) and load the original ones back: the rollout is a fresh engine's on the served
    checkpoint bit for bit, and the shared engine afterwards samples what it sampled before."""
    from skyrl_numerics.doctor import SCENARIOS, _ServedInPlace, make_prompts
    from skyrl_numerics.trainer import VLLMGenerator

    spec = SCENARIOS["nvfp4 experts"]
    assert spec.weights_only
    model_dir = vllm_qwen.model_dir
    served = spec.serve(model_dir)
    prompts = make_prompts(4, 12, vllm_qwen.vocab_size, seed=3)
    before = vllm_qwen.generate(prompts, max_tokens=16, seed=5)
    with _ServedInPlace(vllm_qwen, model_dir, served) as eng:
        assert eng is vllm_qwen and any(".mlp.experts." in n for n in _ServedInPlace(
            vllm_qwen, model_dir, served).changed)
        in_place = eng.generate(prompts, max_tokens=16, seed=5)
    after = vllm_qwen.generate(prompts, max_tokens=16, seed=5)
    assert after.rollout_logprobs.tobytes() == before.rollout_logprobs.tobytes()
    assert in_place.rollout_logprobs.tobytes() != before.rollout_logprobs.tobytes()
    fresh = VLLMGenerator(served, capture_routes=True)
    try:
        ref = fresh.generate(prompts, max_tokens=16, seed=5)
    finally:
        fresh.close()
    assert ref.response_tokens.tobytes() == in_place.response_tokens.tobytes()
    assert ref.rollout_logprobs.tobytes() == in_place.rollout_logprobs.tobytes()


def test_doctor_batch_invariant_row(tmp_path, vllm_qwen_invariant):
    out = tmp_path / "bi"
    row = "+ batch-invariant (trainer and vLLM)"
    assert main(["doctor", "--prompts", "4", "--max-tokens", "24", "--out", str(out),
                 "--no-progress", "--row", row]) == 0
    rep = json.loads((out / "report.json").read_text())["rows"][0]
    assert rep["summary"]["frac_bitwise_equal"] == 1.0 and rep["summary"]["max_abs"] == 0.0
    assert rep["vLLM tok/s"] > 0
