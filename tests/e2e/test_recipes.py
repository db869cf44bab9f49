"""`skyrl-numerics train --recipe ml4|k2|beam`: the seed recipes' whole stack through the real vLLM
CPU engine (the invariant model serving the recipe's numerics) and both trainers."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from skyrl_numerics.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _close_recipe_engines():
    """Each recipe's engine is cached process-wide (the loop and the direct test share one);
    close them when the module is done so they do not hold RAM for the rest of the session."""
    yield
    from skyrl_numerics.engine import generator

    for key, gen in list(generator._CACHE.items()):
        if gen.llm is not None and getattr(gen, "numerics", None) is not None:
            gen.close()
            del generator._CACHE[key]


def _run(tmp_path, *extra, steps=2):
    out = tmp_path / "train"
    assert main(["train", "--steps", str(steps), "--prompts", "2", "--samples", "4",
                 "--max-tokens", "8", "--out", str(out), "--no-progress", *extra]) == 0
    return json.loads((out / "train.json").read_text()), out


def _adapter_bytes(model_dir, plan_json) -> int:
    import math

    from skyrl_numerics.invariant.numerics import NumericsPlan, plan_adapter_shapes

    cfg = json.loads((model_dir / "config.json").read_text())
    shapes = plan_adapter_shapes(NumericsPlan.from_json(plan_json), cfg)
    return sum(2 * math.prod(s) for s in shapes.values())


def _bitwise_every_step(rows):
    for r in rows:
        assert r["gap_mean_abs"] == 0.0 and r["gap_max_abs"] == 0.0, r
        assert r["gap_frac_bitwise_equal"] == 1.0, r
        assert r["tis_clip_frac"] == 0.0
        assert r["grad_relerr_onpolicy"] == 0.0 and r["grad_cos_onpolicy"] == pytest.approx(1, abs=1e-12)
        assert r["time_generate_s"] > 0 and r["time_train_s"] > 0 and r["time_sync_s"] > 0


def test_ml4_published_and_bitwise_on_deepseek(tmp_path, deepseek_v3_dir):
    """ML4 on the MLA MoE: NVFP4 W4A4 experts, FP8 W8A8 attention / shared / dense, FP8 latent KV,
    LoRA 32/64 synced as adapters only. bitwise: Δ = 0 on every step after real adapter updates
    (a step that reached the engine wrong would show a gap the next step); published: the gap of
    a fake-quant HF trainer, with its TIS clip fraction."""
    res, out = _run(tmp_path, "--family", "deepseek_v3", "--recipe", "ml4")
    cfgs = {c["name"]: c for c in res["settings"]["configs"]}
    assert cfgs["bitwise"]["recipe"] == "ml4" and cfgs["bitwise"]["kv_cache"] == "fp8"
    plan = json.loads(cfgs["bitwise"]["numerics"])
    assert plan["formats"]["experts"]["weight"] == "nvfp4" and plan["formats"]["experts"]["act"] == "nvfp4"
    assert plan["formats"]["attention"]["act"] == "fp8_token" and plan["lora_rank"] == 32
    bitwise, published = res["history"]["bitwise"], res["history"]["published"]
    _bitwise_every_step(bitwise)
    adapters = _adapter_bytes(deepseek_v3_dir, cfgs["bitwise"]["numerics"])
    for r in bitwise:
        # only the adapters travel (every expert's, per-expert adapters), never the packed base
        assert r["sync_raw_bytes"] == adapters < r["sync_full_model_bytes"]
        assert 0 < r["sync_payload_bytes"]
    for r in published:
        assert r["gap_mean_abs"] > 0 and r["gap_frac_bitwise_equal"] < 0.5, r
        assert 0.0 <= r["tis_clip_frac"] < 0.05 and r["grad_cos_onpolicy"] < 1.0
        assert "correction/frac_tokens_clipped" not in r or r["tis_clip_frac"] >= 0
    assert (out / "train.png").read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def user_dir():
    """A checkpoint of dims nobody here chose for the recipes: 6 experts top-3 of width 96,
    hidden 192, 3 layers (passed as ``--model DIR``, a user's checkpoint)."""
    from skyrl_numerics.models import build_tiny_model

    return build_tiny_model("qwen3_moe", seed=3, hidden_size=192, moe_intermediate_size=96,
                            num_experts=6, num_experts_per_tok=3, num_hidden_layers=3,
                            num_attention_heads=3, num_key_value_heads=1)


@pytest.mark.parametrize("recipe", ["k2", "beam"])
def test_k2_and_beam_bitwise(tmp_path, recipe, qwen_moe_dir, user_dir):
    """k2 on a user's checkpoint (``--model DIR``): INT4 W4A16 experts + LoRA (adapters only);
    beam on the tiny Qwen3: MXFP8 W8A8 everywhere, full fine-tune (the engine re-packs the bf16
    weights it is sent). Bitwise on every step."""
    where = ["--model", str(user_dir)] if recipe == "k2" else []
    res, _ = _run(tmp_path, "--recipe", recipe, "--configs", "bitwise", *where)
    rows = res["history"]["bitwise"]
    _bitwise_every_step(rows)
    if recipe == "k2":     # adapters only
        plan = res["settings"]["configs"][0]["numerics"]
        assert all(r["sync_raw_bytes"] == _adapter_bytes(user_dir, plan) for r in rows)
    else:   # full fine-tune: every weight travels
        assert all(r["sync_raw_bytes"] == r["sync_full_model_bytes"] for r in rows)


def test_adapter_sync_refuses_a_wrong_adapter_and_keeps_the_old_ones(user_dir):
    """The engine serving a LoRA plan: a new adapter version applies in memory and the trainer's
    logprobs still match bit for bit; an adapter of another rank / an unknown target is refused
    with one line before anything is sent, and the engine keeps its adapters."""
    from skyrl_numerics.rollout.prompts import make_prompts
    from skyrl_numerics.errors import InputError
    from skyrl_numerics.trainer import get_generator
    from skyrl_numerics.invariant import from_checkpoint
    from skyrl_numerics.trainer.logprobs import invariant_trainer_logprobs
    from skyrl_numerics.trainer.seed_recipes import get_recipe, resolve
    from skyrl_numerics.engine.weight_update import update_vllm_weights

    plan, kv, _ = resolve(get_recipe("k2"), user_dir)
    gen = get_generator(user_dir, batch_invariant=True, capture_routes=True,
                        numerics=plan.to_json())     # the k2 loop's engine (same arguments)
    model = from_checkpoint(user_dir, numerics=plan)
    prompts = make_prompts(3, 8, 512, 5)
    g = torch.Generator().manual_seed(0)
    new = {}
    for n in model.adapter_names():
        if n.endswith("lora_B.weight"):
            model.w(n).copy_((torch.randn(model.w(n).shape, generator=g) * 0.05).to(model.dtype))
        new[n] = model.w(n).detach().clone()
    update_vllm_weights(gen, new)
    ro = gen.generate(prompts, n=2, max_tokens=8, seed=1)
    lp = np.asarray(invariant_trainer_logprobs(model, ro).logprobs, np.float32)
    assert np.array_equal(lp.view(np.uint32), np.asarray(ro.rollout_logprobs, np.float32).view(np.uint32))
    a0 = model.adapter_names()[0]
    for bad, match in (({a0: torch.zeros(new[a0].shape[0] + 1, new[a0].shape[1], dtype=torch.bfloat16)},
                        "rank"),
                       ({"model.layers.0.mlp.gate.lora_A.weight": torch.zeros(2, 2)}, "not one the engine")):
        with pytest.raises(InputError, match=match) as e:
            update_vllm_weights(gen, {**new, **bad})
        assert "\n" not in str(e.value)
    again = gen.generate(prompts, n=2, max_tokens=8, seed=1)
    assert np.array_equal(np.asarray(again.rollout_logprobs), np.asarray(ro.rollout_logprobs))
    # put the plan's own starting adapters back (the engine is shared with the k2 loop test)
    from skyrl_numerics.trainer.workers import _initial_adapters

    update_vllm_weights(gen, _initial_adapters(str(user_dir), plan))


def test_k2_over_a_vllm_server(tmp_path, user_dir, monkeypatch):
    """``serve --batch-invariant --recipe k2`` then ``train --server URL --recipe k2``: the
    adapters reach the server through vLLM's own weight-transfer routes (the skyrl_delta backend
    takes adapter-only snapshots from a LoRA server), Δ = 0 every step; a config whose plan the
    server does not serve is refused with one line."""
    from skyrl_numerics.errors import InputError
    from skyrl_numerics.engine.server import VLLMServer
    from skyrl_numerics.trainer.seed_recipes import get_recipe, resolve

    plan, kv, _ = resolve(get_recipe("k2"), user_dir)
    monkeypatch.setenv("VLLM_API_KEY", "k2-key")
    with VLLMServer(user_dir, api_key="k2-key", log_path=tmp_path / "serve.log",
                    batch_invariant=True, numerics=plan.to_json()) as srv:
        res, _ = _run(tmp_path, "--recipe", "k2", "--configs", "bitwise", "--server", srv.url)
        rows = res["history"]["bitwise"]
        _bitwise_every_step(rows)
        assert all(r["sync_raw_bytes"] == _adapter_bytes(user_dir, plan.to_json()) for r in rows)
        with pytest.raises(InputError, match="serves another plan"):
            from skyrl_numerics.trainer.loop import LoopSettings, run_loop
            from skyrl_numerics.trainer.seed_recipes import loop_configs

            other = loop_configs(get_recipe("k2", ["lora_rank=8"]), user_dir, ["bitwise"])
            run_loop(str(user_dir), other, LoopSettings(steps=1), server=srv.url,
                     api_key="k2-key", progress=False, work_dir=tmp_path / "w")


def test_k2_on_a_vendor_quantized_checkpoint(tmp_path, qwen_moe_dir):
    """``--model DIR`` written by compressed-tensors' own compressor (INT4 W4A16 g32, attention and
    experts): the engine and the trainer serve the stored codes + scales (never a bf16 copy), the
    recipe's LoRA rides on that frozen base, adapters synced in memory: Δ = 0 every step."""
    from skyrl_numerics.engine.serving_checkpoint import write_int4_checkpoint

    q = write_int4_checkpoint(qwen_moe_dir, experts=True)
    res, _ = _run(tmp_path, "--model", str(q), "--recipe", "k2", "--configs", "bitwise")
    rows = res["history"]["bitwise"]
    _bitwise_every_step(rows)
    plan = json.loads(res["settings"]["configs"][0]["numerics"])
    assert plan["formats"]["attention"]["weight"] == "int4_g32" and plan["lora_rank"] == 32
    assert all(r["sync_raw_bytes"] == _adapter_bytes(q, res["settings"]["configs"][0]["numerics"])
               for r in rows)
