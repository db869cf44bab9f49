"""Issue 38's hardest rows: DeepSeek-V3.2 (DSA), Qwen3-Next (Gated DeltaNet) and Nemotron-H
(Mamba-2), as tiny checkpoints written by transformers' own config classes.

- DeepSeek-V3.2 has a family (``deepseek_v32``): its fp32 forward is HF's to 1e-3 with the
  indexer really selecting, its bf16 forward is prefix-consistent bit for bit, configs it cannot
  reproduce are refused naming the field (the engine side: tests/e2e/test_deepseek_v32_vllm.py);
- Qwen3-Next and Nemotron-H have families (``qwen3_next``, ``nemotron_h``: tests/invariant/
  test_qwen3_next.py, test_nemotron_h.py; the engine side tests/e2e/test_qwen3_next_vllm.py,
  test_nemotron_h_vllm.py): the bitwise entry points accept them, Nemotron 3's MoE blocks
  included (``nemotron_h_moe``: tests/invariant/test_nemotron_h_moe.py); a Nemotron-H MoE whose
  shared expert HF and vLLM build differently is refused before an engine starts, naming
  ``n_shared_experts``.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_numerics.errors import InputError
from skyrl_numerics.invariant import from_checkpoint
from skyrl_numerics.invariant.blocks import UnsupportedConfig
from skyrl_numerics.models import build_tiny_model, load_hf_model, tiny_config

HYBRID = {"qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", "GatedDeltaNet"),
          "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig", "Mamba-2"),
          "nemotron_h_moe": ("NemotronHForCausalLM", "NemotronHConfig", "Mamba-2")}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hybrid_dirs():
    return {f: build_tiny_model(f) for f in HYBRID}


@pytest.mark.parametrize("family", list(HYBRID))
def test_tiny_hybrid_checkpoint_is_transformers_own_and_runs_in_hf(hybrid_dirs, family):
    from transformers import AutoConfig

    arch, cfg_cls, _ = HYBRID[family]
    d = hybrid_dirs[family]
    cfg = AutoConfig.from_pretrained(str(d))
    assert type(cfg).__name__ == cfg_cls and cfg.architectures == [arch]
    assert "linear_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    with torch.no_grad():
        logits = load_hf_model(d)(_ids(24, 0)[None]).logits[0]
    assert logits.shape == (24, 512) and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("family", list(HYBRID))
def test_a_hybrid_gets_the_invariant_engine(hybrid_dirs, family, capsys):
    """The bitwise entry points accept both hybrids: the overrides name the hybrid invariant
    model, and serve builds its command."""
    from skyrl_numerics.cli import main
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    arch = HYBRID[family][0]
    d = hybrid_dirs[family]
    over = engine_overrides(json.loads((d / "config.json").read_text()))
    assert over["architectures"] == [f"SkyrlInvariant{arch}"]
    assert main(["serve", str(d), "--batch-invariant", "--print-command"]) == 0
    assert f"SkyrlInvariant{arch}" in capsys.readouterr().out


def test_a_nemotron_h_moe_hf_and_vllm_disagree_on_is_refused_naming_the_field(hybrid_dirs):
    """Two shared experts: HF builds one of ``moe_shared_expert_intermediate_size``, vLLM one
    twice as wide — refused before any engine starts; an unknown block kind names
    ``layers_block_type``."""
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    cfg = json.loads((hybrid_dirs["nemotron_h_moe"] / "config.json").read_text())
    for over, field in (({"n_shared_experts": 2}, "n_shared_experts"),
                        ({"layers_block_type": ["linear_attention", "conv"]}, "layers_block_type")):
        with pytest.raises(UnsupportedConfig) as e:
            engine_overrides({**cfg, **over})
        assert e.value.field == field


def test_an_unknown_architecture_still_lists_the_supported_ones():
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    cfg = dict(tiny_config("qwen3_moe"), architectures=["FalconForCausalLM"])
    with pytest.raises(InputError, match=r"'FalconForCausalLM': supported: \[.*DeepseekV32"):
        engine_overrides(cfg)


# ---- DeepSeek-V3.2 (DSA) ----------------------------------------------------------------
def test_deepseek_v32_fp32_forward_matches_hf_with_the_indexer_selecting():
    """Same fp32 weights: logits within 1e-3 of HF's DeepseekV32 at every position of a
    48-token sequence with index_topk 16 (measured 1.7e-6), and the selection is HF's."""
    d = build_tiny_model("deepseek_v32", dtype="float32")
    m = from_checkpoint(d, dtype=torch.float32)
    hf = load_hf_model(d, dtype="float32")
    chosen = {}
    m.index_hook = lambda layer, sel, count: chosen.setdefault(layer, (sel, count))
    got = {}

    def keep(mod, inp, out):
        got["sel"] = out[0]
    hook = hf.model.layers[0].self_attn.indexer.register_forward_hook(keep)
    ids = _ids(48, 5)
    with torch.no_grad():
        ours = m.logits(m.sequence_hidden(ids))
        ref = hf(ids[None]).logits[0]
    hook.remove()
    assert (ours - ref).abs().max().item() < 1e-3
    sel, count = chosen[0]
    assert count.max().item() == 16 and count[-1].item() == 16       # 48 visible, 16 kept
    for q in (16, 30, 47):
        assert sel[q, :count[q]].tolist() == sorted(got["sel"][q].tolist()), q


