"""megatron-core 0.16.1 on CPU: the compatibility module, the HF <-> megatron-core mapping, logits parity with
HF transformers, and the parallel-config checks (one process). TP 2 / EP 2 over gloo: test_megatron_parallel.py (named apart from tests/replay/test_megatron.py: test files share one module namespace).
"""
import numpy as np
import pytest
import torch

from skyrl_numerics.errors import InputError

pytestmark = pytest.mark.megatron
mcore = pytest.importorskip("megatron.core")


def test_spawn_and_trainer_refuse_bad_layout_before_any_group(qwen_moe_dir):
    import torch.distributed as dist

    from skyrl_numerics.trainer.megatron.trainer import MegatronTrainer, spawn_megatron

    # every test (and the train loop: TrainerWorker.close) leaves no default group behind
    assert not dist.is_initialized(), "a previous test left a default process group"
    with pytest.raises(InputError, match="num_attention_heads=4") as e:
        spawn_megatron(print, qwen_moe_dir, tp=3, ep=1)     # raises before any process starts
    assert e.value.field == "tp"
    with pytest.raises(InputError, match="num_experts=8"):
        MegatronTrainer(qwen_moe_dir, tp=1, ep=3)
    with pytest.raises(InputError, match="world_size=1"):   # no group: 1 rank, but tp=2 needs 2
        MegatronTrainer(qwen_moe_dir, tp=2, ep=1)
    from skyrl_numerics.trainer.config import TrainerConfig

    with pytest.raises(InputError, match="LoRA") as e:
        MegatronTrainer(qwen_moe_dir, TrainerConfig(lora_rank=4))
    assert e.value.field == "lora_rank"
    with pytest.raises(InputError, match="model_type 'gpt_oss'"):   # not mapped (docs/megatron.md)
        spawn_megatron(print, {"model_type": "gpt_oss"}, tp=1, ep=1)
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def hf(qwen_moe_dir):
    from skyrl_numerics.models import load_hf_model

    return load_hf_model(qwen_moe_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_sd(hf):
    from skyrl_numerics.engine.weight_update import checkpoint_state_dict

    return {k: v.detach().clone() for k, v in checkpoint_state_dict(hf).items()}


# ---- 1. the compatibility module ------------------------------------------------------------
def _patched_objects():
    import megatron.core.fusions.fused_softmax as fs
    import megatron.core.tensor_parallel.random as rnd
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    import megatron.core.transformer.moe.moe_utils as mu
    import megatron.core.transformer.moe.token_dispatcher as td
    import megatron.core.transformer.multi_latent_attention as mla

    c = torch.cuda
    return {
        "cuda.current_device": c.current_device, "cuda.Stream": c.Stream, "cuda.Event": c.Event,
        "cuda.current_stream": c.current_stream, "cuda.stream": c.stream, "cuda.synchronize": c.synchronize,
        "cuda.get_rng_state": c.get_rng_state, "cuda.manual_seed": c.manual_seed,
        "rnd._get_cuda_rng_state": rnd._get_cuda_rng_state, "rnd._set_cuda_rng_state": rnd._set_cuda_rng_state,
        "fs.get_default_causal_mask": fs.get_default_causal_mask,
        "fs.get_sliding_window_causal_mask": fs.get_sliding_window_causal_mask,
        "mu.te_general_gemm": ("te_general_gemm" in vars(mu), vars(mu).get("te_general_gemm")),
        "gg.grouped_gemm": gg.grouped_gemm, "gg.ops": gg.ops,
        "td.maybe_move_tensor_to_cpu": td.maybe_move_tensor_to_cpu,
        "td.cuda_dtoh_stream": td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream,
        "mla.HAVE_TE": mla.HAVE_TE,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compatibility installs only without CUDA")
def test_compat_installs_and_restores_everything():
    from skyrl_numerics.trainer.megatron import compat

    before = _patched_objects()
    assert not compat.installed()
    with compat.cpu_compat() as active:
        assert active and compat.installed()
        assert torch.cuda.current_device() == torch.device("cpu")
        with compat.cpu_compat():  # nested: reference-counted
            pass
        assert compat.installed()
        listed = compat.patches()
        assert listed[0] == "torch.cuda.current_device" and len(listed) == len(set(listed))
        assert listed[-1].endswith("MoEAlltoAllTokenDispatcher.cuda_dtoh_stream")
        during = _patched_objects()
        changed = {k for k in before if during[k] is not before[k] and during[k] != before[k]}
        # everything listed is replaced (te_general_gemm: bound to None where megatron never bound it)
        import megatron.core.extensions.transformer_engine as te

        keep = {"gg.grouped_gemm", "gg.ops"} if before["gg.grouped_gemm"] else set()
        keep |= set() if (before["mla.HAVE_TE"] and not te.HAVE_TE) else {"mla.HAVE_TE"}
        assert changed == set(before) - keep
        torch.cuda.Stream().wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.synchronize()
    assert not compat.installed() and compat.patches() == []
    after = _patched_objects()
    for k, v in before.items():
        assert after[k] is v or after[k] == v, k
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.Stream()  # the CPU-only torch refuses again


def test_compat_restores_after_an_error():
    from skyrl_numerics.trainer.megatron import compat

    before = _patched_objects()
    with pytest.raises(ZeroDivisionError):
        with compat.cpu_compat():
            1 / 0
    after = _patched_objects()
    assert all(after[k] is v or after[k] == v for k, v in before.items())


# ---- 2. mapping ------------------------------------------------------------------------------
@pytest.mark.parametrize("grouped", [False, True])
def test_mapping_round_trip_bitwise(qwen_moe_dir, hf, hf_sd, grouped):
    from skyrl_numerics.trainer.megatron.mapping import hf_to_megatron, megatron_to_hf, shard_for_rank, unshard

    mc = hf_to_megatron(hf_sd, qwen_moe_dir, grouped_experts=grouped)
    back = megatron_to_hf(mc, qwen_moe_dir)
    assert set(back) == set(hf_sd)
    for k, v in hf_sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # transformers>=5 in-memory (fused experts) names, both ways
    fused_in = {k: v for k, v in hf.state_dict().items()}
    mc2 = hf_to_megatron(fused_in, qwen_moe_dir, grouped_experts=grouped)
    assert set(mc2) == set(mc) and all(torch.equal(mc2[k], mc[k]) for k in mc)
    fused = megatron_to_hf(mc, qwen_moe_dir, fused=True)
    assert set(fused) == set(fused_in) and all(torch.equal(fused[k], fused_in[k]) for k in fused_in)
    # TP 2 x EP 2 shards and back (the pairs of a 2-process run: (ep0, tp0), (ep1, tp1))
    parts = [(r, r, shard_for_rank(mc, qwen_moe_dir, tp_rank=r, tp=2, ep_rank=r, ep=2)) for r in range(2)]
    full = unshard(parts, qwen_moe_dir)
    assert set(full) == set(mc) and all(torch.equal(full[k], mc[k]) for k in mc)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert parts[0][2][qkv].shape[0] == mc[qkv].shape[0] // 2


def test_mapping_refuses_missing_and_unknown_weights(qwen_moe_dir, hf_sd):
    from skyrl_numerics.trainer.megatron.mapping import hf_to_megatron

    sd = dict(hf_sd)
    del sd["model.layers.1.mlp.gate.weight"]
    with pytest.raises(InputError, match="model.layers.1.mlp.gate.weight"):
        hf_to_megatron(sd, qwen_moe_dir)
    sd = dict(hf_sd, **{"model.layers.0.mlp.shared_expert.weight": torch.zeros(2)})
    with pytest.raises(InputError, match="shared_expert"):
        hf_to_megatron(sd, qwen_moe_dir)
    sd = dict(hf_sd)
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"][:-1]
    with pytest.raises(InputError, match="shape"):
        hf_to_megatron(sd, qwen_moe_dir)


# ---- parity with HF transformers, one process ------------------------------------------------
LOGITS_ATOL = 1e-5  # fp32; measured max |Δlogit| ~1e-6 for |logit| <= 2.3


def test_gpt_model_logits_match_hf_transformers(group, qwen_moe_dir, hf, hf_sd):
    from skyrl_numerics.trainer.megatron import compat
    from skyrl_numerics.trainer.megatron.forward import MegatronPolicy
    from skyrl_numerics.trainer.megatron.mapping import hf_to_megatron, shard_for_rank
    from skyrl_numerics.trainer.megatron.model import build_gpt_model, init_parallel, load_weights

    torch.manual_seed(0)
    ids = torch.randint(0, 512, (3, 12))
    with compat.cpu_compat():
        init_parallel(1, 1)
        gm = build_gpt_model(qwen_moe_dir)
        load_weights(gm, shard_for_rank(hf_to_megatron(hf_sd, qwen_moe_dir), qwen_moe_dir))
        pos = torch.arange(12)[None].expand(3, 12)
        logits = gm(ids, pos, attention_mask=None)          # real GPTModel.forward incl. the lm-head
        h = MegatronPolicy(gm, 512).hidden(ids)
        (logits.square().mean() + h.sum()).backward()     # backward runs on CPU too
        calls = compat.calls()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        ref_h = hf.model(input_ids=ids).last_hidden_state
    d = (logits.detach() - ref).abs().max().item()
    assert d <= LOGITS_ATOL, d
    assert (h.detach() - ref_h).abs().max().item() <= LOGITS_ATOL
    assert gm.output_layer.weight.grad is not None and gm.decoder.layers[0].mlp.router.weight.grad.abs().sum() > 0
    # the stand-ins that a TP=EP=1 forward/backward needs
    for k in ("current_device", "current_stream", "stream", "get_default_causal_mask",
              "_get_cuda_rng_state", "_set_cuda_rng_state"):
        assert calls.get(k, 0) > 0, (k, calls)


# ---- bad layouts: InputError before any process group ----------------------------------------
@pytest.mark.parametrize("over,tp,ep,field,match", [
    ({}, 3, 1, "tp", "num_attention_heads=4"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, 1, "tp", "num_key_value_heads=3"),
    ({"vocab_size": 510, "num_attention_heads": 4, "num_key_value_heads": 4}, 4, 1, "tp", "vocab_size=510"),
    ({}, 1, 3, "ep", "num_experts=8"),
    ({}, 2, 0, "ep", "positive"),
    ({"mlp_only_layers": [0]}, 1, 1, "mlp_only_layers", "dense"),
])
def test_bad_parallel_config_is_refused(qwen_moe_dir, over, tp, ep, field, match):
    import json

    from skyrl_numerics.trainer.megatron.model import check_parallel_config

    cfg = dict(json.loads((qwen_moe_dir / "config.json").read_text()), **over)
    with pytest.raises(InputError, match=match) as e:
        check_parallel_config(cfg, tp, ep)
    assert e.value.field == field


# ---- grouped experts (legacy GroupedMLP, bf16) and QAT on them -------------------------------
@pytest.mark.slow
def test_grouped_experts_forward_and_qat(group, qwen_moe_dir, hf_sd):
    from skyrl_numerics.quant import fake_quant
    from skyrl_numerics.trainer.config import TrainerConfig
    from skyrl_numerics.trainer.megatron.trainer import MegatronTrainer

    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 8))
    out = {}
    for grouped in (False, True):
        t = MegatronTrainer(qwen_moe_dir, TrainerConfig(qat="nvfp4" if grouped else None), dtype=torch.bfloat16,
                            grouped_experts=grouped)
        try:
            with torch.no_grad():
                out[grouped] = t.policy.hidden(ids).float()
            if grouped:
                calls = __import__("skyrl_numerics.trainer.megatron.compat", fromlist=["x"]).calls()
                experts = t.gpt.decoder.layers[1].mlp.experts
                assert type(experts).__name__ == "ParametrizedGroupedMLP"  # torch parametrize subclasses it
                f = 64
                w1 = experts.weight1.detach().reshape(8, 128, 2 * f)   # parametrized read: fake-quantized
                w2 = experts.weight2.detach().reshape(8, f, 128)
                for e in range(8):
                    p = f"model.layers.1.mlp.experts.{e}."
                    gate = fake_quant(hf_sd[p + "gate_proj.weight"].bfloat16(), "nvfp4")
                    up = fake_quant(hf_sd[p + "up_proj.weight"].bfloat16(), "nvfp4")
                    down = fake_quant(hf_sd[p + "down_proj.weight"].bfloat16(), "nvfp4")
                    assert torch.equal(w1[e].t(), torch.cat([gate, up])) and torch.equal(w2[e].t(), down), e
                with torch.no_grad():
                    out["qat"] = t.policy.hidden(ids).float()
        finally:
            t.close()
    assert calls.get("gmm", 0) > 0  # the legacy GroupedMLP ran through the CPU grouped GEMM
    # the grouped run has QAT on (its forward is the fake-quantized model): compare the plain sequential
    # bf16 run with a grouped run without QAT instead
    t = MegatronTrainer(qwen_moe_dir, TrainerConfig(), dtype=torch.bfloat16, grouped_experts=True)
    try:
        with torch.no_grad():
            plain_grouped = t.policy.hidden(ids).float()
    finally:
        t.close()
    d = (plain_grouped - out[False]).abs().max().item()
    assert d <= 0.05, d  # bf16: expert GEMMs per expert either way, different layouts
    assert (out["qat"] - plain_grouped).abs().max().item() > 0  # the fake-quant changes the forward



