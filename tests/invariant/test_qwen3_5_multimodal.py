"""The hub's Qwen3.5 checkpoints (``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration``: ``text_config`` + ``vision_config``, weights
``model.language_model.*``, ``model.visual.*``, ``lm_head.*``) on the trainer's invariant path,
text only: built and saved by transformers 5.19's own classes, read by ``from_checkpoint`` as the
text family, with the same logits bit for bit as the text-only checkpoint of the same weights."""
from __future__ import annotations

import json

import pytest
import torch

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import FAMILIES, from_checkpoint
from skyrl_numerics.invariant.multimodal import TEXT_ARCHITECTURE
from hf_agreement import token_ids
from qwen3_5_hub import MROPE, MULTIMODAL, build_pair


def _stored_names(d) -> set:
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("q35vl")
    out = {(f, dt): build_pair(root / str(dt).split(".")[1], f, dt)
           for f in MULTIMODAL for dt in (torch.float32, torch.bfloat16)}
    # tied embeddings (the small Qwen3.5 models): no lm_head.weight in the checkpoint
    out[("qwen3_5", "tied")] = build_pair(root / "tied", "qwen3_5", torch.bfloat16,
                                          tie_word_embeddings=True)
    return out


@pytest.mark.parametrize("family", list(MULTIMODAL))
def test_hub_layout_is_transformers_own(pairs, family):
    hub, txt = pairs[(family, torch.bfloat16)]
    cfg = json.loads((hub / "config.json").read_text())
    assert cfg["architectures"] == [MULTIMODAL[family][1]]
    assert {"text_config", "vision_config"} <= set(cfg)
    names = _stored_names(hub)
    assert "lm_head.weight" in names and "model.language_model.embed_tokens.weight" in names
    assert any(n.startswith("model.visual.") for n in names)
    assert not any(n.startswith("model.layers.") for n in names)
    assert json.loads((txt / "config.json").read_text())["architectures"] == [
        TEXT_ARCHITECTURE[MULTIMODAL[family][1]]]


@pytest.mark.parametrize("family, dtype", [(f, dt) for f in MULTIMODAL
                                           for dt in (torch.float32, torch.bfloat16)]
                         + [("qwen3_5", "tied")])
def test_logits_are_the_text_checkpoints_bit_for_bit(pairs, family, dtype):
    """The hub checkpoint gives the text family (vision tower not loaded) and the same logits,
    every bit, as the text-only checkpoint of the same weights, in the checkpoint's dtype (also
    with tied embeddings)."""
    hub, txt = pairs[(family, dtype)]
    if dtype == "tied":
        assert "lm_head.weight" not in _stored_names(hub)
        dtype = torch.bfloat16
    a, b = from_checkpoint(hub, dtype=dtype), from_checkpoint(txt, dtype=dtype)
    assert type(a) is MULTIMODAL[family][2] and type(b) is type(a)
    assert sorted(a.hf_names()) == sorted(b.hf_names())
    ids = token_ids(48, 3)
    with torch.no_grad():
        la, lb = a.logits(a.sequence_hidden(ids)), b.logits(b.sequence_hidden(ids))
    assert la.dtype == lb.dtype and torch.equal(la, lb)
    assert la.float().abs().max() > 0


def test_the_family_is_the_text_architectures():
    for mm, text in TEXT_ARCHITECTURE.items():
        assert FAMILIES[mm] == FAMILIES[text]


def test_a_language_model_weight_the_family_lacks_is_refused(pairs, tmp_path):
    """Only ``model.visual.*`` is skipped: another stray tensor is still an error naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    hub, _ = pairs[("qwen3_5", torch.bfloat16)]
    d = tmp_path / "extra"
    shutil.copytree(hub, d)
    t = load_file(str(d / "model.safetensors"))
    t["model.language_model.layers.0.stray.weight"] = torch.zeros(2)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError) as e:
        from_checkpoint(d)
    assert e.value.field == "model.layers.0.stray.weight"


def test_engine_config_is_the_text_model_without_mrope(tmp_path):
    """vLLM's own ModelConfig of the hub checkpoint under the engine's ``hf_overrides``: the
    invariant model's architecture, not multimodal (no vision processor, no torchvision), and its
    text config's M-RoPE sections gone (vLLM merges a nested override key by key: they are set
    to None), so vLLM hands the model plain token positions; the rest of rope_parameters kept."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides
    from skyrl_numerics.engine.vllm_plugin import register

    register()
    hub, _ = build_pair(tmp_path, "qwen3_5_moe", torch.bfloat16, **MROPE)
    raw = json.loads((hub / "config.json").read_text())
    assert raw["text_config"]["rope_parameters"]["mrope_section"] == [3, 3, 2]
    over = engine_overrides(raw)
    mc = ModelConfig(model=str(hub), hf_overrides=over, skip_tokenizer_init=True,
                     dtype="bfloat16")
    assert mc.architectures == ["SkyrlInvariantQwen3_5MoeForConditionalGeneration"]
    assert not mc.is_multimodal_model and not mc.uses_mrope
    rp = mc.hf_text_config.rope_parameters
    assert rp.get("mrope_section") is None and not rp.get("mrope_interleaved")
    assert rp["partial_rotary_factor"] == 0.25 and rp["rope_theta"] == 10000.0


