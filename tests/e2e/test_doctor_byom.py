"""`doctor --model DIR` on checkpoints written here with plain transformers ``save_pretrained``
(dimensions the package never uses), a dense fp32 model, an MoE bf16 one and a GLM-4.5-style
one, and `--family mixtral`, against the real vLLM CPU engine; plus the quiet terminal.

Each test starts its own engines (other model dirs than the session fixtures); they are closed
at the end of the test.
"""
from __future__ import annotations

import json

import pytest

from skyrl_numerics.cli import main

pytestmark = pytest.mark.vllm


def _save(cfg, path, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(getattr(torch, dtype)) \
        .save_pretrained(path)
    return path


def _word_tokenizer(path, vocab_size: int):
    """A word-level tokenizer saved next to the weights (built here, nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(path)


@pytest.fixture
def closes_engines():
    """Close the engines a test's doctor run left in the generator cache."""
    from skyrl_numerics.engine import generator

    before = set(generator._CACHE)
    yield
    for key in set(generator._CACHE) - before:
        generator._CACHE.pop(key).close()


def _rows(out):
    rep = json.loads((out / "report.json").read_text())
    return rep, {r["name"]: r for r in rep["rows"]}


def test_dense_fp32_user_model(tmp_path, capfd, closes_engines):
    from transformers import LlamaConfig

    d = _save(LlamaConfig(vocab_size=384, hidden_size=192, intermediate_size=320,
                          num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
                          head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
                          bos_token_id=0, eos_token_id=1), tmp_path / "llama", "float32")
    _word_tokenizer(d, 384)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('[5, 6, 7, 8, 9]\n{"prompt": "w10 w11 w12 w300"}\n"w7 w8"\n')
    out = tmp_path / "out"
    rows = ["baseline: HF trainer, bf16", "+ R3 (router replay)",
            "top-p 0.95 only: + support replay", "+ batch-invariant (trainer and vLLM)",
            "nvfp4 experts: plain bf16 trainer"]
    capfd.readouterr()
    rc = main(["doctor", "--model", str(d), "--prompts-file", str(prompts), "--max-tokens", "12",
               "--out", str(out), "--no-progress", "--engine-arg", "max_num_seqs=2",
               *[a for r in rows for a in ("--row", r)]])
    term = capfd.readouterr()
    assert rc == 0, term
    rep, by = _rows(out)
    assert rep["model"]["path"] == str(d) and rep["model"]["architecture"] == "LlamaForCausalLM"
    assert rep["model"]["moe"] is False and len(rep["model"]["config_hash"]) == 16
    assert rep["settings"]["engine_args"] == {"max_num_seqs": 2, "dtype": "float32",
                                              "max_model_len": 256}
    base = by["baseline: HF trainer, bf16"]
    assert base["status"] == "measured" and base["summary"]["n_tokens"] == 3 * 12
    assert base["summary"]["mean_abs"] < 0.05
    assert by["top-p 0.95 only: + support replay"]["status"] == "measured"
    assert by["+ R3 (router replay)"]["status"].startswith("skipped: dense model")
    # the dense family serves this float32 Llama: engine and invariant trainer in float32
    # (the trainer follows the engine's contract), every token equal
    inv = by["+ batch-invariant (trainer and vLLM)"]
    assert inv["status"] == "measured" and inv["summary"]["frac_bitwise_equal"] == 1.0, inv["status"]
    assert inv["contract"]["engine"]["dtype"] == inv["contract"]["trainer"]["dtype"] == "float32"
    assert by["nvfp4 experts: plain bf16 trainer"]["status"].startswith("skipped: dense model")
    assert by["+ R3 (router replay)"]["summary"] == {}
    # the table shows the skipped rows and names the model; nothing of vLLM's reaches the terminal
    # (the status column may wrap inside a cell: its words, not the whole phrase)
    assert "skipped:" in term.out and "dense" in term.out and "LlamaForCausalLM" in term.out
    assert str(out / "vllm.log") in term.out
    for noise in ("INFO", "WARNING", "Tokenizer not available", "Failed to load", "Traceback"):
        assert noise not in term.out and noise not in term.err, noise
    log = (out / "vllm.log").read_text()
    assert "Initializing a V1 LLM engine" in log and "(Worker" in log
    # the warm-up traceback is filtered at its source, not just hidden from the terminal
    assert "Chat template warmup failed" not in log and "Tokenizer not available" not in log


def _user_qwen3_moe(path):
    from transformers import Qwen3MoeConfig

    return _save(Qwen3MoeConfig(vocab_size=400, hidden_size=96, intermediate_size=160,
                             moe_intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=64, num_experts=6,
                             num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[],
                             max_position_embeddings=512, tie_word_embeddings=False,
                             bos_token_id=0, eos_token_id=1), path, "bfloat16")


def test_moe_bf16_user_model(tmp_path, closes_engines):
    """A user's Qwen3-MoE (6 experts, top-3, no top-k renormalization): the stock rows on vLLM's
    own Qwen3-MoE, and the model fits the invariant registry, so its bitwise row runs (one doctor
    run for both)."""
    d = _user_qwen3_moe(tmp_path / "moe")
    out = tmp_path / "out"
    bitwise = "+ batch-invariant (trainer and vLLM)"
    rows = ["baseline: HF trainer, bf16", "+ R3 (router replay)",
            "top-p 0.95 only: HF trainer, full-vocab", "top-p 0.95 only: + support replay",
            "top-p 0.95 only: + support replay + R3", bitwise]
    assert main(["doctor", "--model", str(d), "--prompts", "3", "--max-tokens", "16",
                 "--out", str(out), "--no-progress",
                 *[a for r in rows for a in ("--row", r)]]) == 0
    rep, by = _rows(out)
    assert rep["model"]["moe"] is True and rep["model"]["num_experts"] == 6
    s = {n: r["summary"] for n, r in by.items()}
    assert all(r["status"] == "measured" for r in by.values()), {n: r["status"] for n, r in by.items()}
    assert s["+ R3 (router replay)"]["max_abs"] <= s["baseline: HF trainer, bf16"]["max_abs"]
    # measured: 5.0e-2 -> 2.5e-3 (3 x 16 tokens)
    full, rep_ = s["top-p 0.95 only: HF trainer, full-vocab"], s["top-p 0.95 only: + support replay"]
    assert rep_["mean_abs"] < 0.2 * full["mean_abs"]
    assert s[bitwise]["frac_bitwise_equal"] == 1.0 and s[bitwise]["max_abs"] == 0.0


def test_mixtral_family(tmp_path, closes_engines):
    out = tmp_path / "out"
    rows = ["baseline: HF trainer, bf16", "+ R3 (router replay)",
            "top-p/top-k: HF trainer, full-vocab", "top-p/top-k: + support replay + R3",
            "int4 experts: plain bf16 trainer"]
    assert main(["doctor", "--family", "mixtral", "--prompts", "4", "--max-tokens", "24",
                 "--out", str(out), "--no-progress",
                 *[a for r in rows for a in ("--row", r)]]) == 0
    rep, by = _rows(out)
    assert rep["model"]["architecture"] == "MixtralForCausalLM"
    s = {n: r["summary"] for n, r in by.items()}
    base, r3 = s["baseline: HF trainer, bf16"], s["+ R3 (router replay)"]
    # routes captured in vLLM's Mixtral and replayed into HF's MixtralTopKRouter: the routing
    # flips behind the tail go (measured 0.099 -> 0.015 max |Δ|, 4 x 24 tokens)
    assert r3["max_abs"] < base["max_abs"] and r3["mean_abs"] < base["mean_abs"]
    trunc, both = s["top-p/top-k: HF trainer, full-vocab"], s["top-p/top-k: + support replay + R3"]
    assert both["mean_abs"] < 0.05 * trunc["mean_abs"]
    assert "*.mlp.experts" in by["int4 experts: plain bf16 trainer"]["status"]


def test_glm4_moe_user_model_r3(tmp_path, closes_engines):
    """A user's GLM-4.5-style checkpoint (transformers' own ``Glm4MoeConfig``: partial RoPE,
    q/k norm, biases, sigmoid grouped router with a correction bias, a shared expert, a dense
    first layer): the stock rows run on vLLM's own Glm4-MoE and R3 replays its routes into HF's
    ``Glm4MoeTopkRouter``. (The glm4_moe family's engine == trainer, bitwise, is
    tests/e2e/test_moe_families_vllm.py's: a second engine here would check it again.)"""
    import torch
    from transformers import Glm4MoeConfig

    cfg = Glm4MoeConfig(vocab_size=400, hidden_size=96, intermediate_size=160,
                        moe_intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=64, n_routed_experts=6,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                        routed_scaling_factor=2.0, first_k_dense_replace=1, use_qk_norm=True,
                        attention_bias=True, max_position_embeddings=512,
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    d = tmp_path / "glm"
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():                # HF zeroes biases and the correction bias
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.05)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.01)
    m.to(torch.bfloat16).save_pretrained(d)
    out = tmp_path / "out"
    rows = ["baseline: HF trainer, bf16", "+ R3 (router replay)"]
    assert main(["doctor", "--model", str(d), "--prompts", "3", "--max-tokens", "16",
                 "--out", str(out), "--no-progress",
                 *[a for r in rows for a in ("--row", r)]]) == 0
    rep, by = _rows(out)
    assert rep["model"]["architecture"] == "Glm4MoeForCausalLM" and rep["model"]["moe"] is True
    assert all(r["status"] == "measured" for r in by.values()), {n: r["status"] for n, r in by.items()}
    s = {n: r["summary"] for n, r in by.items()}
    assert s["+ R3 (router replay)"]["max_abs"] <= s["baseline: HF trainer, bf16"]["max_abs"]
