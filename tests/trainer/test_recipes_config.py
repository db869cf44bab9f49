"""Seed recipe objects (trainer/seed_recipes.py): fields, overrides, what cannot apply to a model — all
refused before any engine starts, with one line naming the field."""
from __future__ import annotations

import json

import pytest

from skyrl_numerics.cli import main
from skyrl_numerics.errors import InputError
from skyrl_numerics.trainer.published import published_trainer_kwargs
from skyrl_numerics.trainer.seed_recipes import SEED_RECIPES, get_recipe, loop_configs, resolve


def test_the_three_recipes_resolve_on_both_families(qwen_moe_dir, deepseek_v3_dir):
    plan, kv, notes = resolve(get_recipe("ml4"), deepseek_v3_dir)
    assert kv == "fp8" and plan.lora_rank == 32 and plan.lora_alpha == 64
    assert plan.formats["experts"].weight == "nvfp4" and plan.formats["experts"].act == "nvfp4"
    assert set(plan.lora_targets) == {"attention", "dense", "shared", "experts"} and not notes
    plan, kv, notes = resolve(get_recipe("ml4", ["kv_cache=auto"]), qwen_moe_dir)
    assert kv is None and set(plan.formats) == {"attention", "experts"}
    assert notes == ["dense: not in this model", "shared: not in this model"]
    k2, _, _ = resolve(get_recipe("k2"), qwen_moe_dir)
    assert k2.formats["experts"].weight == "int4_g32" and k2.formats["experts"].act == "none"
    beam, _, _ = resolve(get_recipe("beam"), deepseek_v3_dir)
    assert not beam.lora and {f.act for f in beam.formats.values()} == {"mxfp8"}
    cfgs = loop_configs(get_recipe("ml4"), deepseek_v3_dir, ["published", "bitwise"])
    assert [c.name for c in cfgs] == ["published", "bitwise"]
    pub, bit = cfgs[0].trainer, cfgs[1].trainer
    assert pub.correction == "token_tis" and pub.correction_kwargs == {"cap": 2.0}
    assert pub.route_replay and cfgs[1].bitwise
    assert cfgs[0].numerics == cfgs[1].numerics == resolve(get_recipe("ml4"), deepseek_v3_dir)[0]
    assert (bit.eps_low, bit.eps_high, bit.lr) == (0.2, 0.28, 1e-2) and bit.use_support
    assert bit.correction is None and not bit.route_replay    # the engine's own logprobs and routes


def test_overrides_apply_and_bad_fields_are_refused():
    r = get_recipe("ml4", ["lora_rank=16", "experts=mxfp8/mxfp8", "tis_cap=none",
                           "attention=fp8_tensor_weight/fp8_tensor@0.05", "route_replay=false"])
    assert (r.numerics.lora_rank, r.spec("experts"), r.tis_cap, r.trainer.route_replay) == (16, "mxfp8/mxfp8", None, False)
    assert r.trainer.correction is None
    # a trainer field by its bare name (or trainer.FIELD); the plan's LoRA fields stay the recipe's
    t = get_recipe("k2", ["lr=1e-3", "trainer.eps_high=0.3", "tis_cap=3", "micro_batch_size=4"]).trainer
    assert (t.lr, t.eps_high, t.correction_kwargs, t.micro_batch_size) == (1e-3, 0.3, {"cap": 3.0}, 4)
    assert r.numerics.formats["attention"].act_scale == 0.05 and r.spec("attention") == "fp8_tensor_weight/fp8_tensor@0.05"
    assert "dense" not in get_recipe("ml4", ["dense=none/none"]).numerics.formats
    for bad, field in (("lora_rnk=3", "lora_rnk"), ("lora_rank=x", "lora_rank"),
                       ("experts=nvfp4", "experts"), ("experts=int3/none", "experts.weight"),
                       ("attention=fp8_tensor_weight/fp8_tensor", "attention.act_scale"),
                       ("kv_cache=fp4", "kv_cache"), ("kl_coef=0.1", "kl_coef"),
                       ("samples_per_prompt=1", "samples_per_prompt"), ("route_replay=maybe", "route_replay"),
                       ("eps_low=1.5", "eps_low"), ("tis_cap=0", "tis_cap"), ("qat=nvfp4", "qat"),
                       ("nofield", "recipe-set")):
        with pytest.raises(InputError) as e:
            get_recipe("ml4", [bad])
        assert field in str(e.value), (bad, str(e.value))
    with pytest.raises(InputError, match="unknown recipe"):
        get_recipe("ml5")
    assert set(SEED_RECIPES) == {"ml4", "k2", "beam"}


