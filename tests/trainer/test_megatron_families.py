"""megatron-core on the families past Qwen3-MoE / DeepSeek-V3: Mixtral (no q/k norm, its checkpoint's
``block_sparse_moe`` names, softmax-then-renormalize router) and the dense decoders Qwen3 (q/k norm),
Llama, Qwen2 (q/k/v biases) and Mistral (a window that covers the context): the HF -> megatron -> HF
mapping is bitwise the identity from both HF forms, the GPTModel's logits match HF transformers' to fp32
rounding, and what megatron-core's GPT layer cannot reproduce is refused naming the field.
"""
import json

import pytest
import torch

from skyrl_numerics.errors import InputError

pytestmark = pytest.mark.megatron
mcore = pytest.importorskip("megatron.core")

FAMILIES = ("mixtral", "qwen3", "llama", "qwen2", "mistral")
LOGITS_ATOL = 1e-5  # fp32, as tests/trainer/test_megatron_model.py (Qwen3-MoE measured ~1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_bitwise_and_logits_match_hf(group, family):
    from skyrl_numerics.engine.weight_update import checkpoint_state_dict
    from skyrl_numerics.models import build_tiny_model, load_hf_model
    from skyrl_numerics.trainer.megatron import compat
    from skyrl_numerics.trainer.megatron.mapping import hf_to_megatron, megatron_to_hf, shard_for_rank
    from skyrl_numerics.trainer.megatron.model import build_gpt_model, init_parallel, load_weights

    d = build_tiny_model(family)
    hf = load_hf_model(d, dtype="float32")
    sd = {k: v.detach().clone() for k, v in checkpoint_state_dict(hf).items()}
    mc = hf_to_megatron(sd, d)
    back = megatron_to_hf(mc, d)
    assert set(back) == set(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
    # transformers>=5 in-memory names (Mixtral: mlp.gate, fused experts), both ways
    mem = {k: v.detach() for k, v in hf.state_dict().items() if not k.endswith("inv_freq")}
    mc2 = hf_to_megatron(mem, d)
    assert set(mc2) == set(mc) and all(torch.equal(mc2[k], mc[k]) for k in mc)
    fused = megatron_to_hf(mc, d, fused=True)
    assert set(fused) == set(mem) and all(torch.equal(fused[k], mem[k]) for k in mem)
    if family == "qwen2":
        assert "decoder.layers.0.self_attention.linear_qkv.bias" in mc
    torch.manual_seed(0)
    ids = torch.randint(2, 512, (2, 10))
    with compat.cpu_compat():
        init_parallel(1, 1)
        gm = build_gpt_model(d, route_replay=False)
        load_weights(gm, shard_for_rank(mc, d))
        logits = gm(ids, torch.arange(10)[None].expand(2, 10), attention_mask=None)
        logits.square().mean().backward()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    diff = (logits.detach() - ref).abs().max().item()
    assert diff <= LOGITS_ATOL, (family, diff)
    # not vacuous: the logits are far from each other across positions
    assert (ref[:, 1:] - ref[:, :-1]).abs().max() > 100 * LOGITS_ATOL
    layer = gm.decoder.layers[0]
    grad = layer.mlp.router.weight.grad if family == "mixtral" else layer.mlp.linear_fc1.weight.grad
    assert grad is not None and grad.abs().sum() > 0


@pytest.mark.parametrize("family,over,tp,ep,field", [
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, 1, 1,
     "rope_parameters"),
    ("mistral", {"sliding_window": 32}, 1, 1, "sliding_window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, 1, 1, "sliding_window"),
    ("llama", {"attention_bias": True}, 1, 1, "attention_bias"),
    ("llama", {"mlp_bias": True}, 1, 1, "mlp_bias"),
    ("qwen3", {"hidden_act": "gelu"}, 1, 1, "hidden_act"),
    ("mixtral", {"router_jitter_noise": 0.1}, 1, 1, "router_jitter_noise"),
    ("llama", {}, 2, 1, "tp"),
    ("qwen3", {}, 1, 2, "ep"),
    ("qwen3", {"tie_word_embeddings": True}, 1, 1, "tie_word_embeddings"),
    ("mixtral", {}, 1, 3, "ep"),
])
def test_configs_megatron_cannot_reproduce_are_refused_by_field(family, over, tp, ep, field):
    from skyrl_numerics.models import tiny_config
    from skyrl_numerics.trainer.megatron.model import check_parallel_config

    cfg = tiny_config(family)
    check_parallel_config(cfg, 1, 1)                # the tiny config itself is accepted
    with pytest.raises(InputError) as e:
        check_parallel_config(dict(cfg, **over), tp, ep)
    assert e.value.field == field, str(e.value)


def test_mixtral_tp2_ep2_shards_and_back(tmp_path):
    """Mixtral shards like Qwen3-MoE: whole KV groups of linear_qkv per TP rank, experts per EP rank."""
    from skyrl_numerics.models import init_tiny_model, tiny_config
    from skyrl_numerics.engine.weight_update import checkpoint_state_dict
    from skyrl_numerics.trainer.megatron.mapping import hf_to_megatron, shard_for_rank, unshard
    from skyrl_numerics.trainer.megatron.model import check_parallel_config

    cfg = tiny_config("mixtral", num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    check_parallel_config(cfg, 2, 2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = checkpoint_state_dict(init_tiny_model(cfg, 0))
    mc = hf_to_megatron(sd, tmp_path)
    parts = [(r, r, shard_for_rank(mc, tmp_path, tp_rank=r, tp=2, ep_rank=r, ep=2)) for r in range(2)]
    full = unshard(parts, tmp_path)
    assert set(full) == set(mc) and all(torch.equal(full[k], mc[k]) for k in mc)
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in parts[1][2]
    assert "decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight" not in parts[1][2]


@pytest.mark.parametrize("family,field", [("glm4_moe", "model_type"), ("gpt_oss", "model_type")])
def test_train_cli_refuses_an_unmapped_family_in_one_line(tmp_path, capsys, family, field):
    """``train --backend megatron`` on a family megatron is not mapped for: exit 2, one line naming
    the field, before any engine starts."""
    from skyrl_numerics.cli import main

    assert main(["train", "--backend", "megatron", "--family", family, "--configs", "plain,aligned",
                 "--steps", "1", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    # one error line (first imports of torchao/vLLM may log their own lines to stderr)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(err) == 1 and f"field '{field}'" in err[0], err
