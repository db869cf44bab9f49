"""Trained tiny checkpoints: deterministic bytes given the seed, cached by content key, and better
than the random-weight model on held-out task prompts."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from skyrl_numerics import copy_task
from skyrl_numerics.errors import InputError
from skyrl_numerics.models import build_tiny_model, load_hf_model
from skyrl_numerics.rollout.prompts import make_prompts
from skyrl_numerics.trained_models import PretrainRecipe, build_trained_model

# a few steps: enough to check determinism and the cache, cheap
TINY = PretrainRecipe(steps=3, batch=4, seq_len=12, max_prefix=8, eval_batch=4, warmup=2)


def test_same_seed_same_bytes_other_seed_or_recipe_differs(tmp_path):
    a = build_trained_model("qwen3_moe", recipe=TINY, cache_dir=tmp_path / "a")
    b = build_trained_model("qwen3_moe", recipe=TINY, cache_dir=tmp_path / "b")
    assert a.name == b.name
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c = build_trained_model("qwen3_moe", recipe=TINY, seed=1, cache_dir=tmp_path / "a")
    assert c != a and (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    d = build_trained_model("qwen3_moe", recipe=PretrainRecipe(**{**TINY.__dict__, "lr": 1e-3}),
                            cache_dir=tmp_path / "a")
    assert d != a
    mtime = (a / "model.safetensors").stat().st_mtime_ns      # reused, not rebuilt
    assert build_trained_model("qwen3_moe", recipe=TINY, cache_dir=tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    # the same config as the random-weight tiny model, only the weights moved
    tiny = build_tiny_model("qwen3_moe", cache_dir=tmp_path / "t")
    assert json.loads((a / "config.json").read_text()) == json.loads((tiny / "config.json").read_text())
    sa, st = load_hf_model(a).state_dict(), load_hf_model(tiny).state_dict()
    assert sa.keys() == st.keys()
    assert not torch.equal(sa["model.embed_tokens.weight"], st["model.embed_tokens.weight"])


def test_unknown_family_and_bad_recipe_are_refused():
    with pytest.raises(InputError, match="no trained tiny model") as e:
        build_trained_model("mixtral")
    assert e.value.field == "family"
    with pytest.raises(InputError, match="max_prefix"):
        PretrainRecipe(seq_len=8, max_prefix=16)


def _greedy_accuracy(model_dir, prompts, n_new=8) -> float:
    """Share of greedily generated tokens equal to the task's continuation (HF, bf16)."""
    model = load_hf_model(model_dir)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(n_new):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    gen = ids[:, len(prompts[0]):].numpy()
    return float(np.mean([copy_task.hits(p, g).mean() for p, g in zip(prompts, gen)]))


def test_trained_beats_random_on_held_out_prompts(tmp_path):
    """The default recipe (the checkpoint the doctor's and train's ``--trained`` use, built once in
    the session cache, ~1 min of one core): on the doctor's / loop's seeded random prompts (never
    seen in training) the trained model continues the task far better than its random start
    (~1/512), and its held-out next-token entropy is peaked (competent, not yet perfect)."""
    d = build_trained_model("qwen3_moe")
    meta = json.loads((d / "skyrl_numerics.json").read_text())["trained"]
    assert meta["before"]["entropy_nats"] > 5.5 and meta["after"]["entropy_nats"] < 1.5
    assert meta["before"]["accuracy"] < 0.05 < 0.5 < meta["after"]["accuracy"]
    prompts = make_prompts(32, 8, 512, seed=12345)
    trained = _greedy_accuracy(d, prompts)
    random_start = _greedy_accuracy(build_tiny_model("qwen3_moe", cache_dir=tmp_path / "r"), prompts)
    assert random_start < 0.05 and trained > 0.5, (trained, random_start)


@pytest.mark.parametrize("argv", [
    ["doctor", "--trained", "--model", "{tmp}"],
    ["doctor", "--trained", "--family", "mixtral"],
    ["train", "--trained", "--server", "http://127.0.0.1:9"],
])
def test_cli_trained_refusals_exit_2_one_line(tmp_path, argv, capsys):
    from skyrl_numerics.cli import main

    out = tmp_path / "out"
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--out", str(out)]) == 2
    cap = capsys.readouterr()
    lines = [ln for ln in (cap.out + cap.err).splitlines() if ln.strip()]
    assert len(lines) == 1 and ("trained" in lines[0] or "family" in lines[0]), lines
    assert not out.exists()
