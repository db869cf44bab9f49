"""The layer-by-layer tracer on trainer sides (no engine): a one-ulp change planted in one layer's
weight is named as the first divergence (that layer; that op with ``per_op``), the same model
against itself shows none, the comparator's ulps and the CLI's files and input errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skyrl_numerics.cli import main
from skyrl_numerics.doctor.trace import Side, planted, run_trace
from skyrl_numerics.doctor.trace_compare import bf16_ulps
from skyrl_numerics.engine.trace_roles import canonical_order
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.models import load_hf_model

FAMILIES = ["qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def hf_models(request):
    """Two HF copies of each tiny family (one gets the planted change, put back after a test)."""
    out = {}
    for fam in FAMILIES:
        d = request.getfixturevalue(f"{'qwen_moe' if fam == 'qwen3_moe' else fam}_dir")
        out[fam] = (d, load_hf_model(d, dtype="bfloat16"), load_hf_model(d, dtype="bfloat16"))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layer", [0, 1])
def test_a_one_ulp_o_proj_change_is_named_as_its_layer_and_op(hf_models, family, layer):
    d, a, b = hf_models[family]
    w = b.model.layers[layer].self_attn.o_proj.weight
    i, old = planted(w)
    try:
        assert bf16_ulps(w.data.view(-1)[i:i + 1].float().numpy(),
                         old[None].float().numpy())[0] == 1      # one ulp moved
        per_op = run_trace(d, [Side("hf", "hf", a), Side("hf", "planted", b)], per_op=True,
                           keep_tensors=True)
        # the default (per layer) names the layer; once per family is enough
        per_layer = run_trace(d, [Side("hf", "hf", a), Side("hf", "planted", b)]) if layer else None
    finally:
        w.data.view(-1)[i] = old
    if per_layer is not None:
        assert per_layer.first.name == f"L{layer}.layer"
        assert [m.name for m in per_layer.comparison.modules] == ["embed", "L0.layer",
                                                                   "L1.layer", "norm", "logits"]
    layer_diffs = [m.name for m in per_op.comparison.modules
                   if m.name.endswith(".layer") and m.status == "differs"]
    assert layer_diffs[0] == f"L{layer}.layer"
    f = per_op.first
    assert f.name == f"L{layer}.attn"                      # o_proj's output, nothing before it
    # one weight moved by 1 ulp: one output column can move, by about one bf16 ulp of the
    # weight times its input (|x| < 8 here), so in a few rows and < 1 % of the elements
    assert 0 < f.rows_differing < f.rows
    ulp_w = 2.0 ** (np.floor(np.log2(abs(float(old)))) - 7)
    assert 0 < f.max_abs_delta <= 8 * ulp_w and 0 < f.frac_elements_differing < 0.01
    assert f.max_ulps_bf16 >= 1
    before = per_op.comparison.modules[:per_op.comparison.modules.index(f)]
    assert all(m.status in ("equal",) or m.status.startswith("only") for m in before)
    # the growth: every compared module after it
    assert per_op.comparison.growth[0] is f and per_op.comparison.growth[-1].name == "logits"


def test_an_expert_weight_change_in_the_invariant_trainer_is_named_as_its_moe_block(qwen_moe_dir):
    a, b = from_checkpoint(qwen_moe_dir), from_checkpoint(qwen_moe_dir)
    seqs = [[int(t) for t in np.random.default_rng(i).integers(2, 512, 16)] for i in range(3)]
    base = run_trace(qwen_moe_dir, [Side("invariant", "a", a), Side("invariant", "b", a)],
                     per_op=True, keep_tensors=True, sequences=seqs)
    assert base.first is None
    # the expert the first token of sequence 0 routes to in layer 1
    ids = base.comparison.a.modules["L1.router_ids"].seqs[0]["rows"][0]
    expert = int(ids[0])
    planted(b.w(f"model.layers.1.mlp.experts.{expert}.down_proj.weight"))
    got = run_trace(qwen_moe_dir, [Side("invariant", "a", a), Side("invariant", "planted", b)],
                    per_op=True, sequences=seqs)
    assert got.first.name == "L1.mlp"
    by = {m.name: m for m in got.comparison.modules}
    assert by["L1.router_ids"].rows_differing == 0 and by["L1.mlp_norm"].status == "equal"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_model_twice_shows_no_divergence_and_every_canonical_module(hf_models, family):
    d, a, _ = hf_models[family]
    r = run_trace(d, [Side("hf", "x", a), Side("hf", "y", a)], n_prompts=2, per_op=True)
    assert r.first is None and r.comparison.growth == []
    names = [m.name for m in r.comparison.modules]
    order = canonical_order(2, per_op=True)
    assert names == [n for n in order if n in names]       # forward order
    for n in ("embed", "L0.attn_norm", "L0.attn_core", "L0.attn", "L0.mlp_norm", "L0.mlp",
              "L1.router_logits", "L1.router_ids", "L1.mlp", "L1.layer", "norm", "logits"):
        assert n in names, n
    assert ("L0.k" in names) == (family == "qwen3_moe") and ("L0.kv_a" in names) == (
        family == "deepseek_v3")


def test_hf_against_the_invariant_trainer_parts_in_the_first_attention(qwen_moe_dir, hf_models):
    _, a, _ = hf_models["qwen3_moe"]
    r = run_trace(qwen_moe_dir, [Side("hf", "hf", a), "invariant"], n_prompts=2, per_op=True)
    # the embedding and the first RMSNorm agree bit for bit; attention is where they part
    assert r.first.name == "L0.attn"
    assert {m.name: m.status for m in r.comparison.modules}["L0.attn_norm"] == "equal"


def test_ulps_at_bf16():
    one = np.float32(1.0)
    nxt = torch.nextafter(torch.tensor(1.0, dtype=torch.bfloat16),
                          torch.tensor(2.0, dtype=torch.bfloat16)).float().item()
    assert bf16_ulps(np.array([one]), np.array([nxt]))[0] == 1.0
    assert bf16_ulps(np.array([0.0]), np.array([0.0]))[0] == 0.0
    assert bf16_ulps(np.array([-1e-3]), np.array([1e-3]))[0] == pytest.approx(2 * 2 ** 7 * 1e-3
                                                                              / 2 ** -10)


@settings(max_examples=40, deadline=None)
@given(st.floats(-1e4, 1e4, allow_nan=False, width=32).filter(lambda x: abs(x) > 1e-30),
       st.integers(1, 5))
def test_k_bf16_steps_are_about_k_ulps(x, k):
    t = torch.tensor(x, dtype=torch.bfloat16)
    y = t
    for _ in range(k):
        y = torch.nextafter(y, torch.tensor(float("inf"), dtype=torch.bfloat16))
    u = bf16_ulps(np.array([t.float().item()]), np.array([y.float().item()]))[0]
    # k steps of the smaller value's ulp measured in the larger's: between k/2 and k
    assert k / 2 <= u <= k + 1e-9


def test_cli_writes_trace_json_and_png_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "tr"
    rc = main(["trace", "--family", "qwen3_moe", "--sides", "hf,hf-mode", "--prompts", "2",
               "--per-op", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "hf vs hf-mode" in text and "L0.attn_norm" in text and "module" in text
    doc = json.loads((out / "trace.json").read_text())
    assert doc["settings"]["per_op"] is True and len(doc["sides"]) == 2
    assert [m["name"] for m in doc["modules"]][0] == "embed"
    # the mode's fixed-order matmuls part from stock somewhere in the first layer
    assert doc["first_divergence"]["name"].startswith("L0.")
    assert (out / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, field", [
    (["--sides", "hf,vllm2"], "unknown side 'vllm2'"),
    (["--sides", "hf"], "give two sides"),
    (["--model", "/nonexistent/ckpt", "--sides", "hf,invariant"], "no such directory"),
    (["--model", "/nonexistent/ckpt", "--family", "qwen3_moe"], "not both"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, field):
    rc = main(["trace", *argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and field in err[0] and err[0].startswith("error:")
    assert not (tmp_path / "o").exists()