def test_deepseek_v32_gradient_through_the_sparse_attention_is_hfs():
    """fp32 backward of a loss over every position (indexer selecting): the weight gradients of
    MLA's projections are HF autograd's to 1e-5 relative (measured 5e-7 .. 1e-6); the
    selection itself carries no gradient in either (a top-k)."""
    d = build_tiny_model("deepseek_v32", dtype="float32")
    m = from_checkpoint(d, dtype=torch.float32)
    hf = load_hf_model(d, dtype="float32")
    for p in m.parameters():
        p.requires_grad_(True)
    ids = _ids(40, 3)
    with torch.enable_grad():
        m.logits(m.sequence_hidden(ids)).logsumexp(-1).sum().backward()
        hf(ids[None]).logits[0].logsumexp(-1).sum().backward()
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.0.self_attn.q_b_proj.weight",
                 "model.layers.1.self_attn.kv_b_proj.weight"):
        ours, ref = m.params[name.replace(".", "__")].grad, hf.get_parameter(name).grad
        assert ours is not None and ((ours - ref).norm() / ref.norm()).item() < 1e-5, name


def test_deepseek_v32_bf16_forward_is_prefix_and_packing_invariant():
    m = from_checkpoint(build_tiny_model("deepseek_v32"))
    ids = _ids(40, 1)
    with torch.no_grad():
        full, pre = m.sequence_hidden(ids), m.sequence_hidden(ids[:25])
        packed = m.packed_hidden([ids[:25], ids])
    assert torch.equal(full[:25], pre) and torch.equal(packed[:25], pre)
    assert torch.equal(packed[25:], full)


@pytest.fixture(scope="module")
def v32_bf16():
    return from_checkpoint(build_tiny_model("deepseek_v32"))


@settings(max_examples=12)
@given(lens=st.lists(st.integers(1, 40), min_size=2, max_size=4), sq=st.integers(1, 3),
       seed=st.integers(0, 2 ** 16))