@pytest.mark.slow
@pytest.mark.isa
def test_batch_invariant_megatron_forward_and_step(group, qwen_moe_dir):
    """Without the mode, micro-batch size changes some logprobs in the last bits (measured: about half of the
    tokens, max 1.4e-6); with it every size gives the same bits."""
    from skyrl_numerics.rollout import Rollout
    from skyrl_numerics.trainer.config import TrainerConfig
    from skyrl_numerics.trainer.megatron.trainer import MegatronTrainer

    rng = np.random.default_rng(0)
    lens = [5, 7, 3, 6]
    r = Rollout.from_lists([rng.integers(2, 512, 4 + i % 3).tolist() for i in range(4)],
                           [rng.integers(2, 512, n).tolist() for n in lens], [[-6.0] * n for n in lens],
                           group_ids=np.repeat([0, 1], 2), sampling={"temperature": 1.0})
    t = MegatronTrainer(qwen_moe_dir, TrainerConfig(batch_invariant=True))
    try:
        got = {}
        for mbs in (4, 3, 1):
            t.config.micro_batch_size = mbs
            got[mbs] = t.logprobs(r)
        m = t.step(r, rng.random(4))
    finally:
        t.close()
    np.testing.assert_array_equal(got[4], got[1])
    np.testing.assert_array_equal(got[4], got[3])
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0


