"""`doctor --model DIR` bad input: one line naming the problem, exit 2, nothing written, no engine.

Checkpoints are written here with plain transformers ``save_pretrained`` (not the package's
builder), with dimensions the package never uses.
"""
from __future__ import annotations

import json

import pytest

from skyrl_numerics.cli import main


@pytest.fixture(autouse=True)
def _default_engine_share(monkeypatch):
    """These tests model the engines' default share of RAM (0.1): without the suite's smaller one
    (tests/conftest.py)."""
    monkeypatch.delenv("SKYRL_NUMERICS_CPU_MEMORY_SHARE", raising=False)

pytest.importorskip("vllm")  # the architecture check reads vLLM's model registry (no engine)


def _save(model_cls_cfg, path, dtype="float32", **kw):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = model_cls_cfg(**kw)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(getattr(torch, dtype))
    m.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    from transformers import LlamaConfig

    return _save(LlamaConfig, tmp_path_factory.mktemp("ck") / "llama", vocab_size=300,
                 hidden_size=128, intermediate_size=96, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                 max_position_embeddings=128)


def _run(capsys, *argv):
    capsys.readouterr()  # drop what writing the checkpoints printed
    rc = main(["doctor", "--no-progress", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


def _bad(capsys, tmp_path, argv, *needles):
    out = tmp_path / "out"
    rc, err = _run(capsys, *argv, "--out", str(out))
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    for n in needles:
        assert n in err[0], err[0]
    assert not out.exists(), "bad input must write nothing"
    return err[0]


def test_not_a_directory_or_checkpoint(tmp_path, capsys):
    _bad(capsys, tmp_path, ["--model", str(tmp_path / "nope")], "no such directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _bad(capsys, tmp_path, ["--model", str(empty)], "no config.json")
    (empty / "config.json").write_text("{not json")
    _bad(capsys, tmp_path, ["--model", str(empty)], "config.json is not valid JSON")
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _bad(capsys, tmp_path, ["--model", str(empty)], "architectures")
    (empty / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300,
                                                   "architectures": ["LlamaForCausalLM"]}))
    _bad(capsys, tmp_path, ["--model", str(empty)], "no weight files")
    (empty / "model.safetensors").write_bytes(b"\xff" * 12)
    _bad(capsys, tmp_path, ["--model", str(empty)], "model.safetensors is not a readable")


def test_architecture_vllm_cannot_run(tmp_path, capsys):
    from transformers import BioGptConfig

    d = _save(BioGptConfig, tmp_path / "biogpt", vocab_size=200, hidden_size=64,
              num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    line = _bad(capsys, tmp_path, ["--model", str(d)], "BioGptForCausalLM",
                "not one vLLM", "field 'architectures'")
    assert "model_impl" in line


def test_config_transformers_cannot_build(tmp_path, capsys, dense_dir):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(dense_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_attention_heads"] = 0      # LlamaForCausalLM exists in vLLM; the config is broken
    (d / "config.json").write_text(json.dumps(cfg))
    _bad(capsys, tmp_path, ["--model", str(d)], "transformers cannot build this config")


def test_model_that_will_not_fit(tmp_path, capsys, monkeypatch):
    """A 70B-class config (no real weights needed: the estimate comes from config.json), on a
    machine with 64 GiB available (whatever this one has)."""
    import torch

    from skyrl_numerics.doctor import engine_memory

    monkeypatch.setattr(engine_memory, "free_memory", lambda: (128 << 30, 64 << 30))
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    d = tmp_path / "big"
    LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                dtype="bfloat16", architectures=["LlamaForCausalLM"]).save_pretrained(d)
    save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
    line = _bad(capsys, tmp_path, ["--model", str(d)], "will not fit in memory", "GiB available",
                "field 'memory'")
    # Llama-3-70B's 70,553,706,496 parameters (the meta model's count) x 2 B = 131.4 GiB
    assert "stock engine bfloat16" in line and "weights 131.4 GiB" in line, line
    # the trainer copy: the same 131.4 GiB of bf16 parameters (+ rotary buffers) and the
    # scoring work, 3 fp32 [1024, 128256] logit blocks (1.5 GiB) -> 132.9 GiB
    assert "trainer bfloat16 copy 132.9 GiB with its scoring" in line, line
    assert "64.0 GiB available" in line, line


def test_prompts_file_errors(tmp_path, capsys, dense_dir):
    f = tmp_path / "p.jsonl"
    cases = [
        ("[3, 4]\n{oops\n", "line 2: not valid JSON"),
        ("[3, 4]\n[5, 300]\n", "line 2: token id 300 outside the vocabulary [0, 300)"),
        ("[3, -1]\n", "line 1: token id -1 outside"),
        ('[3, 4.5]\n', "line 1: token id 4.5 is not an integer"),
        ('[true]\n', "is not an integer"),
        ('"hello"\n', "has no tokenizer"),
        ('{"foo": [1]}\n', "expected one of 'prompt_token_ids'"),
        ("[]\n", "line 1: empty prompt"),
        ("\n\n", "no prompts in the file"),
        (json.dumps(list(range(2, 120))) + "\n", "exceeds max_model_len 128"),
    ]
    for text, needle in cases:
        f.write_text(text)
        line = _bad(capsys, tmp_path, ["--model", str(dense_dir), "--prompts-file", str(f),
                                       "--max-tokens", "16"], needle)
        assert str(f) in line
    _bad(capsys, tmp_path, ["--model", str(dense_dir), "--prompts-file", str(tmp_path / "none")],
         "no such file")


def test_engine_args_and_options(tmp_path, capsys, dense_dir):
    _bad(capsys, tmp_path, ["--model", str(dense_dir), "--engine-arg", "novalue"],
         "expected KEY=VALUE")
    _bad(capsys, tmp_path, ["--model", str(dense_dir), "--engine-arg", "not_an_arg=1"],
         "unknown vLLM engine argument 'not_an_arg'")
    _bad(capsys, tmp_path, ["--model", str(dense_dir), "--family", "qwen3_moe"], "not both")
    _bad(capsys, tmp_path, ["--model", str(dense_dir), "--prompt-len", "100", "--max-tokens", "64"],
         "exceeds max_model_len 128")
    err = _bad(capsys, tmp_path, ["--model", str(dense_dir), "--row", "baseline: HF trainer, bf16",
                                  "--row", "batch-invariant"], "unknown doctor row 'batch-invariant'",
               "field 'row', index 1", "'+ batch-invariant (trainer and vLLM)'")


def test_engine_arg_values_are_json():
    from skyrl_numerics.cli import _parse_engine_args

    got = _parse_engine_args(["enable-prefix-caching=true", "max_num_seqs=4",
                              'hf_overrides={"a": [1, 2]}', "kv_cache_dtype=auto", 'x="7"'])
    assert got == {"enable_prefix_caching": True, "max_num_seqs": 4,
                   "hf_overrides": {"a": [1, 2]}, "kv_cache_dtype": "auto", "x": "7"}


def test_inspect_names_the_model(dense_dir):
    from skyrl_numerics.doctor.model_check import config_hash, inspect_checkpoint

    info = inspect_checkpoint(dense_dir)
    cfg = json.loads((dense_dir / "config.json").read_text())
    assert info.architecture == "LlamaForCausalLM" and not info.is_moe
    assert info.config_hash == config_hash(cfg) and len(info.config_hash) == 16
    assert info.stored_dtype == "float32" and info.vocab_size == 300
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    assert info.params == sum(p.numel() for p in m.parameters())


def test_check_memory_is_the_plans_arithmetic(dense_dir):
    """The least a run needs is its baseline row run alone: max(stock engine, trainer copy) +
    headroom, with the engine sized as engine_memory sizes it (weights from the headers, the
    run's KV cache, overhead) — a row-by-row check, not the sum of every copy."""
    from skyrl_numerics.doctor import engine_memory as em
    from skyrl_numerics.errors import InputError
    from skyrl_numerics.doctor.model_check import check_memory, inspect_checkpoint

    info = inspect_checkpoint(dense_dir)
    kw = dict(engine_dtype="bfloat16", n_prompts=4, seq_len=96, max_model_len=256,
              engine_args={"kv_cache_memory_bytes": 1 << 20}, available=1 << 40, total=1 << 41)
    eng = em.engine_need(info.config, info.params, dtype="bfloat16", n_prompts=4, seq_len=96,
                         max_model_len=256)
    weights = info.params * 2
    assert eng.weights == weights
    need = check_memory(info, trainer_dtype="bfloat16", **kw)
    assert need == weights + (1 << 20) + em.ENGINE_OVERHEAD + em.HEADROOM
    # a float32 trainer copy bigger than the engine is what the smallest row needs
    big = dict(kw, engine_args={"kv_cache_memory_bytes": 1})
    t32 = check_memory(info, trainer_dtype="float32", **big)
    assert t32 == max(weights + 1 + em.ENGINE_OVERHEAD, info.params * 4) + em.HEADROOM
    with pytest.raises(InputError, match="will not fit.*GiB available"):
        check_memory(info, trainer_dtype="bfloat16", **dict(kw, available=need - 1))
    assert check_memory(info, trainer_dtype="bfloat16", **dict(kw, available=need)) == need
    # the user's gpu_memory_utilization share is what the engine takes
    share = check_memory(info, trainer_dtype="bfloat16",
                         **dict(kw, engine_args={"gpu_memory_utilization": 0.5}, total=64 << 30))
    assert share == max(eng.total, 32 * (1 << 30) + em.ENGINE_OVERHEAD - em.WORKER_OVERHEAD) \
        + em.HEADROOM
