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
    # the bf16 GEMM arithmetic it ran, and the AMX advice exactly where the CPU has AMX
    from skyrl_numerics.kernels import cpu_gemm_amx

    assert rep["gemm_bf16"] == "fma" and (rep["gemm_advice"] is not None) == cpu_gemm_amx.available()
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
    from skyrl_numerics.doctor import SCENARIOS
    from skyrl_numerics.doctor.engines import ServedInPlace
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.trainer import VLLMGenerator

    spec = SCENARIOS["nvfp4 experts"]
    assert spec.weights_only
    model_dir = vllm_qwen.model_dir
    served = spec.serve(model_dir)
    prompts = make_prompts(4, 12, vllm_qwen.vocab_size, seed=3)
    before = vllm_qwen.generate(prompts, max_tokens=16, seed=5)
    with ServedInPlace(vllm_qwen, model_dir, served) as eng:
        assert eng is vllm_qwen and any(".mlp.experts." in n for n in ServedInPlace(
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
    # the sampled token, the top-20 and every position's full logits row (by digest): bitwise
    assert rep["top-20 dist. bitwise ="] == "100%" and rep["distribution"]["frac_bitwise"] == 1.0
    assert rep["full distribution bitwise ="] == "100%"
    assert rep["logits_digest"]["frac_bitwise"] == 1.0 and rep["logits_digest"]["positions"] == 96
    assert rep["logits_digest"]["first_mismatch"] is None
    # the execution contracts, compared before the row ran (the engine's from its worker)
    c = rep["contract"]
    assert c["diff"] == [] and c["refuses"] and c["engine"]["forward"] == "invariant"
    assert c["trainer"]["fingerprint"] == c["engine"]["fingerprint"]


def test_doctor_multi_turn_rows(tmp_path, vllm_qwen, vllm_qwen_invariant):
    """The multi-turn scenarios: trajectories through the toy tool, rows measured on model tokens
    with one row per turn, route bytes as turn deltas; the invariant row is 0 on every turn."""
    out = tmp_path / "mt"
    rows = ["multi-turn: HF trainer", "multi-turn: + R3 (routes from turn deltas)",
            "multi-turn: batch-invariant (trainer and vLLM)"]
    assert main(["doctor", "--prompts", "4", "--max-tokens", "8", "--out", str(out),
                 "--no-progress", *[a for r in rows for a in ("--row", r)]]) == 0
    rep = {r["name"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    plain, r3, inv = (rep[n] for n in rows)
    for r in (plain, r3, inv):
        assert r["status"] == "measured", r
        assert [t["turn"] for t in r["report"]["per_turn"]] == [0, 1, 2], r["report"]["per_turn"]
        delta, full = (float(x) for x in r["route kB (turn deltas / full resend)"].split(" / "))
        assert 0 < delta < full
    # (the tiny model's HF routers mostly agree with vLLM's here: R3 moves the gap little; that the
    # turn-delta routes are the engine's is tested in test_multiturn.py / test_server_routes.py)
    assert r3["summary"]["mean_abs"] < 0.05
    assert inv["summary"]["max_abs"] == 0.0 and inv["summary"]["frac_bitwise_equal"] == 1.0
    assert all(t["max_abs"] == 0.0 for t in inv["report"]["per_turn"])
    assert inv["top-20 dist. bitwise ="] == "100%"       # every model token's top-20, as a set
    assert inv["full distribution bitwise ="] == "100%"  # and its whole logits row (digest)
    # the written multi-turn dump: `gap FILE` prints its per-turn table
    dump = next(out.glob("rollout-multi-turn*tool*.safetensors"))
    assert main(["gap", str(dump), "--out", str(tmp_path / "g")]) == 0
    again = json.loads((tmp_path / "g" / "report.json").read_text())
    assert [t["turn"] for t in again["report"]["per_turn"]] == [0, 1, 2]
    assert again["summary"]["mean_abs"] == plain["summary"]["mean_abs"]
    # model tokens only: 8 per model turn (observations not counted), 4 trajectories in turn 0
    assert plain["report"]["per_turn"][0]["n_tokens"] == 4 * 8
    assert plain["summary"]["n_tokens"] == 8 * sum(1 for t in plain["report"]["per_turn"]
                                                   for _ in range(t["n_seqs"]))


def test_doctor_passes_the_derived_kv_cache_size_to_the_engine(tmp_path, qwen_moe_dir,
                                                               monkeypatch, capsys):
    """With 4 GiB of RAM (a faked free-memory number) vLLM's default 0.1 share cannot hold an
    engine: the doctor derives ``kv_cache_memory_bytes`` from the checkpoint, the real engine
    starts with it and sizes its cache by it — as many blocks as engine_memory's layout says."""
    import collections

    import psutil

    from skyrl_numerics.doctor import engine_memory as em
    from skyrl_numerics.engine import generator

    vm = collections.namedtuple("svmem", "total available percent used free")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: vm(4 << 30, int(3.5 * (1 << 30)),
                                                              12.5, 1 << 29, 3 << 30))
    before = set(generator._CACHE)
    out = tmp_path / "mem"
    row = "baseline: HF trainer, bf16"
    try:
        assert main(["doctor", "--prompts", "4", "--max-tokens", "16", "--out", str(out),
                     "--no-progress", "--row", row]) == 0
        rep = json.loads((out / "report.json").read_text())
        kv = rep["settings"]["memory"]["settings"]["kv_cache_memory_bytes"]
        cfg = json.loads((qwen_moe_dir / "config.json").read_text())
        lay = em.kv_layout(cfg, dtype="bfloat16")
        # 4 prompts x (16 + 16) tokens fit one block; max_model_len 1024 needs 8: x 1.25 + 1
        assert kv == lay.layers * lay.token_bytes * em.kv_tokens(4, 32, lay.block_size, 1024)
        assert rep["rows"][0]["status"] == "measured" and rep["settings"]["engine_args"] == {}
        [eng] = [generator._CACHE[k] for k in set(generator._CACHE) - before]
        cache = eng.llm.llm_engine.vllm_config.cache_config
        assert cache.kv_cache_memory_bytes == kv and cache.block_size == lay.block_size
        assert cache.num_gpu_blocks == kv // (lay.layers * lay.block_size * lay.token_bytes)
        assert f"engines get kv_cache_memory_bytes={kv:,}" in capsys.readouterr().out
    finally:
        for key in set(generator._CACHE) - before:
            generator._CACHE.pop(key).close()
