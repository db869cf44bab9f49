"""GPT-OSS engine == trainer, bit for bit, on the real vLLM CPU engine: the invariant model
(``invariant/gpt_oss.py``: attention sinks, a sliding window of 32 on every other layer, biased
router and experts, clamped SwiGLU, YaRN) served out of tree with continuous batching, chunked
prefill (a 64-token step budget) and prefix-cache hits, against the invariant trainer's packed
forwards: every sampled token's logprob, every route of both MoE layers and every full logits
row (digest). The prompts outrun the window, so the sliding layers really cut. One engine for
the file by default (~1-3 min to start on the shared 2-core host); the FP8-cache engine is
opt-in (``SKYRL_NUMERICS_DENSE_ALL=1``). Nothing is mocked.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.rollout_forward import invariant_logits_digest
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# the FP8 cache's engine is opt-in (one more engine): SKYRL_NUMERICS_DENSE_ALL=1, as the dense cases
_OPT_IN = pytest.mark.skipif(os.environ.get("SKYRL_NUMERICS_DENSE_ALL", "") != "1",
                             reason="one engine per case: set SKYRL_NUMERICS_DENSE_ALL=1")


@pytest.fixture(scope="module", params=["auto", pytest.param("fp8", marks=_OPT_IN)])
def engine(request):
    pytest.importorskip("vllm")
    from skyrl_numerics.models import build_tiny_model
    from skyrl_numerics.trainer import VLLMGenerator

    d, kv = build_tiny_model("gpt_oss"), request.param
    gen = VLLMGenerator(d, batch_invariant=True, max_num_batched_tokens=64, capture_routes=True,
                        kv_cache=None if kv == "auto" else kv)
    yield d, kv, gen
    gen.close()


def _assert_bitwise(tl, ro, what):
    bad = np.flatnonzero(tl.logprobs.view(np.uint32) != ro.rollout_logprobs.view(np.uint32))
    assert len(bad) == 0, (f"{what}: {len(bad)}/{len(tl.logprobs)} tokens differ, first at "
                           f"{bad[0]}: {tl.logprobs[bad[0]]} vs {ro.rollout_logprobs[bad[0]]}")


def test_every_token_route_and_row_bitwise_under_chunked_prefill_and_prefix_hits(engine):
    d, kv, gen = engine
    shared = make_prompts(1, 150, gen.vocab_size, seed=61)[0]       # > 64: prefilled in chunks
    # seed=None: vLLM CPU 0.32 cannot combine per-request seeds with chunked prefill
    gen.generate([shared + [5, 6]], max_tokens=2, seed=None)         # warms the prefix cache
    prompts = [shared + t for t in make_prompts(3, 5, gen.vocab_size, seed=62)]
    prompts += make_prompts(3, 90, gen.vocab_size, seed=63)          # chunked, no cache hit
    prompts += make_prompts(4, 7, gen.vocab_size, seed=64)           # short: decode beside prefill
    ro = gen.generate(prompts, max_tokens=40, seed=None, temperature=0.8, logits_digest=True)
    assert min(ro.meta["num_cached_tokens"][:3]) >= 128, ro.meta["num_cached_tokens"]
    assert ro.routes is not None and ro.routes.num_layers == 2
    model = from_checkpoint(d, kv_cache=None if kv == "auto" else kv)
    for bs in (1, 4, 10):
        tl = invariant_trainer_logprobs(model, ro, batch_size=bs, return_routes=True)
        _assert_bitwise(tl, ro, f"gpt_oss trainer batch {bs}")
        assert tl.routes == ro.routes
    digest = invariant_logits_digest(model, ro, batch_size=4)
    assert digest["frac_bitwise"] == 1.0 and digest["positions"] == ro.num_response_tokens, digest
    if kv != "auto":   # the FP8 cache is really in effect: a trainer without it is off
        plain = invariant_trainer_logprobs(from_checkpoint(d), ro, batch_size=10)
        assert (plain.logprobs != ro.rollout_logprobs).mean() > 0.2


def test_a_prompt_has_the_same_bits_at_any_engine_batch(engine):
    """Greedy (vLLM CPU 0.32 refuses per-request seeds beside chunked prefill): a 40-token prompt
    (past the window) alone and among 7 others gives the same tokens and logprob bits."""
    d, kv, gen = engine
    prompts = make_prompts(8, 40, gen.vocab_size, seed=65)
    together = gen.generate(prompts, max_tokens=24, seed=None, temperature=0.0)
    alone = gen.generate(prompts[5:6], max_tokens=24, seed=None, temperature=0.0)
    a, b = together.response_cu[5], together.response_cu[6]
    assert together.response(5).tolist() == alone.response(0).tolist()
    assert together.rollout_logprobs[a:b].tobytes() == alone.rollout_logprobs.tobytes()


def test_vllm_registers_and_loads_the_invariant_gpt_oss():
    """Without an engine: vLLM's registry (after our plugin) knows the architecture and the
    model built as the engine builds it loads every tensor of the HF checkpoint."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from skyrl_numerics.engine import vllm_invariant_model as vim
    from skyrl_numerics.engine.vllm_plugin import register
    from skyrl_numerics.invariant import family_class
    from skyrl_numerics.invariant.base import checkpoint_tensor_names, iter_checkpoint_tensors
    from skyrl_numerics.models import build_tiny_model

    d = build_tiny_model("gpt_oss")
    over = vim.engine_overrides(json.loads((d / "config.json").read_text()))
    assert over["architectures"] == ["SkyrlInvariantGptOssForCausalLM"]
    register()
    assert over["architectures"][0] in ModelRegistry.get_supported_archs()
    cfg = AutoConfig.from_pretrained(str(d))
    for k, v in over.items():
        setattr(cfg, k, v)
    core = family_class(over["skyrl_base_arch"]).from_config(cfg, kv_cache=json.loads(
        over["skyrl_kv_cache"]), pack=True)
    assert core.load_named(iter_checkpoint_tensors(d)) == set(core.hf_names()) \
        == set(checkpoint_tensor_names(d))