def test_deepseek_v32_sparse_attention_of_a_request_is_its_bits_alone_in_any_padded_batch(
        v32_bf16, lens, sq, seed):
    """attn_core over a right-padded batch of requests (the engine's decode / chunk groups:
    ``kv_lens``, padding rows of garbage) gives each request the bits it has alone: the
    indexer's choice and the attention over the chosen rows never see the other requests."""
    m = v32_bf16
    d, ix = m.dims, m.index
    g = torch.Generator().manual_seed(seed)
    lens = [max(n, sq) for n in lens]
    L = max(lens)
    W = d.heads * (d.kv_lora_rank + d.rope) + ix.heads * ix.head_dim + ix.heads
    q = torch.randn(len(lens), sq, 1, W, generator=g).bfloat16()
    rows = torch.randn(len(lens), L, m.kv.width, generator=g).bfloat16()
    batch = m.attn_core(0, q, rows, torch.tensor(lens))
    for b, n in enumerate(lens):
        alone = m.attn_core(0, q[b:b + 1], rows[b:b + 1, :n], None)
        assert torch.equal(batch[b], alone[0]), (b, n, lens)


def test_deepseek_v32_contract_covers_the_indexer(v32_bf16):
    """The execution contract's config digest includes the indexer's dims: a trainer with
    another index_topk than the engine's is a named mismatch, not a silent one."""
    import dataclasses

    from skyrl_numerics.invariant import contract

    other = from_checkpoint(build_tiny_model("deepseek_v32"))
    assert contract.of_model(other) == contract.of_model(v32_bf16)
    other.index = dataclasses.replace(other.index, topk=32)
    assert [f for f, _, _ in contract.of_model(other).diff(contract.of_model(v32_bf16))] == ["config"]


@pytest.mark.parametrize("over, kv, field", [
    ({}, "fp8", "kv_cache"),
    ({"q_lora_rank": None}, None, "q_lora_rank"),
    ({"mlp_layer_types": ["sparse", "dense"]}, None, "mlp_layer_types"),
])
def test_deepseek_v32_configs_it_cannot_reproduce_are_refused(over, kv, field):
    from skyrl_numerics.engine.vllm_invariant_model import engine_overrides

    cfg = json.loads(json.dumps(tiny_config("deepseek_v32", **over)))
    with pytest.raises(UnsupportedConfig) as e:
        engine_overrides(cfg, kv)
    assert e.value.field == field


# ---- DeepSeek-V3.2 on stock vLLM CPU: refused before the engine starts ---------------------
_SPARSE = "NotImplementedError: Sparse Attention is not supported on CPU"


@pytest.fixture(scope="module")
def v32_dir():
    return build_tiny_model("deepseek_v32")


def test_stock_generator_and_serve_refuse_deepseek_v32_on_cpu(v32_dir, capsys):
    pytest.importorskip("vllm")
    from skyrl_numerics.cli import main
    from skyrl_numerics.host import on_gpu
    from skyrl_numerics.trainer import VLLMGenerator

    if on_gpu():
        pytest.skip("GPU vLLM has sparse attention backends for DeepSeek-V3.2")
    with pytest.raises(InputError, match=_SPARSE) as e:
        VLLMGenerator(v32_dir)
    assert e.value.field == "architectures" and "DeepseekV32ForCausalLM" in str(e.value)
    assert main(["serve", str(v32_dir), "--print-command"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and _SPARSE in err[0], err
    # the batch-invariant model runs it: its serve command is built
    assert main(["serve", str(v32_dir), "--batch-invariant", "--print-command"]) == 0
    assert "SkyrlInvariantDeepseekV32ForCausalLM" in capsys.readouterr().out


def test_doctor_skips_deepseek_v32_stock_rows_with_vllms_error(v32_dir, tmp_path):
    from skyrl_numerics.cli import main
    from skyrl_numerics.host import on_gpu

    if on_gpu():
        pytest.skip("GPU vLLM has sparse attention backends for DeepSeek-V3.2")
    row, out = "baseline: HF trainer, bf16", tmp_path / "out"
    assert main(["doctor", "--model", str(v32_dir), "--prompts", "2", "--max-tokens", "4",
                 "--out", str(out), "--no-progress", "--row", row]) == 0
    status = {r["name"]: r["status"] for r in
              json.loads((out / "report.json").read_text())["rows"]}[row]
    assert status.startswith("skipped: stock vLLM") and _SPARSE in status, status