# ---- DeepSeek-V3: MLA, sigmoid + bias + group-limited router, shared expert, dense first layer ------------
def test_deepseek_v3_mapping_round_trip_and_logits_match_hf(group, deepseek_v3_dir):
    from skyrl_numerics.models import load_hf_model
    from skyrl_numerics.trainer.megatron import compat
    from skyrl_numerics.trainer.megatron.mapping import hf_to_megatron, megatron_to_hf, shard_for_rank
    from skyrl_numerics.trainer.megatron.model import build_gpt_model, init_parallel, load_weights
    from skyrl_numerics.engine.weight_update import checkpoint_state_dict

    hf = load_hf_model(deepseek_v3_dir, dtype="float32")
    sd = {k: v.detach().clone() for k, v in checkpoint_state_dict(hf).items()}
    mc = hf_to_megatron(sd, deepseek_v3_dir)
    back = megatron_to_hf(mc, deepseek_v3_dir)
    assert set(back) == set(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
    assert "decoder.layers.1.mlp.router.expert_bias" in mc and "decoder.layers.0.mlp.linear_fc1.weight" in mc
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (3, 10))
    with compat.cpu_compat():
        init_parallel(1, 1)
        gm = build_gpt_model(deepseek_v3_dir)
        load_weights(gm, shard_for_rank(mc, deepseek_v3_dir))
        logits = gm(ids, torch.arange(10)[None].expand(3, 10), attention_mask=None)
        logits.square().mean().backward()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    d = (logits.detach() - ref).abs().max().item()
    assert d <= LOGITS_ATOL, d  # measured ~1.2e-6
    assert gm.decoder.layers[0].self_attention.linear_kv_up_proj.weight.grad.abs().sum() > 0


def test_deepseek_v3_layout_checks(deepseek_v3_dir):
    from skyrl_numerics.trainer.megatron.model import check_parallel_config

    check_parallel_config(deepseek_v3_dir, 1, 2)
    with pytest.raises(InputError, match="tp=1 only") as e:
        check_parallel_config(deepseek_v3_dir, 2, 1)
    assert e.value.field == "tp"
    with pytest.raises(InputError, match="ep=3 does not divide num_experts=8"):
        check_parallel_config(deepseek_v3_dir, 1, 3)