@_OPT_IN
def test_doctor_stock_rows_and_r3_on_gpt_oss(tmp_path):
    """``doctor --model DIR`` on the tiny GPT-OSS (three engines: opt-in). Stock vLLM serves it
    (its CPU attention takes the sinks); the routes captured in its GPT-OSS MoE replayed into
    HF's ``GptOssTopKRouter`` remove the routing flips (run 2026-12-05, 4 x 24 tokens: max |Δ|
    0.144 -> 0.0084), support replay + R3 closes top-p (mean 0.050 -> 0.0029), and the
    batch-invariant row is bitwise."""
    from skyrl_numerics.cli import main
    from skyrl_numerics.engine import generator
    from skyrl_numerics.models import build_tiny_model

    out = tmp_path / "out"
    rows = ["baseline: HF trainer, bf16", "+ R3 (router replay)",
            "top-p 0.95 only: HF trainer, full-vocab", "top-p 0.95 only: + support replay + R3",
            "+ batch-invariant (trainer and vLLM)"]
    before = set(generator._CACHE)
    try:
        assert main(["doctor", "--model", str(build_tiny_model("gpt_oss")), "--prompts", "4",
                     "--max-tokens", "24", "--out", str(out), "--no-progress",
                     *[a for r in rows for a in ("--row", r)]]) == 0
    finally:
        for key in set(generator._CACHE) - before:
            generator._CACHE.pop(key).close()
    rep = json.loads((out / "report.json").read_text())
    assert rep["model"]["architecture"] == "GptOssForCausalLM" and rep["model"]["moe"] is True
    by = {r["name"]: r for r in rep["rows"]}
    assert all(r["status"] == "measured" for r in by.values()), {n: r["status"] for n, r in by.items()}
    s = {n: r["summary"] for n, r in by.items()}
    base, r3 = s["baseline: HF trainer, bf16"], s["+ R3 (router replay)"]
    assert r3["max_abs"] < base["max_abs"] and r3["mean_abs"] < base["mean_abs"]
    full, both = s["top-p 0.95 only: HF trainer, full-vocab"], s["top-p 0.95 only: + support replay + R3"]
    assert both["mean_abs"] < 0.2 * full["mean_abs"]
    bi = s["+ batch-invariant (trainer and vLLM)"]
    assert bi["frac_bitwise_equal"] == 1.0 and bi["max_abs"] == 0.0


@_OPT_IN
def test_train_bitwise_on_gpt_oss_is_exact_every_step(tmp_path):
    """``skyrl-numerics train --model DIR --configs bitwise`` on the tiny GPT-OSS (its own engine,
    opt-in): after each delta weight sync the engine's logprobs are the trainer's, Δ = 0 (run
    2026-12-05: 2 steps, 100 %, contracts equal)."""
    import subprocess
    import sys

    from skyrl_numerics.models import build_tiny_model

    out = tmp_path / "train"
    proc = subprocess.run([sys.executable, "-m", "skyrl_numerics.cli", "train", "--model",
                           str(build_tiny_model("gpt_oss")), "--configs", "bitwise", "--steps", "2",
                           "--prompts", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((out / "train.json").read_text())
    steps = rec["history"]["bitwise"]
    assert len(steps) == 2
    assert all(s["gap_max_abs"] == 0.0 and s["gap_frac_bitwise_equal"] == 1.0 for s in steps), steps
    assert rec["contracts"]["bitwise"]["equal"] is True