def test_the_top_level_tie_word_embeddings_is_the_one_honoured():
    """transformers' multimodal model ties by the top-level field, whatever text_config says:
    the text config the family reads (trainer and engine) carries the top level's."""
    import transformers

    from skyrl_numerics.invariant.multimodal import text_config, text_fields
    from skyrl_numerics.models import tiny_config
    from qwen3_5_hub import VISION

    text = {k: v for k, v in tiny_config("qwen3_5", tie_word_embeddings=True).items()
            if k != "architectures"}
    for top in (False, True):
        cfg = transformers.Qwen3_5Config(text_config=dict(text, tie_word_embeddings=not top),
                                         vision_config=VISION, tie_word_embeddings=top)
        cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
        m = transformers.Qwen3_5ForConditionalGeneration(cfg)
        tied = m.lm_head.weight is m.model.language_model.embed_tokens.weight
        assert tied == top
        assert text_config(cfg).tie_word_embeddings == top
        assert text_fields(cfg.to_dict())["tie_word_embeddings"] == top
        assert cfg.text_config.tie_word_embeddings == (not top)     # not changed in place


def test_stock_vllm_without_torchvision_is_refused_and_the_invariant_command_built(pairs, capsys):
    """vLLM's own multimodal Qwen3.5 imports torchvision: where it does not import, a stock
    serve of the hub checkpoint is refused in one line naming it, before any engine starts; the
    batch-invariant serve command names the invariant model of the multimodal architecture."""
    pytest.importorskip("vllm")
    from skyrl_numerics.cli import main
    from skyrl_numerics.engine.arch_check import missing_stock_import

    hub, _ = pairs[("qwen3_5_moe", torch.bfloat16)]
    why = missing_stock_import("Qwen3_5MoeForConditionalGeneration")
    if why is None:
        pytest.skip("torchvision imports here: stock vLLM can load its Qwen3.5 module")
    assert main(["serve", str(hub), "--print-command"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0] and "Qwen3_5MoeForConditionalGeneration" in err[0], err
    assert main(["serve", str(hub), "--batch-invariant", "--print-command"]) == 0
    assert "SkyrlInvariantQwen3_5MoeForConditionalGeneration" in capsys.readouterr().out


def test_a_lora_plan_sees_the_text_models_adapters(pairs):
    """A LoRA plan for the hub config: the adapters are the text checkpoint's (the shapes an
    engine of either serves), checked on the multimodal config.json as it is."""
    from skyrl_numerics.invariant.numerics import NumericsPlan, check_plan_for_config, plan_adapter_shapes

    hub, txt = pairs[("qwen3_5_moe", torch.bfloat16)]
    plan = NumericsPlan(formats={}, lora_rank=4, lora_alpha=8.0,
                        lora_targets=("attention", "experts"))
    mm, text = (json.loads((d / "config.json").read_text()) for d in (hub, txt))
    check_plan_for_config(plan, mm)
    shapes = plan_adapter_shapes(plan, mm)
    assert shapes and shapes == plan_adapter_shapes(plan, text)


def test_the_engines_checkpoint_names_are_the_text_models(pairs):
    """What a weight sync may send to an engine of the hub checkpoint: the text checkpoint's
    names (the trainer's), the vision tower's left out."""
    from skyrl_numerics.sync.load_blocks import checkpoint_names

    hub, txt = pairs[("qwen3_5_moe", torch.bfloat16)]
    assert checkpoint_names(hub) == checkpoint_names(txt) == frozenset(_stored_names(txt))
    assert not any(n.startswith("model.visual.") for n in checkpoint_names(hub))
    # what restoring the engine's own weights sends (trainer/workers.py): those names, those bits
    from safetensors.torch import load_file

    from skyrl_numerics.invariant.multimodal import text_weights

    own = text_weights(json.loads((hub / "config.json").read_text()),
                       load_file(str(hub / "model.safetensors")))
    twin = load_file(str(txt / "model.safetensors"))
    assert set(own) == set(twin) and all(torch.equal(own[k], twin[k]) for k in twin)


def test_the_doctor_reads_the_language_model_of_a_hub_checkpoint(pairs, tmp_path):
    """What the doctor checks before any engine starts, on the hub checkpoint: its language
    model's layers, vocabulary and experts (text_config's, the weights under
    ``model.language_model.``), the engine memory plan and a seed recipe's plan — the same as on
    the text-only twin; a hub checkpoint missing a language-model layer is refused naming
    ``num_hidden_layers``."""
    from safetensors.torch import load_file, save_file

    from skyrl_numerics.doctor.engine_memory import plan_table
    from skyrl_numerics.doctor.model_check import inspect_checkpoint
    from skyrl_numerics.doctor.rows import ROWS
    from skyrl_numerics.trainer.seed_recipes import get_recipe, resolve

    hub, txt = pairs[("qwen3_5_moe", torch.bfloat16)]
    h, t = inspect_checkpoint(hub), inspect_checkpoint(txt)
    assert h.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert (h.vocab_size, h.num_experts) == (t.vocab_size, t.num_experts) and h.num_experts > 1
    assert h.model_config["num_hidden_layers"] == t.config["num_hidden_layers"]
    rows = [r for r in ROWS if r.name == "+ batch-invariant (trainer and vLLM)"]
    kw = dict(n_prompts=4, seq_len=64, free=8 << 30, total=16 << 30, on_gpu=False)
    (_, _, need_h), (_, _, need_t) = (plan_table(i, rows, {"dtype": "bfloat16"}, **kw)
                                      for i in (h, t))
    assert need_h == need_t
    assert resolve(get_recipe("beam"), hub)[:2] == resolve(get_recipe("beam"), txt)[:2]

    bad = tmp_path / "missing-layer"
    bad.mkdir()
    (bad / "config.json").write_text((hub / "config.json").read_text())
    last = h.model_config["num_hidden_layers"] - 1
    save_file({k: v for k, v in load_file(str(hub / "model.safetensors")).items()
               if not k.startswith(f"model.language_model.layers.{last}.")},
              str(bad / "model.safetensors"))
    with pytest.raises(InputError, match=f"no model.layers.{last}") as e:
        inspect_checkpoint(bad, count_params=False)
    assert e.value.field == "num_hidden_layers"