def test_what_does_not_apply_is_refused(qwen_moe_dir, tmp_path):
    with pytest.raises(InputError, match="kv_cache=fp8_latent needs an MLA model") as e:
        resolve(get_recipe("ml4"), qwen_moe_dir)
    assert e.value.field == "kv_cache"
    cfg = json.loads((qwen_moe_dir / "config.json").read_text())
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 40}))
    with pytest.raises(InputError, match=r"experts\.\d+\.down_proj.weight: nvfp4"):
        resolve(get_recipe("ml4", ["kv_cache=auto"]), odd)
    # an architecture with no batch-invariant family (Mixtral and the hybrids have one now)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(InputError, match="batch-invariant family"):
        resolve(get_recipe("k2"), other)


def test_published_trainer_rules_follow_the_plan(deepseek_v3_dir):
    plan, _, _ = resolve(get_recipe("ml4"), deepseek_v3_dir)
    kw = published_trainer_kwargs(plan)
    pats = {r.pattern: r for r in kw["qat"]}
    assert pats["model.layers.*.self_attn.kv_b_proj"].act_recipe is None     # absorbed: weight only
    assert pats["model.layers.*.mlp.experts"].recipe == "nvfp4"
    assert pats["model.layers.*.mlp.experts"].act_opts["convention"] == "vllm"
    assert pats["model.layers.*.self_attn.*_proj"].act_recipe == "fp8_token"
    assert kw["lora_rank"] == 32 and "*.self_attn.kv_a_proj_with_mqa" in kw["lora_patterns"]
    assert not any("kv_b_proj" in t for t in kw["lora_patterns"])
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.quant import apply_qat

    hf = load_hf_model(deepseek_v3_dir, dtype="float32")
    done = apply_qat(hf, published_trainer_kwargs(plan, hf)["qat"])   # every rule hits
    assert any(k.endswith("mlp.experts") for k in done)
    # MLA's kv_a_proj_with_mqa is served in the attention's formats: the trainer quantizes it too
    assert done["model.layers.0.self_attn.kv_a_proj_with_mqa"] == ["weight:fp8_channel", "input:fp8_token"]


def test_published_rules_fit_a_gqa_model(qwen_moe_dir):
    """The MLA-only rules are left out on a GQA model (apply_qat refuses a rule matching nothing):
    the published trainer of ml4 / beam builds on Qwen3-MoE."""
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.quant import apply_qat

    for name, sets in (("ml4", ["kv_cache=auto"]), ("beam", [])):
        plan, _, _ = resolve(get_recipe(name, sets), qwen_moe_dir)
        hf = load_hf_model(qwen_moe_dir, dtype="float32")
        rules = published_trainer_kwargs(plan, hf)["qat"]
        assert not any("kv_b_proj" in r.pattern or "mqa" in r.pattern for r in rules)
        done = apply_qat(hf, rules)
        assert "model.layers.0.self_attn.q_proj" in done and "model.layers.1.mlp.experts" in done


@pytest.mark.parametrize("argv, field", [
    (["--recipe", "ml4", "--recipe-set", "lora_rank=-3"], "lora_rank"),
    (["--recipe", "ml4"], "kv_cache"),                                   # the tiny Qwen3 is GQA
    (["--recipe", "k2", "--configs", "aligned"], "configs"),
    (["--recipe-set", "lora_rank=4"], "recipe-set"),
    (["--recipe", "k2", "--kv-cache", "fp8"], "recipe"),
    (["--recipe", "k2", "--backend", "megatron"], "backend"),
])
def test_cli_refuses_with_one_line_before_any_engine(argv, field, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["train", "--out", str(out), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err
    assert not out.exists() or not any(out.iterdir())


def test_a_vendor_quantized_base_keeps_its_own_formats(qwen_moe_dir):
    """``--model DIR`` a vendor quantized (compressed-tensors INT4, written by compressed-tensors'
    own compressor): the bitwise plan serves the stored codes with the recipe's LoRA; a full
    fine-tune and the published (HF) trainer are refused naming the field."""
    from skyrl_numerics.engine.serving_checkpoint import write_int4_checkpoint

    q = write_int4_checkpoint(qwen_moe_dir, experts=True)
    plan, kv, notes = resolve(get_recipe("ml4", ["kv_cache=auto"]), q)
    assert plan.formats["experts"].weight == "int4_g32" and plan.formats["attention"].weight == "int4_g32"
    assert plan.lora_rank == 32 and "experts" in plan.lora_targets
    assert any("checkpoint's own (compressed-tensors)" in n for n in notes), notes
    (cfg,) = loop_configs(get_recipe("k2"), q, ["bitwise"])
    assert cfg.numerics == resolve(get_recipe("k2"), q)[0]
    with pytest.raises(InputError, match="set lora_rank") as e:
        resolve(get_recipe("beam"), q)
    assert e.value.field == "lora_rank"
    with pytest.raises(InputError, match="run --configs bitwise"):
        loop_configs(get_recipe("k2"), q, ["published", "bitwise"])
